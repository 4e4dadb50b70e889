"""The runner's readiness, which the runner Deployment's probe reads: ready while Redis answers and
the runner consumes, whether or not a model is loaded; not ready while Redis is gone or it drains."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Callable

import httpx
import redis.asyncio as aioredis

from runner.status import StatusServer, redis_ready
from tests.conftest import free_socket


async def test_ready_follows_redis_and_draining(
    extra_redis: Callable[..., tuple[subprocess.Popen[bytes], str]],
) -> None:
    process, url = extra_redis()
    client = aioredis.from_url(url, socket_connect_timeout=1)
    stopping = asyncio.Event()
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    serving = asyncio.create_task(StatusServer("127.0.0.1", port, redis_ready(client, stopping)).run())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            await wait_listening(http)
            assert (await http.get("/healthz/ready")).status_code == 200  # nothing loaded: still ready
            process.terminate()
            process.wait(timeout=10)
            assert (await http.get("/healthz/ready")).status_code == 503
            assert (await http.get("/healthz/live")).status_code == 200  # alive: no restart for that
            stopping.set()
            assert (await http.get("/healthz/ready")).status_code == 503
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await client.aclose()


async def wait_listening(http: httpx.AsyncClient) -> None:
    for _ in range(200):
        try:
            await http.get("/healthz/live")
        except httpx.TransportError:
            await asyncio.sleep(0.02)
        else:
            return
    raise TimeoutError("the status server did not listen")
