"""Admission by deadline: an invocation that its function's runners cannot reach before its deadline
is refused at once, and those admitted are answered in time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench.admission import MANIFEST, write_function
from fngate import keys
from fngate.registry import read_runners
from gateway.dispatch import estimated_wait_ms
from tests.conftest import EVERY_CONNECTION_KEPT

HEARTBEAT_S = 0.5
"""The runner's heartbeat, which carries the batch cost it measured. A runner is live for three
heartbeats (1.5 s); on a loaded machine a shorter one (0.2 s) let a late heartbeat drop the runner
from the gateway's view for a moment, and with it the cost that admission estimates from (it then
admits everything: an estimate that errs refuses too little)."""


async def queued(redis: aioredis.Redis, at_least: int = 20) -> None:
    """Once the backlog's calls are on steady's stream (at least `at_least`, some 0.8 s of work at
    40 ms each): they reach the gateway in their own time, later on a loaded machine."""
    stream = keys.invocations("steady")
    for _ in range(1000):
        if await redis.xlen(stream) >= at_least:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the backlog never held {at_least} calls: {await redis.xlen(stream)}")


async def measured(client: httpx.AsyncClient, redis: aioredis.Redis, body: Any, settle_s: float) -> None:
    """Five calls of steady, so that its runner measures the batch cost and reports it in its
    heartbeat; then `settle_s` for the gateway, which reads the runners' states every 0.1 s."""
    for _ in range(5):
        assert (await client.post("/v2/models/steady/infer", json=body)).status_code == 200
    for _ in range(100):
        if any("steady" in view.costs for view in await read_runners(redis)):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(settle_s)


def test_the_estimate_counts_what_is_ahead_less_what_has_run_since() -> None:
    cost = (50_000.0, 0.0, 1)  # 50 ms a batch of one row, one runner
    assert estimated_wait_ms(10, 0.0, cost, 1) == 550.0  # ten ahead, then its own
    assert estimated_wait_ms(10, 0.2, cost, 1) == 350.0  # four have run since
    assert estimated_wait_ms(10, 1.0, cost, 1) == 50.0  # its own batch
    assert estimated_wait_ms(10, 0.0, (50_000.0, 0.0, 2), 1) == 275.0  # two runners share them
    assert estimated_wait_ms(11, 0.0, (40_000.0, 1_000.0, 1), 4) == 132.0  # 3 batches and 12 rows


async def test_what_cannot_make_its_deadline_is_refused_at_once(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """A function that runs one invocation in about 40 ms, called 100 times a second with a deadline
    of 600 ms: those that would wait past it get 503 at once, naming the estimate (how many of the
    admitted make their deadline, and the goodput against no admission, is the benchmark's)."""
    write_function(tmp_path / "repo" / "steady")  # one invocation at a time, about 40 ms each
    base = await serve_gateway(repo=str(tmp_path / "repo"), catalog_refresh_s=0.1)
    await inprocess_runner(repo=str(tmp_path / "repo"), heartbeat_s=HEARTBEAT_S)
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}],
        "parameters": {"timeout_ms": 600},
    }
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=EVERY_CONNECTION_KEPT) as client:
        await measured(client, redis, body, 2)

        async def call() -> tuple[int, float, str]:
            began = time.perf_counter()
            answer = await client.post("/v2/models/steady/infer", json=body)
            return answer.status_code, time.perf_counter() - began, answer.text

        calls = []
        for _ in range(60):
            calls.append(asyncio.create_task(call()))
            await asyncio.sleep(0.01)
        done = await asyncio.gather(*calls)
    refused = [(took, text) for status, took, text in done if status == 503]
    answered = [status for status, _, _ in done if status == 200]
    assert refused, "nothing was refused: 60 calls in 0.6 s, where the runner answers 15"
    for took, text in refused:  # at once: not after waiting for the deadline it could not make
        assert "would answer in about" in text and "past this call's deadline of 600 ms" in text, text
        assert took < 0.6, refused
    assert answered, done


async def test_what_waits_at_a_higher_priority_counts_against_a_lower_ones_deadline(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """Two priority levels: runners read level 1 first, so a level-2 call behind a backlog of level-1
    calls is refused at once, though its own stream is empty; once the backlog has run, it is served."""
    folder = tmp_path / "repo" / "steady"
    write_function(folder)
    levels = "max_queue_size: 5000, priority_levels: 2, default_priority_level: 2}"
    manifest = MANIFEST.replace("max_queue_size: 5000}", levels)
    assert manifest != MANIFEST
    (folder / "function.yaml").write_text(manifest)
    base = await serve_gateway(repo=str(tmp_path / "repo"), catalog_refresh_s=0.1)
    await inprocess_runner(repo=str(tmp_path / "repo"), heartbeat_s=HEARTBEAT_S)

    def body(priority: int, timeout_ms: int) -> dict[str, Any]:
        parameters = {"priority": priority, "timeout_ms": timeout_ms}
        return {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}],
            "parameters": parameters,
        }

    async with httpx.AsyncClient(base_url=base, timeout=30, limits=EVERY_CONNECTION_KEPT) as client:
        await measured(client, redis, body(1, 5000), 1)
        backlog = [
            asyncio.create_task(client.post("/v2/models/steady/infer", json=body(1, 5000))) for _ in range(40)
        ]
        await queued(redis)  # 40 at about 40 ms each, in the queue: over a second of work ahead
        began = time.perf_counter()
        late = await client.post("/v2/models/steady/infer", json=body(2, 600))
        took = time.perf_counter() - began
        assert late.status_code == 503, late.text
        assert "would answer in about" in late.text and "deadline of 600 ms" in late.text, late.text
        assert took < 0.6
        assert [answer.status_code for answer in await asyncio.gather(*backlog)] == [200] * 40
        served = await client.post("/v2/models/steady/infer", json=body(2, 600))
        assert served.status_code == 200, served.text


