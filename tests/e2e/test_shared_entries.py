"""The invocations a gateway takes in one event-loop turn share one stream entry (per function and
level): each is still its own invocation to real runner processes. Each is answered with its own
rows; the entry and its counters are gone once the last is answered; one whose caller left is
never run, whether or not a runner read the entry; a poison invocation among them is
dead-lettered alone; a runner killed holding the entry loses none of them."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from fngate import keys, queue
from fngate.repository import FunctionVersion, open_repository
from fngate.wire import Reply
from gateway import metrics
from gateway.call import Call
from tests.e2e.function_output import FunctionOutput
from tests.e2e.test_recovery import killed_at_each_poison, wait_for
from tests.gateway.test_dispatch import dispatching

STREAM = keys.invocations("probe")
QUICK_CLAIMS = {"FNGATE_CLAIM_IDLE_MS": "200", "FNGATE_CLAIM_INTERVAL_MS": "100"}


def probe(repo: Path) -> FunctionVersion:
    return open_repository(str(repo)).scan()["probe"].newest()


def call(function: FunctionVersion, first: float) -> Call:
    return Call(function, {"x": np.array([[first, 1.0, 2.0, 3.0]], dtype=np.float32)}, timeout_ms=30_000)


def doubled(reply: Reply, first: float) -> None:
    np.testing.assert_array_equal(reply.outputs["y"], [[first * 2, 2.0, 4.0, 6.0]])


async def queued(redis: aioredis.Redis) -> tuple[int, int]:
    """The stream's entries, and the invocations they hold beyond one each."""
    return int(await redis.xlen(STREAM)), int(await redis.get(queue.extra_count(STREAM)) or 0)


async def emptied(redis: aioredis.Redis) -> None:
    """Nothing left of the entry: not in the stream, its counters gone, none held."""
    assert await queued(redis) == (0, 0)
    assert not await redis.exists(queue.queue_bytes(STREAM), queue.extra_count(STREAM))
    assert (await redis.xpending(STREAM, keys.RUNNER_GROUP))["pending"] == 0


async def test_one_turns_invocations_share_an_entry_and_each_gets_its_own_answer(
    redis_url: str,
    redis: aioredis.Redis,
    repo: Path,
    runner_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    function = probe(repo)
    async with dispatching(redis_url) as (dispatcher, _):
        answers = [dispatcher.invoke(call(function, float(first))) for first in range(8)]
        await wait_for(lambda: _at(redis, (1, 7)), what="one entry of 8")
        runner_process(FNGATE_FUNCTIONS='["probe"]')
        replies = await asyncio.gather(*answers)
    for first, reply in enumerate(replies):
        doubled(reply, float(first))
    await emptied(redis)


async def test_one_whose_caller_left_is_never_run(
    redis_url: str,
    redis: aioredis.Redis,
    repo: Path,
    runner_process: Callable[..., subprocess.Popen[bytes]],
    function_output: FunctionOutput,
) -> None:
    """Its entry cannot lose it before a runner reads it: it is named among those whose callers
    left, and the runner that starts later answers it unrun."""
    function = probe(repo)
    marked = withdrawn("marked")
    async with dispatching(redis_url) as (dispatcher, _):
        answers = [dispatcher.invoke(call(function, float(first))) for first in (1, 2, 3)]
        await wait_for(lambda: _at(redis, (1, 2)), what="one entry of 3")
        answers[1].cancel()
        await wait_for(
            lambda: _equal(withdrawn("marked"), marked + 1),
            what="the second marked",
        )
        assert len(await redis.smembers(queue.left_set(STREAM))) == 1
        runner_process(PROBE_LOG="1", FNGATE_FUNCTIONS='["probe"]')
        first, third = await asyncio.gather(answers[0], answers[2])
    doubled(first, 1.0)
    doubled(third, 3.0)
    await wait_for(lambda: _at(redis, (0, 0)), what="the entry acknowledged")
    assert sorted(function_output.executions(2)) == ["1", "3"]
    await wait_for(lambda: _none_left(redis), what="the left set emptied")


async def test_one_whose_caller_left_after_its_runner_read_it_is_answered_unrun(
    redis_url: str,
    redis: aioredis.Redis,
    repo: Path,
    runner_process: Callable[..., subprocess.Popen[bytes]],
    function_output: FunctionOutput,
) -> None:
    """The runner read the entry ahead while a batch runs: it is told, and answers that one unrun."""
    function = probe(repo)
    stopped = withdrawn("stopped")
    runner_process(PROBE_LOG="1", PROBE_SLEEP_S="1.5", FNGATE_FUNCTIONS='["probe"]')
    async with dispatching(redis_url) as (dispatcher, _):
        running = dispatcher.invoke(call(function, 1.0))
        await wait_for(lambda: _held(redis, 1), what="the first call read")
        answers = [dispatcher.invoke(call(function, float(first))) for first in (100, 200, 300)]
        await wait_for(lambda: _held(redis, 2), what="the shared entry read ahead")
        answers[1].cancel()
        await wait_for(
            lambda: _equal(withdrawn("stopped"), stopped + 1),
            what="the runner told",
        )
        replies = await asyncio.gather(running, answers[0], answers[2])
    for reply, first in zip(replies, (1.0, 100.0, 300.0), strict=True):
        doubled(reply, first)
    await wait_for(lambda: _at(redis, (0, 0)), what="the entry acknowledged")
    assert sorted(function_output.executions(3), key=float) == ["1", "100", "300"]


async def test_a_poison_among_them_is_dead_lettered_alone(
    redis_url: str,
    redis: aioredis.Redis,
    repo: Path,
    runner_process: Callable[..., subprocess.Popen[bytes]],
    function_output: FunctionOutput,
) -> None:
    """A poison invocation (it hangs: the test kills its runner, as a real one would) in one entry
    with 15 innocents: the entry is claimed, each of its invocations runs alone, the runs are
    counted for each, and only the poison is dead-lettered; the others are answered."""
    function = probe(repo)
    env = {**QUICK_CLAIMS, "FNGATE_MAX_DELIVERIES": "2", "FNGATE_FUNCTIONS": '["probe"]'}
    async with dispatching(redis_url) as (dispatcher, _):
        answers = [dispatcher.invoke(call(function, float(first))) for first in (-2, *range(1, 16))]
        await wait_for(lambda: _at(redis, (1, 15)), what="one entry of 16")
        starts = await killed_at_each_poison(answers, runner_process, env, function_output)
    assert starts == 3  # the entry's batch, the poison alone, then its dead letter
    poison = answers[0].exception()
    assert poison is not None and "ran 2 times and no runner finished it" in str(poison)
    for first, answer in zip(range(1, 16), answers[1:], strict=True):
        doubled(answer.result(), float(first))
    assert await redis.xlen(keys.dead_letters("probe")) == 1
    await wait_for(lambda: _at(redis, (0, 0)), what="the entry acknowledged")


def withdrawn(outcome: str) -> float:
    """The probe's callers that left, by what became of their invocation (fngate_withdrawn)."""
    return float(metrics.WITHDRAWN.labels("probe", outcome)._value.get())


async def _at(redis: aioredis.Redis, expected: tuple[int, int]) -> bool:
    return await queued(redis) == expected


async def _held(redis: aioredis.Redis, entries: int) -> bool:
    try:
        return int((await redis.xpending(STREAM, keys.RUNNER_GROUP))["pending"]) == entries
    except ResponseError:  # no runner made its group yet
        return False


async def _equal(value: float, expected: float) -> bool:
    return value == expected


async def _none_left(redis: aioredis.Redis) -> bool:
    return not await redis.smembers(queue.left_set(STREAM))
