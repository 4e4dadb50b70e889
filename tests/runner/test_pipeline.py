"""A finished pipeline step on a real Redis: a join queues the step after it once, when its last
predecessor finishes; a step context that does not decode answers its gateway at once; an
asynchronous pipeline's steps stay at its level and its answer keeps its result."""

from __future__ import annotations

import dataclasses

import numpy as np
import redis.asyncio as aioredis

from fngate import keys, queue
from fngate.config import RunnerSettings
from fngate.errors import ModelFailed
from fngate.fastredis import FastRedis
from fngate.manifest import parse_manifest
from fngate.plan import StepContext, make_plan
from fngate.wire import Invocation, Reply
from runner.outbox import Entry, Outbox
from runner.pipeline import Finished, Steps
from tests.fngate.test_pipeline import DIAMOND, FUNCTIONS

REPLIES = "fngate:r:g"


def finished(context: StepContext, outputs: dict[str, np.ndarray]) -> Finished:
    invocation = Invocation(
        "p1", context.step.function, "1", REPLIES, 2**62, {"x": np.ones((1, 16), np.float32)}
    )
    return Finished(b"1-0", context.encode(), invocation, Reply("p1", "1", outputs, None, "b", 1))


async def test_a_join_queues_the_step_after_it_once_its_last_predecessor_finishes(
    redis_url: str, redis: aioredis.Redis
) -> None:
    names = {"norm": "normalize", "left": "mlp", "right": "double", "join": "merge"}
    plan = make_plan(
        parse_manifest(DIAMOND, "d"), "1", {step: (FUNCTIONS[name], "1", "") for step, name in names.items()}
    )
    normalized = np.full((1, 16), 0.25, np.float32)
    base = StepContext("p1", REPLIES, 2**62, plan, 0, {}, None)
    left = StepContext("p1", REPLIES, 2**62, plan, 1, {"norm.normalized": normalized}, None)
    right = StepContext("p1", REPLIES, 2**62, plan, 2, {"norm.normalized": normalized}, None)
    assert (base.step.name, left.step.name, right.step.name) == ("norm", "left", "right")
    client = FastRedis(redis_url)
    steps = Steps(client)
    assert await steps.finish([finished(left, {"probabilities": np.ones((1, 4), np.float32)})]) == []
    assert await redis.xlen(keys.invocations("merge")) == 0  # `right` has not finished yet
    assert await steps.finish([finished(right, {"y": np.full((1, 16), 2, np.float32)})]) == []
    ((_entry_id, fields),) = await redis.xrange(keys.invocations("merge"))
    joined = Invocation.decode(fields)
    assert sorted(joined.inputs) == ["a", "b"] and joined.inputs["b"].tolist() == [[2.0] * 16]
    following = StepContext.decode(fields[queue.STEP])
    assert following.step.name == "join"
    assert list(following.carried) == ["norm.normalized"]  # the pipeline's outputs still read it
    assert await redis.get(queue.queue_bytes(keys.invocations("merge"))) is not None
    await client.aclose()


async def test_a_step_context_that_does_not_decode_answers_the_gateway(
    redis_url: str, redis: aioredis.Redis
) -> None:
    stream = keys.invocations("double")
    await redis.xgroup_create(stream, keys.RUNNER_GROUP, id="0", mkstream=True)
    await redis.xgroup_create(REPLIES, "alive", id="$", mkstream=True)
    invocation = Invocation("p2", "double", "1", REPLIES, 2**62, {"x": np.ones((1, 16), np.float32)})
    fields = {**invocation.encode(), queue.STEP: b"not a context"}
    await redis.xadd(stream, fields)
    read = await redis.xreadgroup(keys.RUNNER_GROUP, "r", {stream: ">"}, count=1)
    entry_id = read[0][1][0][0]
    client = FastRedis(redis_url)
    entry = Entry(entry_id, invocation, queue.entry_bytes(fields), step=fields[queue.STEP])
    reply = Reply("p2", "1", {"y": np.ones((1, 16), np.float32)}, None, "b", 1)
    await Outbox(client, stream, RunnerSettings(redis_url=redis_url)).send([entry], [reply])
    ((_id, answer),) = await redis.xrange(REPLIES)
    error = Reply.decode(answer).error
    assert error is not None and error.code.value == "internal"
    assert await redis.xlen(stream) == 0  # acknowledged and deleted
    await client.aclose()


async def test_an_asynchronous_pipelines_steps_stay_at_its_level_and_its_answer_keeps_the_result(
    redis_url: str, redis: aioredis.Redis
) -> None:
    """After `norm`, `left` and `right` wait on their functions' asynchronous streams; a step's
    error answers the result stream, kept result_ttl_s, with the callback marker FINISH shares it by."""
    names = {"norm": "normalize", "left": "mlp", "right": "double", "join": "merge"}
    plan = make_plan(
        parse_manifest(DIAMOND, "d"), "1", {step: (FUNCTIONS[name], "1", "") for step, name in names.items()}
    )
    result = keys.result("p3")
    callback = queue.callback_marker(result)
    norm = StepContext("p3", result, 2**62, plan, 0, {}, None, "", 0, keys.ASYNC, 60, callback)
    client = FastRedis(redis_url)
    steps = Steps(client)
    normalized = np.full((1, 16), 0.25, np.float32)
    assert await steps.finish([finished(norm, {"normalized": normalized})]) == []
    assert [await redis.xlen(keys.invocations(name, keys.ASYNC)) for name in ("mlp", "double")] == [1, 1]
    assert [await redis.xlen(keys.invocations(name)) for name in ("mlp", "double")] == [0, 0]
    ((_entry_id, fields),) = await redis.xrange(keys.invocations("mlp", keys.ASYNC))
    assert StepContext.decode(fields[queue.STEP]).level == keys.ASYNC

    left = StepContext.decode(fields[queue.STEP])
    failed = finished(left, {})
    failed = dataclasses.replace(failed, reply=Reply("p3", "1", {}, ModelFailed("no")))
    (answer,) = await steps.finish([failed])
    assert (answer.reply_to, answer.in_flight, answer.reply_ttl_ms) == (result, callback, 60_000)
    error = Reply.decode(answer.reply).error
    assert error is not None and error.message == "step 'left' (mlp v1): no"
    await client.aclose()
