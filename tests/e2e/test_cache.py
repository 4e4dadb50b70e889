"""The shared response cache: hits across gateways, bypass, new versions, coalescing, failure."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from fngate import keys
from tests.conftest import EVERY_CONNECTION_KEPT, on_cluster_too, queued_invocations, wait_http
from tests.e2e.function_output import FunctionOutput

MEMO = "/v2/models/memo/infer"


def body(first: float, **parameters: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [first, 1, 2, 3]}],
        "parameters": parameters,
    }


async def test_hit_across_two_gateway_processes(
    gateway_process: Callable[..., str],
    runner_process: Callable[..., Any],
    function_output: FunctionOutput,
    redis: aioredis.Redis,
) -> None:
    runner_process(PROBE_LOG="1", FNGATE_FUNCTIONS='["memo"]')
    first, second = gateway_process(), gateway_process()
    for base in (first, second):
        await wait_http(base)
    async with httpx.AsyncClient(timeout=30) as client:
        miss = await client.post(first + MEMO, json=body(5.0))
        hit = await client.post(second + MEMO, json=body(5.0))
        v1_hit = await client.post(f"{first}/v1/functions/memo", json={"inputs": {"x": [[5.0, 1, 2, 3]]}})
    assert (miss.status_code, hit.status_code, v1_hit.status_code) == (200, 200, 200)
    assert miss.headers["x-fngate-cache"] == "miss"
    assert miss.json()["parameters"]["cache_hit"] is False
    assert hit.headers["x-fngate-cache"] == "hit"
    assert hit.json()["parameters"]["cache_hit"] is True
    assert hit.json()["outputs"] == miss.json()["outputs"]
    assert v1_hit.json()["cached"] is True
    assert v1_hit.json()["outputs"]["y"] == [[10.0, 2.0, 4.0, 6.0]]
    assert function_output.executions(1) == ["5"]
    assert len([key async for key in redis.scan_iter(match=keys.cache_prefix("memo") + "*")]) == 1
    command = [
        sys.executable,
        "-m",
        "fngate.cli.main",
        "cache",
        "clear",
        "memo",
        "--redis",
        await _url(redis),
    ]
    cleared = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, check=False)
    assert cleared.returncode == 0, cleared.stderr
    assert "cleared 1 cached responses of memo" in cleared.stdout
    assert [key async for key in redis.scan_iter(match=keys.cache_prefix("memo") + "*")] == []


async def _url(redis: aioredis.Redis) -> str:
    kwargs = redis.connection_pool.connection_kwargs
    return f"unix://{kwargs['path']}"


@on_cluster_too
async def test_bypass_runs_the_model_again(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    function_output: FunctionOutput,
    monkeypatch: Any,
) -> None:
    monkeypatch.setenv("PROBE_LOG", "1")
    base = await serve_gateway()
    await inprocess_runner(functions=("memo",))
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await client.post(MEMO, json=body(7.0))).headers["x-fngate-cache"] == "miss"
        assert (await client.post(MEMO, json=body(7.0))).headers["x-fngate-cache"] == "hit"
        header = await client.post(MEMO, json=body(7.0), headers={"Cache-Control": "no-cache"})
        parameter = await client.post(MEMO, json=body(7.0, cache=False))
        bad = await client.post(MEMO, json=body(7.0, cache="maybe"))
    assert header.headers["x-fngate-cache"] == parameter.headers["x-fngate-cache"] == "miss"
    assert bad.status_code == 400
    assert function_output.executions(3) == ["7", "7", "7"]


async def test_a_new_model_never_gets_the_old_answers(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    repo: Path,
    tmp_path: Path,
) -> None:
    own = tmp_path / "repo"
    shutil.copytree(repo / "memo", own / "memo")
    base = await serve_gateway(repo=str(own), catalog_refresh_s=0.1)
    first = await inprocess_runner(repo=str(own), functions=("memo",))
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await client.post(MEMO, json=body(1.0))).json()["outputs"][0]["data"] == [2, 2, 4, 6]
        assert (await client.post(MEMO, json=body(1.0))).headers["x-fngate-cache"] == "hit"
        # Deploy a new model into the same folder: its digest changes, and with it every cache key.
        model = own / "memo" / "model.py"
        source = model.read_text()
        model.unlink()
        model.write_text(source.replace('return {"y": x * 2}', 'return {"y": x * 3}'))
        first.stopping.set()
        await first.task
        await inprocess_runner(repo=str(own), functions=("memo",))
        for _ in range(100):
            response = await client.post(MEMO, json=body(1.0))
            if response.headers["x-fngate-cache"] == "miss":
                break
            await asyncio.sleep(0.05)
    assert response.headers["x-fngate-cache"] == "miss"
    assert response.json()["outputs"][0]["data"] == [3, 3, 6, 9]


@on_cluster_too
async def test_identical_concurrent_invocations_run_once(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    function_output: FunctionOutput,
) -> None:
    base = await serve_gateway()
    runner_process(PROBE_LOG="1", PROBE_SLEEP_S="0.5", FNGATE_FUNCTIONS='["memo"]')
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        warm = await client.post(MEMO, json=body(0.0))  # the model is loaded before the burst
        assert warm.status_code == 200
        responses = await asyncio.gather(*(client.post(MEMO, json=body(9.0)) for _ in range(20)))
    assert {response.status_code for response in responses} == {200}
    assert {str(response.json()["outputs"]) for response in responses} == {
        str(responses[0].json()["outputs"])
    }
    assert function_output.executions(2) == ["0", "9"]


@on_cluster_too
async def test_a_waiter_runs_in_place_of_the_invocation_it_waited_on_when_that_expires(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    function_output: FunctionOutput,
    redis: aioredis.Redis,
) -> None:
    base = await serve_gateway()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        # No runner yet: the first invocation expires in the queue while an identical one waits on it.
        first = asyncio.create_task(client.post(MEMO, json=body(13.0, timeout_ms=300)))
        await asyncio.sleep(0.1)
        waiting = asyncio.create_task(client.post(MEMO, json=body(13.0, timeout_ms=20_000)))
        assert (await first).status_code == 504
        runner_process(PROBE_LOG="1", FNGATE_FUNCTIONS='["memo"]')
        response = await waiting
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [26.0, 2.0, 4.0, 6.0]
    assert function_output.executions(1) == [
        "13"
    ]  # the expired one never ran; the waiter ran once, in its place


async def test_cache_down_fails_open(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    extra_redis: Callable[..., tuple[subprocess.Popen[bytes], str]],
    function_output: FunctionOutput,
    monkeypatch: Any,
) -> None:
    monkeypatch.setenv("PROBE_LOG", "1")
    cache_process, cache_url = extra_redis()
    base = await serve_gateway(cache_url=cache_url)
    await inprocess_runner(cache_url=cache_url, functions=("memo",))
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await client.post(MEMO, json=body(4.0))).headers["x-fngate-cache"] == "miss"
        assert (await client.post(MEMO, json=body(4.0))).headers["x-fngate-cache"] == "hit"
        cache_process.send_signal(signal.SIGKILL)
        cache_process.wait()
        after = [await client.post(MEMO, json=body(4.0)) for _ in range(3)]
        metrics = (await client.get("/metrics")).text
    assert [response.status_code for response in after] == [200, 200, 200]
    assert [response.headers["x-fngate-cache"] for response in after] == ["miss"] * 3
    assert function_output.executions(4) == ["4"] * 4
    failures = [line for line in metrics.splitlines() if line.startswith("fngate_cache_failures_total ")]
    assert failures and float(failures[0].split()[1]) >= 3  # each failed lookup is counted


async def test_cache_pressure_never_evicts_queued_invocations(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    extra_redis: Callable[..., tuple[subprocess.Popen[bytes], str]],
) -> None:
    # The documented set-up for a shared server: only keys with a TTL (cache entries) are evicted.
    _process, url = extra_redis("--maxmemory", "8mb", "--maxmemory-policy", "volatile-lru")
    base = await serve_gateway(redis_url=url)
    shared = aioredis.from_url(url)
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=EVERY_CONNECTION_KEPT) as client:
        queued = [
            asyncio.create_task(
                client.post(
                    "/v2/models/probe/infer",
                    json={
                        "inputs": [
                            {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [float(i), 1, 2, 3]}
                        ]
                    },
                )
            )
            for i in range(30)
        ]
        for _ in range(500):
            if await queued_invocations(shared, keys.invocations("probe")) == 30:
                break
            await asyncio.sleep(0.02)
        for index in range(200):  # about 20 MB of cache entries into an 8 MB server
            await shared.set(keys.cache_entry("memo", f"{index:064x}"), b"v" * 100_000, ex=600)
        info = await shared.info("stats")
        assert info["evicted_keys"] > 0
        assert await queued_invocations(shared, keys.invocations("probe")) == 30
        await inprocess_runner(redis_url=url, functions=("probe",))
        responses = await asyncio.gather(*queued)
    await shared.aclose()
    assert [response.status_code for response in responses] == [200] * 30
