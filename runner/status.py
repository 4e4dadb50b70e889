"""The runner's own small HTTP port: GET /metrics (Prometheus), /healthz/live, /healthz/ready.

Ready means Redis answers and the runner consumes (it is not draining): not that a model is loaded,
since a runner of a pool with nothing queued loads nothing, and a Deployment whose pods never get
ready stalls every rollout. A stdlib asyncio server: three GET routes need no web framework."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

log = logging.getLogger(__name__)
MAX_HEADER_BYTES = 16 * 1024
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
            server = await asyncio.start_server(self._handle, self._host, self._port, limit=MAX_HEADER_BYTES)
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

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            status, content_type, body = await self._route(request_line)
            writer.write(
                f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _route(self, request_line: list[str]) -> tuple[str, str, bytes]:
        if len(request_line) < 2 or request_line[0] != "GET":
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        path = request_line[1].split("?", 1)[0]
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest()
        if path == "/healthz/live":
            return "200 OK", "text/plain", b"live\n"
        if path == "/healthz/ready":
            if await self._ready():
                return "200 OK", "text/plain", b"ready\n"
            return "503 Service Unavailable", "text/plain", b"starting\n"
        return "404 Not Found", "text/plain", b"not found\n"
