"""The gateway's readiness follows its Redis: 503 with a JSON reason while Redis is gone, 200 again
once it is back (the same gateway process, which never exits for it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import start_redis


async def ready_status(client: httpx.AsyncClient, wanted: int, timeout_s: float = 20) -> httpx.Response:
    """Poll /v2/health/ready until it answers `wanted`."""
    for _ in range(int(timeout_s / 0.05)):
        response = await client.get("/v2/health/ready")
        if response.status_code == wanted:
            return response
        await asyncio.sleep(0.05)
    raise AssertionError(f"/v2/health/ready never answered {wanted}")


async def test_ready_is_503_while_redis_is_gone(serve_gateway: Callable[..., Any], tmp_path: Path) -> None:
    folder = tmp_path / "redis"
    folder.mkdir()
    process, url = start_redis(folder)
    try:
        base = await serve_gateway(redis_url=url)
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            await ready_status(client, 200)
            process.kill()
            process.wait()
            down = await ready_status(client, 503)
            assert down.json()["code"] == "unavailable"
            assert "redis unavailable" in down.json()["error"]
            assert down.headers["retry-after"]
            assert (await client.get("/v2/health/live")).status_code == 200  # alive, not ready
            process, _ = start_redis(folder)  # the same socket, as a restarted Redis would be
            await ready_status(client, 200)
    finally:
        process.kill()
        process.wait()
