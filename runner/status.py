"""The runner's own small HTTP port: GET /metrics (Prometheus), /healthz/live, /healthz/ready.

Ready means Redis answers and the runner consumes (it is not draining): not that a model is loaded,
since a runner of a pool with nothing queued loads nothing, and a Deployment whose pods never get
ready stalls every rollout. On a GPU, /metrics carries Triton's nv_gpu_* beside fngate's own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from fngate import nv_metrics, status_port
from fngate.nvml import read_gpus

log = logging.getLogger(__name__)
READY_PING_TIMEOUT_S = 1.0

Readiness = Callable[[], Awaitable[bool]]


def redis_ready(redis: aioredis.Redis, stopping: asyncio.Event) -> Readiness:
    """Ready while not stopping and Redis answers a PING within READY_PING_TIMEOUT_S."""

    async def ready() -> bool:
        if stopping.is_set():
            return False
        try:
            async with asyncio.timeout(READY_PING_TIMEOUT_S):
                return bool(await redis.ping())
        except (RedisError, OSError, TimeoutError):
            return False

    return ready


class StatusServer:
    def __init__(self, host: str, port: int, ready: Readiness) -> None:
        self._host = host
        self._port = port
        self._ready = ready
        self.port: int | None = None

    async def run(self) -> None:
        """Serve until cancelled; a port that is taken is logged, not fatal."""
        try:
            server = await status_port.start(self._route, self._host, self._port)
        except OSError as exc:
            log.warning(
                "status port %s:%d unavailable (%s); no /metrics from this runner",
                self._host,
                self._port,
                exc,
            )
            return
        self.port = server.sockets[0].getsockname()[1]
        log.info("runner status on http://%s:%d/metrics", self._host, self.port)
        async with server:
            await server.serve_forever()

    async def _route(self, path: str) -> tuple[str, str, bytes]:
        if path == "/metrics":
            gpus = nv_metrics.render(nv_metrics.gpu_families(await asyncio.to_thread(read_gpus)))
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest() + gpus
        if path == "/healthz/live":
            return "200 OK", "text/plain", b"live\n"
        if path == "/healthz/ready":
            if await self._ready():
                return "200 OK", "text/plain", b"ready\n"
            return "503 Service Unavailable", "text/plain", b"starting\n"
        return status_port.NOT_FOUND
