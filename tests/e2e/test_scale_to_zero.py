"""Scale to zero with the local scaler: runners start on demand, idle models unload (and give
their memory back), idle runners stop, and a backlog adds runners up to max_replicas."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from fngate import clients
from fngate.registry import function_source
from fngate.up.scaler import LocalScaler, PoolSpec, pool_specs
from tests.conftest import EVERY_CONNECTION_KEPT, child_env, on_cluster_too

ROW = [0.5] * 16


@pytest.fixture
async def scaler(
    redis_url: str, repo: Path, tmp_path: Path, redis: aioredis.Redis
) -> AsyncIterator[Callable[..., Any]]:
    """Factory: the local scaler of `fngate up`, in this event loop, starting real runner processes
    (on a Redis flushed by the `redis` fixture: no heartbeat or start failure of another test)."""
    running: list[tuple[asyncio.Event, asyncio.Task[None], aioredis.Redis]] = []

    async def start(
        idle_shutdown_s: float = 1.0, repository: Path | None = None, standby: bool = False, **env: str
    ) -> LocalScaler:
        """`repository`: another than the suite's; `standby`: as `fngate up` keeps one."""
        served = repository or repo
        client = clients.connect(redis_url)
        source = function_source(str(served), client)

        async def pools() -> dict[str, PoolSpec]:
            return pool_specs(await source())

        found = LocalScaler(
            client,
            pools,
            child_env(redis_url, served, FNGATE_RESCAN_S="0.5", **env),
            idle_shutdown_s,
            tmp_path,
            poll_s=0.2,
            standby=standby,
        )
        stopping = asyncio.Event()
        running.append((stopping, asyncio.create_task(found.run(stopping)), client))
        return found

    yield start
    for stopping, task, client in running:
        stopping.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 60)
        await client.aclose()


def live(scaler: LocalScaler, pool: str) -> list[int]:
    """The live-runner counts of a pool, in the order they changed."""
    return [count for _at, name, count in scaler.timeline if name == pool]


async def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> None:
    for _ in range(int(timeout_s / 0.1)):
        if await predicate():
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


async def index_state(client: httpx.AsyncClient, name: str) -> dict[str, Any]:
    entries = (await client.post("/v2/repository/index", json={})).json()
    return next(entry for entry in entries if entry["name"] == name)


async def test_zero_to_answer_to_unload_to_exit_and_back(
    serve_gateway: Callable[..., Any], scaler: Callable[..., Any]
) -> None:
    base = await serve_gateway()
    local: LocalScaler = await scaler(idle_shutdown_s=1.5)
    assert live(local, "brief") == []  # nothing runs before the first invocation
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        first = await client.post("/v1/functions/brief", json={"inputs": {"input": [ROW]}})
        assert first.status_code == 200, first.text
        assert live(local, "brief") == [1]

        async def unloaded() -> bool:
            state = await index_state(client, "brief")
            return state.get("state") == "UNAVAILABLE" and "idle-unloaded" in state.get("reason", "")

        await wait_until(unloaded, 20, "the idle model to unload")

        async def exited() -> bool:
            return live(local, "brief")[-1:] == [0]

        await wait_until(exited, 20, "the idle runner to exit")
        again = await client.post("/v1/functions/brief", json={"inputs": {"input": [ROW]}})
        assert again.status_code == 200
        assert again.json()["outputs"] == first.json()["outputs"]
    assert live(local, "brief")[:3] == [1, 0, 1]  # a second cold start


@on_cluster_too
async def test_fifty_cold_invocations_start_one_runner(
    serve_gateway: Callable[..., Any], scaler: Callable[..., Any]
) -> None:
    base = await serve_gateway()
    local: LocalScaler = await scaler()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/functions/brief", json={"inputs": {"input": [ROW]}}) for _ in range(50))
        )
    assert [response.status_code for response in responses] == [200] * 50
    assert live(local, "brief") == [1]


async def test_backlog_scales_up_to_max_replicas_and_back_down(
    serve_gateway: Callable[..., Any], scaler: Callable[..., Any]
) -> None:
    base = await serve_gateway()
    local: LocalScaler = await scaler(idle_shutdown_s=1.0, PROBE_SLEEP_S="0.2")
    body = {"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}}
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=EVERY_CONNECTION_KEPT) as client:
        responses = await asyncio.gather(*(client.post("/v1/functions/crowd", json=body) for _ in range(150)))
        assert [response.status_code for response in responses] == [200] * 150

        async def back_to_zero() -> bool:
            return live(local, "crowd")[-1:] == [0]

        await wait_until(back_to_zero, 30, "the pool to scale back to zero")
    counts = live(local, "crowd")
    assert max(counts) == 3, counts  # max_replicas, never more
    assert counts[:3] == [1, 2, 3], counts
    assert counts[-1] == 0


async def test_a_runner_that_cannot_start_gives_503_with_retry_after(
    serve_gateway: Callable[..., Any], scaler: Callable[..., Any]
) -> None:
    base = await serve_gateway()
    # A misspelt setting stops a runner at start-up, before its first heartbeat.
    await scaler(FNGATE_NOT_A_SETTING="1")
    body = {"inputs": {"input": [ROW]}, "timeout_ms": 1000}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        first = await client.post("/v1/functions/brief", json=body)
        assert first.status_code == 504  # queued while the first start was still being tried
        for _ in range(100):
            refused = await client.post("/v1/functions/brief", json=body)
            if refused.status_code == 503:
                break
            await asyncio.sleep(0.1)
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert "no runner could start for pool 'brief'" in refused.json()["error"]
    assert "exited with code 2" in refused.json()["error"]
