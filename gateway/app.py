"""create_app(settings): routes, error handler and lifespan. The composition root of the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp

from fngate import apikeys, telemetry
from fngate.backoff import Health, until_done
from fngate.config import GatewaySettings
from fngate.errors import FunctionError
from fngate.pipelined import PipelinedRedis
from fngate.registry import function_source
from gateway import admin, deployments, endpoints, metrics
from gateway.activation import Activator
from gateway.auth import KeyTable
from gateway.cache import CacheHealth, SeparateCache
from gateway.callbacks import CallbackSender
from gateway.catalog import Catalog
from gateway.compression import GzipLargeResponses
from gateway.dispatch import Dispatcher
from gateway.guard import AuthMiddleware
from gateway.http_errors import handle_function_error, handle_unknown_route
from gateway.invocations import AsyncInvocations
from gateway.invoke import InvokeRoutes
from gateway.limits import Limiter
from gateway.replies import ReplyRouter
from gateway.results import ROUTES as INVOCATION_ROUTES
from gateway.tracing import TracingMiddleware

log = logging.getLogger(__name__)
LOOPS_STOP_S = 2.0
GZIP_MIN_BYTES = 64 * 1024

# The invocation routes are gateway.invoke's, in front of these.
ROUTES = [
    Route("/v2/health/live", endpoints.live),
    Route("/v2/health/ready", endpoints.ready),
    Route("/v2", endpoints.server_metadata),
    Route("/v2/", endpoints.server_metadata),
    Route("/v2/models/stats", endpoints.model_statistics),
    Route("/v2/models/{name}", endpoints.model_metadata),
    Route("/v2/models/{name}/versions/{version}", endpoints.model_metadata),
    Route("/v2/models/{name}/ready", endpoints.model_ready),
    Route("/v2/models/{name}/versions/{version}/ready", endpoints.model_ready),
    Route("/v2/models/{name}/config", endpoints.model_config_json),
    Route("/v2/models/{name}/versions/{version}/config", endpoints.model_config_json),
    Route("/v2/models/{name}/stats", endpoints.model_statistics),
    Route("/v2/models/{name}/versions/{version}/stats", endpoints.model_statistics),
    Route("/v1/functions", endpoints.list_functions),
    Route("/metrics", metrics.metrics),
    *deployments.ROUTES,
    *admin.ROUTES,
    *INVOCATION_ROUTES,
]


def create_app(settings: GatewaySettings, stopping: asyncio.Event | None = None) -> ASGIApp:
    """The gateway app. `stopping` is set if a background loop dies, so the server can shut down."""
    key_table = KeyTable(
        settings.auth_refresh_s, settings.auth, apikeys.hashed_admins(settings.admin_key_hash)
    )
    limiter = Limiter(settings.in_flight_ttl_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        gateway_id = uuid.uuid4().hex[:12]
        # Invocations wait for a free connection rather than fail when many are in flight at once.
        connections = aioredis.BlockingConnectionPool.from_url(
            settings.redis_url,
            max_connections=settings.redis_connections,
            timeout=5,
            socket_connect_timeout=settings.redis_timeout_s,
            socket_timeout=settings.redis_timeout_s,
        )
        redis = aioredis.Redis.from_pool(connections)  # closing it closes the connections
        # A Redis that stops answering (paused, partitioned) fails the blocking reads too, so the
        # reply loop notices and invocations are refused at once instead of waiting out deadlines.
        reader = aioredis.from_url(
            settings.redis_url,
            socket_connect_timeout=settings.redis_timeout_s,
            socket_timeout=settings.reply_block_ms / 1000 + settings.redis_timeout_s,
        )
        health = Health("redis")  # the activator's and the catalog's view of Redis: readiness
        activator = Activator(reader, health=health)
        # The catalog's reads (one of them a blocking XREAD) use the client that blocks on replies,
        # so that the invocations' connections stay the invocations'.
        catalog = Catalog(function_source(settings.repo, reader), reader, health)
        pipelined = PipelinedRedis(settings.redis_url, settings.redis_timeout_s)  # the enqueue's
        reply_reads = PipelinedRedis(settings.redis_url, settings.redis_timeout_s)
        replies = ReplyRouter(
            reader, reply_reads, gateway_id, settings.reply_block_ms, settings.redis_timeout_s
        )
        asyncs = AsyncInvocations(pipelined, settings.redis_url, settings.redis_timeout_s, catalog, activator)
        callbacks = CallbackSender(
            reader,
            pipelined,
            gateway_id,
            catalog,
            settings.callback_secret.get_secret_value().encode(),
            settings.reply_block_ms,
        )
        async with redis, reader:
            await until_done(redis.ping, (RedisError, OSError), "connecting to Redis", log)
            await catalog.refresh()
            await replies.start()
            if settings.auth:
                await key_table.refresh(reader)
                limiter.bind(redis)
            log.info(
                "gateway %s serving %d functions from %s", gateway_id, len(catalog.functions), settings.repo
            )
            loops = [
                asyncio.create_task(_guard(replies.run(), "reply loop", stopping)),
                asyncio.create_task(_guard(replies.sweep(), "reply sweep", stopping)),
                asyncio.create_task(_guard(activator.run(), "activator loop", stopping)),
                asyncio.create_task(
                    _guard(catalog.run(settings.catalog_refresh_s), "catalog loop", stopping)
                ),
            ]
            loops.append(asyncio.create_task(_guard(callbacks.run(), "callback loop", stopping)))
            if settings.auth:
                loops.append(asyncio.create_task(_guard(key_table.run(reader), "API key loop", stopping)))
            separate = _separate_cache(settings)
            asyncs.separate_cache = separate
            try:
                dispatcher = Dispatcher(pipelined, replies, separate, activator, health)
                yield {
                    "services": endpoints.Services(
                        catalog, dispatcher, settings.max_body_bytes, redis, settings.load_timeout_s
                    ),
                    "deployer": deployments.Deployer(settings),
                    "invocations": asyncs,
                }
            finally:
                # The loops are asked to stop, and given a moment: one blocked in a client call that
                # swallows its cancellation (redis-py's can) must not hold the shutdown, nor keep the
                # connections below from closing.
                for loop in loops:
                    loop.cancel()
                await asyncio.wait(loops, timeout=LOOPS_STOP_S)
                if separate is not None:
                    await separate.aclose()
                await replies.stop()
                await asyncs.aclose()
                await pipelined.aclose()
                await reply_reads.aclose()

    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        exception_handlers={
            FunctionError: handle_function_error,
            404: handle_unknown_route,
            405: handle_unknown_route,
        },
    )
    app.state.retry_after_s = settings.retry_after_s
    # The layers, outermost first: tracing (only with a tracing SDK configured; otherwise its spans
    # would be no-ops), the key check on every route but health, the invocation routes, the rest.
    # Clients that accept gzip get large responses compressed, invocations' included.
    invocations = InvokeRoutes(app, settings.retry_after_s, settings.body_timeout_s)
    served: ASGIApp = GzipLargeResponses(invocations, GZIP_MIN_BYTES)
    if settings.auth:
        served = AuthMiddleware(served, key_table, limiter)
    return TracingMiddleware(served) if telemetry.tracing_active() else served


def _separate_cache(settings: GatewaySettings) -> SeparateCache | None:
    """A cache Redis of its own, when one is configured apart from the queue's."""
    if not settings.cache_url or settings.cache_url == settings.redis_url:
        return None
    client = aioredis.from_url(settings.cache_url, socket_connect_timeout=1, socket_timeout=1)
    return SeparateCache(client, CacheHealth())


async def _guard(loop: object, name: str, stopping: asyncio.Event | None) -> None:
    """Run a background loop; if it dies, log it and ask the server to stop rather than limp on."""
    try:
        await loop  # type: ignore[misc]
    except asyncio.CancelledError:
        raise
    except BaseException:
        log.exception("%s died; stopping the gateway", name)
        if stopping is not None:
            stopping.set()
