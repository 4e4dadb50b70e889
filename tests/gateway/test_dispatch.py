"""The dispatcher on a real Redis, with no runner: what an invocation gets before any runner answers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis

from fngate import keys, queue
from fngate.backoff import Health
from fngate.errors import DeadlineExceeded, Overloaded, Unavailable
from fngate.fastredis import FastRedis
from fngate.repository import FunctionVersion, open_repository
from fngate.wire import Invocation, Reply
from gateway.activation import Activator
from gateway.call import Call
from gateway.catalog import Catalog
from gateway.dispatch import Dispatcher
from gateway.replies import ReplyRouter
from tests.conftest import ROOT

ROW = np.arange(16, dtype=np.float32).reshape(1, 16)


def classifier(**batching: int) -> FunctionVersion:
    version = open_repository(str(ROOT / "functions")).scan()["classifier"].newest()
    if not batching:
        return version
    manifest = version.manifest.model_copy(
        update={"batching": version.manifest.batching.model_copy(update=batching)}
    )
    return dataclasses.replace(version, manifest=manifest)


def call(function: FunctionVersion, timeout_ms: int) -> Call:
    return Call(function, {"input": ROW}, timeout_ms=timeout_ms)


@contextlib.asynccontextmanager
async def dispatching(
    redis_url: str, health: Health | None = None, activator: Activator | None = None
) -> AsyncIterator[tuple[Dispatcher, ReplyRouter]]:
    client = aioredis.from_url(redis_url)
    reads, writes = FastRedis(redis_url), FastRedis(redis_url)
    replies = ReplyRouter(client, reads, "test", 200, 1.0)
    await replies.start()
    loop = asyncio.create_task(replies.run())
    try:
        catalog = Catalog(lambda: asyncio.sleep(0, {}))
        yield Dispatcher(writes, replies, catalog, activator=activator, health=health), replies
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await replies.stop()
        await reads.aclose()
        await writes.aclose()
        await client.aclose()


async def test_an_invocation_waits_on_the_queue_and_gets_the_reply_written_to_its_stream(
    redis_url: str, redis: aioredis.Redis
) -> None:
    async with dispatching(redis_url) as (dispatcher, replies):
        answer = dispatcher.invoke(call(classifier(), 5000))
        stream = keys.invocations("classifier")
        for _ in range(50):
            entries = await redis.xrange(stream)
            if entries:
                break
            await asyncio.sleep(0.02)
        ((_entry_id, fields),) = entries
        invocation = Invocation.decode(fields)
        assert invocation.reply_to == replies.stream
        np.testing.assert_array_equal(invocation.inputs["input"], ROW)
        out = {"probabilities": np.ones((1, 4), np.float32)}
        await redis.xadd(invocation.reply_to, Reply(invocation.id, "1", out, None, "b1", 1).encode())
        reply = await answer
    assert reply.batch_id == "b1"
    np.testing.assert_array_equal(reply.outputs["probabilities"], out["probabilities"])


async def test_a_full_queue_is_overloaded_and_nothing_is_queued(
    redis_url: str, redis: aioredis.Redis
) -> None:
    async with dispatching(redis_url) as (dispatcher, _):
        function = classifier(max_queue_size=2)
        waiting = [dispatcher.invoke(call(function, 2000)) for _ in range(2)]
        await asyncio.sleep(0.2)
        with pytest.raises(Overloaded, match="max_queue_size"):
            await dispatcher.invoke(call(function, 2000))
        # The two of one turn share one entry; the refused one is in none.
        stream = keys.invocations("classifier")
        assert await redis.xlen(stream) == 1 and int(await redis.get(queue.extra_count(stream))) == 1
        for task in waiting:
            task.cancel()


async def test_a_turn_past_the_queues_room_has_as_many_queued_as_fit_and_the_rest_overloaded(
    redis_url: str, redis: aioredis.Redis
) -> None:
    # Five of one turn would be packed in one entry, which does not fit whole: each is decided
    # again on its own, and the first three are queued (sharing an entry), as if sent one by one.
    async with dispatching(redis_url) as (dispatcher, _):
        function = classifier(max_queue_size=3)
        answers = [asyncio.ensure_future(dispatcher.invoke(call(function, 2000))) for _ in range(5)]
        done, _pending = await asyncio.wait(answers, timeout=1.0)
        assert [answer in done for answer in answers] == [False, False, False, True, True]
        for answer in answers[3:]:
            with pytest.raises(Overloaded, match="max_queue_size"):
                answer.result()
        stream = keys.invocations("classifier")
        assert await redis.xlen(stream) == 1 and int(await redis.get(queue.extra_count(stream))) == 2
        for answer in answers[:3]:
            answer.cancel()


async def test_no_answer_is_a_deadline_exceeded_at_the_deadline(
    redis_url: str, redis: aioredis.Redis
) -> None:
    async with dispatching(redis_url) as (dispatcher, _):
        with pytest.raises(DeadlineExceeded, match="200 ms"):
            await dispatcher.invoke(call(classifier(), 200))


async def test_a_deadline_that_passes_while_the_pool_is_woken_is_kept(
    redis_url: str, redis: aioredis.Redis
) -> None:
    """Each of these invocations wakes its pool (no runner, nobody listening) and has a deadline of
    a few ms, which passes while the enqueue, the wake or the wait for the reply is under way:
    every one is answered 504 then, none waits on past it."""
    client = aioredis.from_url(redis_url)
    activator = Activator(client, refresh_s=0.0)  # every invocation publishes its pool's wake
    try:
        async with dispatching(redis_url, activator=activator) as (dispatcher, _):
            for attempt in range(60):
                submitted = dispatcher.invoke(call(classifier(), 1 + attempt % 4))
                with pytest.raises(DeadlineExceeded):
                    await asyncio.wait_for(submitted, 5)
    finally:
        await client.aclose()


async def test_a_redis_known_down_is_unavailable_at_once(redis_url: str, redis: aioredis.Redis) -> None:
    health = Health("redis")
    health.failed("a test", ConnectionError("gone"))
    async with dispatching(redis_url, health) as (dispatcher, _):
        with pytest.raises(Unavailable, match="Redis cannot be reached"):
            await dispatcher.invoke(call(classifier(), 5000))
        assert await redis.xlen(keys.invocations("classifier")) == 0


async def test_replies_leave_the_stream_once_read(redis_url: str, redis: aioredis.Redis) -> None:
    async with dispatching(redis_url) as (_, replies):
        for _ in range(3):
            await redis.xadd(replies.stream, Reply("nobody", "1").encode())
        for _ in range(50):
            if await redis.xlen(replies.stream) == 0:
                break
            await asyncio.sleep(0.05)
        assert await redis.xlen(replies.stream) == 0