CHAIN = """
name: chain
inputs: [{name: x, datatype: FP32, shape: [-1, 2]}]
outputs: [{name: y, datatype: FP32, shape: [-1, 2]}]
batching: {timeout_ms: 5000, max_batch_size: 1}
pipeline:
  steps: [{name: first, function: steady, inputs: {x: request.x}}]
  outputs: {y: first.y}
"""


async def test_a_pipeline_whose_first_step_cannot_make_its_deadline_is_refused_at_once(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    write_function(tmp_path / "repo" / "steady")
    (tmp_path / "repo" / "chain").mkdir()
    (tmp_path / "repo" / "chain" / "function.yaml").write_text(CHAIN)
    base = await serve_gateway(repo=str(tmp_path / "repo"), catalog_refresh_s=0.1)
    await inprocess_runner(repo=str(tmp_path / "repo"), heartbeat_s=HEARTBEAT_S)

    def body(timeout_ms: int) -> dict[str, Any]:
        inputs = [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]
        return {"inputs": inputs, "parameters": {"timeout_ms": timeout_ms}}

    async with httpx.AsyncClient(base_url=base, timeout=30, limits=EVERY_CONNECTION_KEPT) as client:
        await measured(client, redis, body(5000), 1)
        backlog = [
            asyncio.create_task(client.post("/v2/models/steady/infer", json=body(5000))) for _ in range(40)
        ]
        await queued(redis)  # 40 at about 40 ms each, in the queue: over a second of work ahead
        began = time.perf_counter()
        late = await client.post("/v2/models/chain/infer", json=body(600))
        took = time.perf_counter() - began
        assert late.status_code == 503, late.text
        assert "step 'first' of pipeline 'chain' (function 'steady') would answer in about" in late.text
        assert "deadline of 600 ms" in late.text and took < 0.6, (late.text, took)
        assert [answer.status_code for answer in await asyncio.gather(*backlog)] == [200] * 40
        served = await client.post("/v2/models/chain/infer", json=body(600))
        assert served.status_code == 200, served.text


async def test_an_asynchronous_call_that_cannot_make_its_deadline_is_refused_at_once(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    """Runners read asynchronous invocations after every synchronous level: an asynchronous call with
    a 600 ms deadline behind a backlog of synchronous calls is refused at once (503 with Retry-After,
    where it was accepted and its result expired as deadline_exceeded), a repeat of a submission
    that was accepted (its Idempotency-Key) still answers the invocation it made, and once the
    backlog has run the call is accepted and answered."""
    write_function(tmp_path / "repo" / "steady")
    base = await serve_gateway(repo=str(tmp_path / "repo"), catalog_refresh_s=0.1)
    await inprocess_runner(repo=str(tmp_path / "repo"), heartbeat_s=HEARTBEAT_S)

    def body(timeout_ms: int) -> dict[str, Any]:
        inputs = [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}]
        return {"inputs": inputs, "parameters": {"timeout_ms": timeout_ms}}

    def later(**headers: str) -> dict[str, str]:
        return {"Prefer": "respond-async", **headers}

    async with httpx.AsyncClient(base_url=base, timeout=30, limits=EVERY_CONNECTION_KEPT) as client:
        await measured(client, redis, body(5000), 1)
        first = await client.post(
            "/v2/models/steady/infer", json=body(600), headers=later(**{"Idempotency-Key": "order-1"})
        )
        assert first.status_code == 202, first.text
        backlog = [
            asyncio.create_task(client.post("/v2/models/steady/infer", json=body(5000))) for _ in range(40)
        ]
        await queued(redis)  # 40 at about 40 ms each, in the queue: over a second of work ahead
        began = time.perf_counter()
        late = await client.post("/v2/models/steady/infer", json=body(600), headers=later())
        took = time.perf_counter() - began
        assert late.status_code == 503, late.text
        assert "function 'steady' would answer in about" in late.text, late.text
        assert "deadline of 600 ms" in late.text and took < 0.6, (late.text, took)
        assert int(late.headers["retry-after"]) >= 1
        again = await client.post(
            "/v2/models/steady/infer", json=body(600), headers=later(**{"Idempotency-Key": "order-1"})
        )
        assert again.status_code == 202, again.text
        assert again.json()["id"] == first.json()["id"]
        assert [answer.status_code for answer in await asyncio.gather(*backlog)] == [200] * 40
        served = await client.post("/v2/models/steady/infer", json=body(600), headers=later())
        assert served.status_code == 202, served.text
        for _ in range(60):
            answer = await client.get(f"/v1/invocations/{served.json()['id']}", params={"wait": 10})
            if answer.status_code != 202:
                break
        assert answer.status_code == 200, answer.text
