"""A synchronous invocation whose caller leaves while it waits in the queue (a reset RPC, a closed
HTTP connection on the default server, uvicorn) is taken back: no runner runs it. One that a runner
read already runs, and its reply finds no one."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fngate import keys
from gateway import metrics
from tests.conftest import free_port, on_cluster_too
from tests.e2e.function_output import FunctionOutput

PROBE = "/v2/models/probe/infer"
FILLERS = 16
"""The probe's max_batch_size: what its runner reads ahead while a batch runs."""


def body(first: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [first, 0, 0, 0]}]}


def grpc_request(first: float) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="probe")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(struct.pack("<4f", first, 0, 0, 0))
    return request


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.02)


async def held(redis: aioredis.Redis, stream: str) -> int:
    """The stream's entries a runner read and has not acknowledged."""
    try:
        pending: Any = await redis.xpending(stream, keys.RUNNER_GROUP)
    except ResponseError:  # no runner made its group yet
        return 0
    return int(pending["pending"])


async def entries(redis: aioredis.Redis, stream: str) -> int:
    return int(await redis.xlen(stream))


def withdrawn() -> float:
    return metrics.WITHDRAWN.labels("probe", "withdrawn")._value.get()


@pytest.mark.timeout(120)
async def test_a_call_whose_caller_left_never_runs(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    function_output: FunctionOutput,
    redis: aioredis.Redis,
) -> None:
    runner_process(PROBE_LOG="1", PROBE_SLEEP_S="1.5", FNGATE_FUNCTIONS='["probe"]')
    grpc_port = free_port()
    # One entry each: only an entry of its own can be taken back (tests/e2e/test_shared_entries.py).
    base = await serve_gateway(grpc_port=grpc_port, server="uvicorn", group_invocations=False)
    stream = keys.invocations("probe")
    before = withdrawn()

    async def held_at_least(count: int) -> bool:
        return await held(redis, stream) >= count

    async def queued_at_least(count: int) -> bool:
        return await entries(redis, stream) >= count

    async def both_withdrawn() -> bool:
        return withdrawn() >= before + 2 and await entries(redis, stream) <= 1 + FILLERS

    async with httpx.AsyncClient(timeout=60) as client:
        # One batch runs (1) and one batch's worth waits read ahead by the runner (100..115).
        running = asyncio.create_task(client.post(base + PROBE, json=body(1)))
        await until(lambda: held_at_least(1), "the runner reads the first call")
        fillers = [asyncio.create_task(client.post(base + PROBE, json=body(100 + i))) for i in range(FILLERS)]
        await until(lambda: held_at_least(1 + FILLERS), "the runner reads a batch ahead")

        # Two callers leave while their invocations wait unread: a reset RPC, a closed connection.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(grpc_request(7))
            await until(lambda: queued_at_least(2 + FILLERS), "the RPC's invocation is queued")
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await call
        async with httpx.AsyncClient(timeout=0.5) as leaving:
            with pytest.raises(httpx.ReadTimeout):  # httpx closes the connection on its timeout
                await leaving.post(base + PROBE, json=body(8))

        await until(both_withdrawn, "the entries of the callers that left are taken back")
        answers = [await running, *await asyncio.gather(*fillers)]
        # Were they still queued, they would be read before this one and run no later.
        last = await client.post(base + PROBE, json=body(9))
    assert [answer.status_code for answer in [*answers, last]] == [200] * (2 + FILLERS)
    executed = function_output.executions(2 + FILLERS)
    assert sorted(executed, key=float) == ["1", "9", *(str(100 + i) for i in range(FILLERS))]
    assert await entries(redis, stream) == 0


def stopped() -> float:
    return metrics.WITHDRAWN.labels("probe", "stopped")._value.get()


@on_cluster_too
@pytest.mark.timeout(120)
async def test_a_call_whose_caller_left_after_its_runner_read_it_is_answered_unrun(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    function_output: FunctionOutput,
    redis: aioredis.Redis,
) -> None:
    """The runner has read the invocation ahead, while a batch runs: the gateway tells it (the
    function's channel of callers that left), and it answers the invocation without running it."""
    runner_process(PROBE_LOG="1", PROBE_SLEEP_S="1.5", FNGATE_FUNCTIONS='["probe"]')
    # One entry each, counted as read ahead by the runner (a shared entry's: test_shared_entries.py).
    base = await serve_gateway(server="uvicorn", group_invocations=False)
    stream = keys.invocations("probe")
    before = stopped()

    async def held_at_least(count: int) -> bool:
        return await held(redis, stream) >= count

    async def told() -> bool:
        return stopped() >= before + 1

    async with httpx.AsyncClient(timeout=60) as client:
        running = asyncio.create_task(client.post(base + PROBE, json=body(1)))
        await until(lambda: held_at_least(1), "the runner reads the first call")
        fillers = [
            asyncio.create_task(client.post(base + PROBE, json=body(100 + i))) for i in range(FILLERS - 1)
        ]
        leaving = httpx.AsyncClient(timeout=60)
        gone = asyncio.create_task(leaving.post(base + PROBE, json=body(200)))
        await until(lambda: held_at_least(1 + FILLERS), "the runner reads the next batch ahead, 200 in it")
        gone.cancel()  # its caller leaves: the connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        await leaving.aclose()
        await until(told, "the gateway tells the runner")
        answers = [await running, *await asyncio.gather(*fillers)]
        last = await client.post(base + PROBE, json=body(9))
    assert [answer.status_code for answer in [*answers, last]] == [200] * (1 + FILLERS)
    executed = function_output.executions(1 + FILLERS)
    assert sorted(executed, key=float) == ["1", "9", *(str(100 + i) for i in range(FILLERS - 1))]

    async def empty() -> bool:  # on a cluster a reply can reach its caller before its entry goes
        return await entries(redis, stream) == 0

    await until(empty, "every entry answered and removed")
