"""Nothing accepted is lost: runner crashes, poison invocations, deadlines, back-pressure, drains."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from fngate import keys

PROBE = "/v2/models/probe/infer"


def probe_body(first: float, rows: int = 1, **parameters: Any) -> dict[str, Any]:
    data = [[first, 1.0, 2.0, 3.0]] * rows
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": data}],
        "parameters": parameters,
    }


def doubled(response: httpx.Response, first: float) -> None:
    assert response.status_code == 200, response.text
    data = response.json()["outputs"][0]["data"]
    assert data[:4] == [first * 2, 2.0, 4.0, 6.0]


async def wait_for(predicate: Callable[[], Any], timeout_s: float = 20, what: str = "condition") -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


async def test_sigkill_mid_batch_loses_nothing(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    base = await serve_gateway()
    env = {
        "PROBE_SLEEP_S": "0.3",
        "FNGATE_CLAIM_IDLE_MS": "1000",
        "FNGATE_CLAIM_INTERVAL_MS": "100",
        "FNGATE_FUNCTIONS": '["probe"]',
    }
    runners = [runner_process(**env), runner_process(**env)]
    stream = keys.invocations("probe")
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        calls = [asyncio.create_task(client.post(PROBE, json=probe_body(float(i)))) for i in range(40)]

        async def someone_busy() -> bool:
            try:
                consumers = await redis.xinfo_consumers(stream, keys.RUNNER_GROUP)
            except ResponseError:  # no runner has created the group yet
                return False
            return any(consumer["pending"] > 0 for consumer in consumers)

        await wait_for(someone_busy, what="a runner with invocations in flight")
        consumers = await redis.xinfo_consumers(stream, keys.RUNNER_GROUP)
        victim_name = next(consumer["name"] for consumer in consumers if consumer["pending"] > 0)
        victim_pid = int(victim_name.decode().split("-")[-2])
        victim = next(runner for runner in runners if runner.pid == victim_pid)
        victim.send_signal(signal.SIGKILL)
        responses = await asyncio.gather(*calls)
    assert victim.wait(timeout=5) == -signal.SIGKILL
    for index, response in enumerate(responses):
        doubled(response, float(index))
    assert await redis.xlen(stream) == 0
    pending = await redis.xpending(stream, keys.RUNNER_GROUP)
    assert pending["pending"] == 0


async def test_poison_invocation_is_dead_lettered(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis: aioredis.Redis,
) -> None:
    base = await serve_gateway()
    env = {
        "FNGATE_CLAIM_IDLE_MS": "200",
        "FNGATE_CLAIM_INTERVAL_MS": "100",
        "FNGATE_MAX_DELIVERIES": "2",
        "FNGATE_FUNCTIONS": '["probe"]',
    }
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        call = asyncio.create_task(client.post(PROBE, json=probe_body(-2.0)))
        starts = 0
        while not call.done():
            starts += 1
            runner = runner_process(**env)
            await asyncio.wait(
                [call, asyncio.create_task(asyncio.to_thread(runner.wait))],
                return_when=asyncio.FIRST_COMPLETED,
            )
            assert starts <= 5, "the poison invocation was retried without end"
        response = call.result()
        assert response.status_code == 500
        assert "delivered 2 times" in response.json()["error"]
        assert starts == 3  # delivered to two runners that died, dead-lettered by the third
        # The surviving runner still serves.
        doubled(await client.post(PROBE, json=probe_body(5.0)), 5.0)
    assert await redis.xlen(keys.dead_letters("probe")) == 1
    assert await redis.xlen(keys.invocations("probe")) == 0


async def test_failing_batch_answers_each_member_and_runner_survives(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any]
) -> None:
    base = await serve_gateway()
    await inprocess_runner(functions=("probe",))
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        failed = await client.post(PROBE, json=probe_body(-1.0, rows=2))
        assert failed.status_code == 500
        assert failed.json() == {
            "error": "function 'probe' failed: ValueError: probe was asked to fail",
            "code": "model_failed",
        }
        doubled(await client.post(PROBE, json=probe_body(3.0)), 3.0)


async def test_expired_invocation_is_not_executed(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    base = await serve_gateway()
    log = tmp_path / "probe.log"
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        late = await client.post(PROBE, json=probe_body(42.0, timeout_ms=1000))
        assert late.status_code == 504
        assert "did not answer within 1000 ms" in late.json()["error"]
        assert await redis.xlen(keys.invocations("probe")) == 1  # queued, nobody served it in time
        runner_process(PROBE_LOG=str(log), FNGATE_FUNCTIONS='["probe"]')
        doubled(await client.post(PROBE, json=probe_body(7.0)), 7.0)
    assert log.read_text().split() == ["7"]
    assert await redis.xlen(keys.invocations("probe")) == 0


async def test_full_queue_answers_503_with_retry_after(
    serve_gateway: Callable[..., Any], redis: aioredis.Redis
) -> None:
    base = await serve_gateway()
    stream = keys.invocations("probe")
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        # No runner: 50 invocations (the probe's max_queue_size) wait in the queue.
        fillers = [
            asyncio.create_task(client.post(PROBE, json=probe_body(1.0, timeout_ms=3000))) for _ in range(50)
        ]

        async def full() -> bool:
            return bool(await redis.xlen(stream) == 50)

        await wait_for(full, what="50 queued invocations")
        refused = await client.post(PROBE, json=probe_body(1.0))
        assert {response.status_code for response in await asyncio.gather(*fillers)} == {504}
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert "max_queue_size" in refused.json()["error"]
    assert await redis.xlen(stream) == 50


async def test_sigterm_drains_in_flight_work(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    base = await serve_gateway()
    log = tmp_path / "probe.log"
    env = {"PROBE_SLEEP_S": "0.5", "PROBE_LOG": str(log), "FNGATE_FUNCTIONS": '["probe"]'}
    first = runner_process(**env)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        calls = [asyncio.create_task(client.post(PROBE, json=probe_body(float(i)))) for i in range(10)]

        async def executing() -> bool:
            return log.exists() and bool(log.read_text())

        await wait_for(executing, what="the first batch to start")
        first.send_signal(signal.SIGTERM)
        # A rolling restart: the replacement serves what the first runner had not read yet.
        runner_process(**env)
        responses = await asyncio.gather(*calls)
    assert await asyncio.to_thread(first.wait, 30) == 0
    for index, response in enumerate(responses):
        doubled(response, float(index))
    executed = sorted(float(line) for line in log.read_text().split())
    assert executed == [float(i) for i in range(10)]  # each exactly once
    assert await redis.xlen(keys.invocations("probe")) == 0


async def test_rows_are_returned_to_their_own_invocation(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any]
) -> None:
    base = await serve_gateway()
    await inprocess_runner(functions=("probe",))
    rng = np.random.default_rng(3)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        bodies = [rng.standard_normal((int(rng.integers(1, 5)), 4)).astype(np.float32) for _ in range(40)]
        responses = await asyncio.gather(
            *(client.post("/v1/functions/probe", json={"inputs": {"x": body.tolist()}}) for body in bodies)
        )
    for body, response in zip(bodies, responses, strict=True):
        assert response.status_code == 200, response.text
        np.testing.assert_allclose(np.asarray(response.json()["outputs"]["y"]), body * 2, rtol=1e-6)
