"""Nothing accepted is lost: runner crashes, poison invocations, deadlines, back-pressure, drains."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from bench.models import write_poison_functions
from fngate import keys
from tests.conftest import EVERY_CONNECTION_KEPT, queued_invocations
from tests.e2e.function_output import FunctionOutput

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
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=EVERY_CONNECTION_KEPT) as client:
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


async def queued_together(
    client: httpx.AsyncClient, redis: aioredis.Redis, function: str, firsts: list[float]
) -> list[asyncio.Task[httpx.Response]]:
    """One invocation per `firsts` (x[0]) of `function`, all in its queue before any runner reads
    it, so that a runner that starts then takes them as one batch."""
    calls = []
    for first in firsts:
        body = {"inputs": {"x": [[first, 1.0, 2.0, 3.0]]}}
        calls.append(asyncio.create_task(client.post(f"/v1/functions/{function}", json=body)))

        async def queued(count: int = len(calls)) -> bool:
            return bool(await queued_invocations(redis, keys.invocations(function)) >= count)

        await wait_for(queued, what=f"{len(calls)} queued invocations")  # in this order
    return calls


def answered(response: httpx.Response, first: float) -> None:
    assert response.status_code == 200, response.text
    assert response.json()["outputs"]["y"] == [[first * 2, 2.0, 4.0, 6.0]]


async def killed_at_each_poison(
    answers: Sequence[asyncio.Future[Any]],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    env: dict[str, str],
    function_output: FunctionOutput,
) -> int:
    """Start runners one after the other until every answer is in, killing each as its poison
    invocation says "poison" (it hangs where a real one would take its runner down); answers how
    many were started."""
    starts = 0
    while not all(answer.done() for answer in answers):
        starts += 1
        assert starts <= 4, "the poison invocation was retried without end"
        runner = runner_process(**env)
        died = asyncio.create_task(function_output.wait_for("poison", starts))
        together = asyncio.gather(*answers, return_exceptions=True)
        await asyncio.wait([died, together], return_when=asyncio.FIRST_COMPLETED)
        if died.done():
            runner.kill()
            await asyncio.to_thread(runner.wait)
        died.cancel()
    return starts


async def test_a_poison_invocation_that_kills_its_runner_is_dead_lettered_alone(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis: aioredis.Redis,
    function_output: FunctionOutput,
) -> None:
    """1 poison among 15 innocents in one batch: its runner dies, the next runner runs each alone,
    the poison first, and dies too; only the poison has run each time, so it alone is
    dead-lettered, and the 15, which only waited behind it in the second runner, are answered."""
    base = await serve_gateway()
    env = {
        "FNGATE_CLAIM_IDLE_MS": "200",
        "FNGATE_CLAIM_INTERVAL_MS": "100",
        "FNGATE_MAX_DELIVERIES": "2",
        "FNGATE_FUNCTIONS": '["probe"]',
    }
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        calls = await queued_together(client, redis, "probe", [-2.0, *range(1, 16)])
        starts = await killed_at_each_poison(calls, runner_process, env, function_output)
        responses = [call.result() for call in calls]
    assert starts == 3  # a batch (the poison's first run), the poison alone, then the dead letter
    assert responses[0].status_code == 500
    assert "ran 2 times and no runner finished it" in responses[0].json()["error"]
    for first, response in zip(range(1, 16), responses[1:], strict=True):
        answered(response, float(first))
    assert await redis.xlen(keys.dead_letters("probe")) == 1
    assert await redis.xlen(keys.invocations("probe")) == 0


@pytest.mark.parametrize(
    ("function", "poison", "status", "error"),
    [
        ("poison", -3.0, 500, "its process exited with code 3 while running the batch"),
        ("poison", -4.0, 504, "the batch ran past its execution timeout of 500 ms"),
        ("poison", -5.0, 500, "the batch needed more memory than its memory_limit_mb of 200 MiB"),
        (
            "pick",
            1000.0,
            500,
            "indices element out of data bounds, idx=1000 must be within the inclusive range [-16,15]",
        ),
    ],
    ids=["exits", "hangs", "over-memory", "onnx-fails"],
)
async def test_a_batch_that_fails_answers_its_innocents(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis: aioredis.Redis,
    tmp_path: Path,
    function_output: FunctionOutput,
    function: str,
    poison: float,
    status: int,
    error: str,
) -> None:
    """1 poison among 15 innocents in one batch of a Python function (its process exits, hangs or
    passes its memory limit) or an ONNX one (onnxruntime fails on its value): the batch is split,
    each innocent gets its own answer and the poison alone its error, and nothing is dead-lettered."""
    folder = tmp_path / "repo"
    # The hang is cut at 500 ms; the other poisons get a long execution timeout, so that on a busy
    # machine the memory hog meets its limit (or the process its exit) before the clock.
    write_poison_functions(folder, execution_timeout_ms=500 if status == 504 else 20_000)
    base = await serve_gateway(repo=str(folder))
    firsts = [float(first) for first in range(1, 9)] + [poison] + [float(first) for first in range(9, 16)]
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        calls = await queued_together(client, redis, function, firsts)
        runner = runner_process(FNGATE_REPO=str(folder), FNGATE_FUNCTIONS=json.dumps([function]))
        responses = await asyncio.gather(*calls)
    for first, response in zip(firsts, responses, strict=True):
        if first == poison:
            assert response.status_code == status, response.text
            assert error in response.json()["error"]
        else:
            answered(response, first)
    if function == "poison":  # its model says how big each batch was: one of 16, then 16 of one
        await function_output.wait_for("batch of 1", 16, timeout_s=10)
        assert function_output.lines("poison").count("batch of 16") == 1
    log = (tmp_path / "runner-0.log").read_text()
    assert f"{function}: a batch of 16 invocations failed as a whole" in log
    assert runner.poll() is None
    assert await redis.xlen(keys.dead_letters(function)) == 0


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
    function_output: FunctionOutput,
) -> None:
    base = await serve_gateway()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        late = await client.post(PROBE, json=probe_body(42.0, timeout_ms=1000))
        assert late.status_code == 504
        assert "did not answer within 1000 ms" in late.json()["error"]
        assert (
            await queued_invocations(redis, keys.invocations("probe")) == 1
        )  # queued, nobody served it in time
        runner_process(PROBE_LOG="1", FNGATE_FUNCTIONS='["probe"]')
        doubled(await client.post(PROBE, json=probe_body(7.0)), 7.0)
    assert function_output.executions(1) == ["7"]
    assert await redis.xlen(keys.invocations("probe")) == 0


async def test_full_queue_answers_503_with_retry_after(
    serve_gateway: Callable[..., Any], redis: aioredis.Redis
) -> None:
    base = await serve_gateway()
    stream = keys.invocations("probe")
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=EVERY_CONNECTION_KEPT) as client:
        # No runner: 50 invocations (the probe's max_queue_size) wait in the queue.
        fillers = [
            asyncio.create_task(client.post(PROBE, json=probe_body(1.0, timeout_ms=3000))) for _ in range(50)
        ]

        async def full() -> bool:
            return bool(await queued_invocations(redis, stream) == 50)

        await wait_for(full, what="50 queued invocations")
        refused = await client.post(PROBE, json=probe_body(1.0))
        assert {response.status_code for response in await asyncio.gather(*fillers)} == {504}
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert "max_queue_size" in refused.json()["error"]
    assert await queued_invocations(redis, stream) == 50


async def test_sigterm_drains_in_flight_work(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis: aioredis.Redis,
    function_output: FunctionOutput,
) -> None:
    base = await serve_gateway()
    env = {"PROBE_SLEEP_S": "0.5", "PROBE_LOG": "1", "FNGATE_FUNCTIONS": '["probe"]'}
    first = runner_process(**env)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        calls = [asyncio.create_task(client.post(PROBE, json=probe_body(float(i)))) for i in range(10)]

        async def executing() -> bool:
            return bool(function_output.lines())

        await wait_for(executing, what="the first batch to start")
        first.send_signal(signal.SIGTERM)
        # A rolling restart: the replacement serves what the first runner had not read yet.
        runner_process(**env)
        responses = await asyncio.gather(*calls)
    assert await asyncio.to_thread(first.wait, 30) == 0
    for index, response in enumerate(responses):
        doubled(response, float(index))
    executed = sorted(float(first) for first in function_output.executions(10))
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
