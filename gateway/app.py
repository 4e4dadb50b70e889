"""create_app(settings): the composition root of the gateway. Its lifespan opens Redis and the
core (catalog, dispatcher, replies, activator, keys, limits), starts the background loops and the
gRPC front end, and hands every front end the same Services."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from redis.exceptions import RedisError
from starlette.types import ASGIApp

from fngate import apikeys, clients
from fngate.backoff import Health, until_done
from fngate.config import GatewaySettings
from fngate.kube import InCluster, KubeError
from fngate.registry import function_source
from gateway.activation import Activator
from gateway.allowance import DecodeAllowance
from gateway.auth import KeyTable
from gateway.cache import CacheHealth, SeparateCache
from gateway.catalog import Catalog
from gateway.destinations import CallbackPolicy
from gateway.dispatch import Dispatcher
from gateway.grpc import server as grpc_server
from gateway.http import app as http_app
from gateway.http.callbacks import CallbackSender
from gateway.http.deployments import Deployer
from gateway.invocations import AsyncInvocations
from gateway.limits import Limiter
from gateway.replies import ReplyRouter
from gateway.shared_memory import SharedMemory
from gateway.state import Services

log = logging.getLogger(__name__)
LOOPS_STOP_S = 2.0


def create_app(settings: GatewaySettings, stopping: asyncio.Event | None = None) -> ASGIApp:
    """The gateway app. `stopping` is set if a background loop dies, so the server can shut down."""
    key_table = KeyTable(
        settings.auth_refresh_s, settings.auth, apikeys.hashed_admins(settings.admin_key_hash)
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[dict[str, Any]]:
        async with serving(settings, key_table, stopping) as services:
            yield {"services": services}

    return http_app.build(settings, key_table, lifespan)


@contextlib.asynccontextmanager
async def serving(
    settings: GatewaySettings, key_table: KeyTable, stopping: asyncio.Event | None
) -> AsyncIterator[Services]:
    """The core, opened: Redis reached, the catalog loaded, the reply loop reading, every background
    loop running (each guarded: one that dies sets `stopping`); closed in the reverse order."""
    gateway_id = uuid.uuid4().hex[:12]
    # redis-py's pool, for what is not on the hot path; invocations wait for a free connection
    # rather than fail when many are in use at once.
    redis = clients.connect_pool(
        settings.redis_url,
        settings.redis_connections,
        5,
        socket_connect_timeout=settings.redis_timeout_s,
        socket_timeout=settings.redis_timeout_s,
    )
    # A Redis that stops answering (paused, partitioned) fails the blocking reads too, so the reply
    # loop notices and invocations are refused at once instead of waiting out deadlines.
    reader = clients.connect(
        settings.redis_url,
        socket_connect_timeout=settings.redis_timeout_s,
        socket_timeout=settings.reply_block_ms / 1000 + settings.redis_timeout_s,
    )
    health = Health("redis")  # the activator's and the catalog's view of Redis: readiness
    activator = Activator(reader, health=health, kube=_kube(settings))
    # The catalog's reads (one of them a blocking XREAD) use the client that blocks on replies, so
    # that the invocations' connections stay the invocations'; they block as long as a reply read.
    source = function_source(settings.repo, reader)
    catalog = Catalog(source, reader, health, lambda: source.unreadable, settings.reply_block_ms / 1000)
    pipelined = clients.fastredis(settings.redis_url, settings.redis_timeout_s)  # the enqueue's
    reply_reads = clients.fastredis(settings.redis_url, settings.redis_timeout_s)
    replies = ReplyRouter(reader, reply_reads, gateway_id, settings.reply_block_ms, settings.redis_timeout_s)
    separate = _separate_cache(settings)
    limiter = Limiter(settings.in_flight_ttl_s, pipelined) if settings.auth else None
    dispatcher = Dispatcher(
        pipelined,
        replies,
        catalog,
        limiter,
        separate,
        activator,
        health,
        settings.result_quota_bytes,
        settings.result_memory_share,
        settings.deadline_admission,
        settings.group_invocations,
    )
    destinations = CallbackPolicy(settings.callback_allow)
    callbacks = CallbackSender(
        reader,
        pipelined,
        gateway_id,
        catalog,
        settings.callback_secret.get_secret_value().encode(),
        settings.reply_block_ms,
        destinations,
    )
    asyncs = AsyncInvocations(
        pipelined,
        settings.redis_url,
        settings.redis_timeout_s,
        catalog,
        quotas=bool(settings.result_quota_bytes or settings.result_memory_share),
    )
    services = Services(
        settings,
        catalog,
        dispatcher,
        asyncs,
        key_table,
        redis,
        Deployer(settings),
        DecodeAllowance(settings.max_decode_bytes),
        destinations,
        SharedMemory(redis, settings.allow_client_shm, settings.max_body_bytes),
    )
    async with redis, reader:
        if not await until_done(redis.ping, (RedisError, OSError), "redis", stopping):
            raise RuntimeError("asked to stop before Redis answered")
        await catalog.refresh()
        await replies.start()
        if settings.auth:
            await key_table.refresh(reader)
        log.info("gateway %s serving %d functions from %s", gateway_id, len(catalog.functions), settings.repo)
        loops = [
            _guard(replies.run(), "reply loop", stopping),
            _guard(replies.sweep(), "reply sweep", stopping),
            _guard(activator.run(), "activator loop", stopping),
            _guard(catalog.run(settings.catalog_refresh_s), "catalog loop", stopping),
            _guard(callbacks.run(), "callback loop", stopping),
        ]
        if settings.auth:
            loops.append(_guard(key_table.run(reader), "API key loop", stopping))
        running = [asyncio.create_task(loop) for loop in loops]
        try:
            async with contextlib.AsyncExitStack() as front_ends:
                if settings.grpc_port or settings.grpc_bind:
                    await front_ends.enter_async_context(grpc_server.serving(services))
                yield services
        finally:
            # The loops are asked to stop, and given a moment: one blocked in a client call that
            # swallows its cancellation (redis-py's can) must not hold the shutdown, nor keep the
            # connections below from closing.
            for task in running:
                task.cancel()
            _, still = await asyncio.wait(running, timeout=LOOPS_STOP_S)
            for task in still:  # a defect: say where it waits, for the next time
                waits = " < ".join(f"{f.f_code.co_qualname}:{f.f_lineno}" for f in task.get_stack())
                log.error("a background loop did not stop within %.0f s, waiting in %s", LOOPS_STOP_S, waits)
            if separate is not None:
                await separate.aclose()
            await replies.stop()
            await asyncs.aclose()
            await pipelined.aclose()
            await reply_reads.aclose()


def _kube(settings: GatewaySettings) -> InCluster | None:
    """The Kubernetes API for push activation, when it is on and the pod can reach it; without it
    KEDA's poll alone wakes a pool (said once, at start)."""
    if not settings.kubernetes_wake:
        return None
    try:
        kube = InCluster.from_pod()
    except KubeError as exc:
        log.error(
            "FNGATE_KUBERNETES_WAKE is set but pools cannot be woken: %s; KEDA's poll alone wakes them", exc
        )
        return None
    log.info("waking runner pools at zero through the Kubernetes API (namespace %s)", kube.namespace)
    return kube


def _separate_cache(settings: GatewaySettings) -> SeparateCache | None:
    """A cache Redis of its own, when one is configured apart from the queue's."""
    if not settings.cache_url or settings.cache_url == settings.redis_url:
        return None
    client = clients.connect(settings.cache_url, socket_connect_timeout=1, socket_timeout=1)
    return SeparateCache(client, CacheHealth())


async def _guard(loop: Coroutine[Any, Any, None], name: str, stopping: asyncio.Event | None) -> None:
    """Run a background loop; if it dies, log it and ask the server to stop rather than limp on."""
    try:
        await loop
    except asyncio.CancelledError:
        raise
    except BaseException:
        log.exception("%s died; stopping the gateway", name)
        if stopping is not None:
            stopping.set()
