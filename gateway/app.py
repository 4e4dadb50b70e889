"""create_app(settings): routes, error handler and lifespan. The composition root of the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from fngate import keys, telemetry
from fngate.config import GatewaySettings
from fngate.errors import FunctionError
from fngate.registry import function_source
from gateway import admin, endpoints, metrics
from gateway.activation import Activator
from gateway.cache import CacheHealth, SeparateCache
from gateway.catalog import Catalog
from gateway.compression import GzipLargeResponses
from gateway.dispatch import Dispatcher
from gateway.http_errors import handle_function_error, handle_unknown_route
from gateway.replies import ReplyRouter
from gateway.tracing import TracingMiddleware

log = logging.getLogger(__name__)
GZIP_MIN_BYTES = 64 * 1024

# Starlette tries routes in order: the invocation routes come first, they carry the traffic.
ROUTES = [
    Route("/v2/models/{name}/infer", endpoints.infer_v2, methods=["POST"]),
    Route("/v1/functions/{name}", endpoints.invoke_v1, methods=["POST"]),
    Route("/v2/models/{name}/versions/{version}/infer", endpoints.infer_v2, methods=["POST"]),
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
    *admin.ROUTES,
]


def create_app(settings: GatewaySettings, stopping: asyncio.Event | None = None) -> Starlette:
    """The gateway app. `stopping` is set if a background loop dies, so the server can shut down."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, endpoints.Services]]:
        gateway_id = uuid.uuid4().hex[:12]
        # Invocations wait for a free connection rather than fail when many are in flight at once.
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.redis_url,
            max_connections=settings.redis_connections,
            timeout=5,
            socket_connect_timeout=5,
        )
        redis = aioredis.Redis.from_pool(pool)  # owns the pool: closing it closes the connections
        reader = aioredis.from_url(settings.redis_url, socket_connect_timeout=5)
        activator = Activator(reader)
        # The catalog's reads (one of them a blocking XREAD) use the client that blocks on replies,
        # so that the invocations' connection pool stays the invocations'.
        catalog = Catalog(function_source(settings.repo, reader), reader)
        app.state.load_timeout_s = settings.load_timeout_s
        replies = ReplyRouter(reader, keys.replies(gateway_id), settings.reply_block_ms)
        async with redis, reader:
            await redis.ping()
            await catalog.refresh()
            log.info(
                "gateway %s serving %d functions from %s", gateway_id, len(catalog.functions), settings.repo
            )
            async with asyncio.TaskGroup() as tasks:
                loops = [
                    tasks.create_task(_guard(replies.run(), "reply loop", stopping)),
                    tasks.create_task(_guard(activator.run(), "activator loop", stopping)),
                    tasks.create_task(
                        _guard(catalog.run(settings.catalog_refresh_s), "catalog loop", stopping)
                    ),
                ]
                try:
                    separate = _separate_cache(settings)
                    dispatcher = Dispatcher(redis, replies, separate, activator)
                    yield {
                        "services": endpoints.Services(catalog, dispatcher, settings.max_body_bytes, redis)
                    }
                    if separate is not None:
                        await separate.aclose()
                finally:
                    for loop in loops:
                        loop.cancel()
            with contextlib.suppress(Exception):
                await redis.delete(replies.stream)

    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        exception_handlers={
            FunctionError: handle_function_error,
            404: handle_unknown_route,
            405: handle_unknown_route,
        },
        middleware=[
            # Clients that accept gzip get large responses compressed; small ones pass as they are.
            Middleware(GzipLargeResponses, minimum_bytes=GZIP_MIN_BYTES),
            # Without a tracing SDK configured, server spans would be no-ops: skip the layer entirely.
            *([Middleware(TracingMiddleware)] if telemetry.tracing_active() else []),
        ],
    )
    app.state.retry_after_s = settings.retry_after_s
    return app


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
