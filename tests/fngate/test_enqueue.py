"""ENQUEUE and ENQUEUE_MANY on a real Redis: each invocation of a bundle is decided as ENQUEUE alone
would decide it, in order; a pipeline's first steps are queued all or none."""

from __future__ import annotations

import redis.asyncio as aioredis

from fngate import queue
from fngate.fastredis import FastRedis, Script

FIELDS = {queue.HEADER: b"{}", queue.BODY: b"xy"}


def call(stream: str, max_size: int, invocation: str, **extra: object) -> queue.ScriptCall:
    return queue.enqueue_call(stream, FIELDS, queue.Waiter("r", invocation, 9), 500, max_size, **extra)  # type: ignore[arg-type]


async def test_a_bundle_is_decided_in_order_as_each_alone(redis_url: str, redis: aioredis.Redis) -> None:
    await redis.hset("cached", mapping={"h": b"head", "b": b"body"})
    client = FastRedis(redis_url)
    try:
        calls = [
            call("s1", 1, "a"),  # queued: s1 holds one
            call("s1", 1, "b"),  # full: s1 is at its max_queue_size since a
            call("s2", 5, "c", lookup="cached"),  # answered from the cache, nothing queued
            call("s2", 5, "d", step=b"p", more=[queue.Forward("s3", FIELDS, b"q", 5, 0)]),  # both queued
            call("s2", 5, "e", step=b"p", more=[queue.Forward("s1", FIELDS, b"q", 1, 0)]),  # s1 full: none
        ]
        bundle = queue.enqueue_many_call(calls)
        outcomes = [
            queue.parse_enqueue(raw)
            for raw in await Script(client, queue.ENQUEUE_MANY)(bundle.keys, bundle.args)
        ]
    finally:
        await client.aclose()
    assert outcomes == [
        queue.Queued(),
        queue.Full("count", 0),
        queue.Hit({queue.HEADER: b"head", queue.BODY: b"body"}),
        queue.Queued(),
        queue.Full("count", 1),
    ]
    assert [await redis.xlen(stream) for stream in ("s1", "s2", "s3")] == [1, 1, 1]
    ((_, fields),) = await redis.xrange("s3")
    assert fields[queue.STEP] == b"q"
