"""A batch's way out on a real Redis: replies, cache entries, waiters and acknowledgements."""

from __future__ import annotations

import numpy as np
import redis.asyncio as aioredis

from fngate import clients, keys, queue
from fngate.config import RunnerSettings
from fngate.errors import ModelFailed
from fngate.fastredis import FastRedis, stream_entries
from fngate.wire import Invocation, Reply, replies_of
from runner.outbox import Entry, Outbox
from tests.conftest import on_cluster_too

STREAM = keys.invocations("f")


async def queued(redis: aioredis.Redis, client: FastRedis, invocation: Invocation) -> Entry:
    """Queue `invocation` as a gateway would, and read it as a runner does."""
    fields = invocation.encode()
    await redis.xadd(STREAM, fields)
    await redis.incrby(queue.queue_bytes(STREAM), queue.entry_bytes(fields))
    read = await client.execute(
        "XREADGROUP", "GROUP", keys.RUNNER_GROUP, "r", "COUNT", 1, "STREAMS", STREAM, ">"
    )
    ((entry_id, _),) = stream_entries(read)
    return Entry(entry_id, invocation, queue.entry_bytes(fields))


def invocation(id: str, reply_to: str, **extra: object) -> Invocation:
    return Invocation(id, "f", "1", reply_to, 2**62, {"x": np.ones((1, 2), np.float32)}, **extra)  # type: ignore[arg-type]


async def test_a_batch_is_answered_stored_shared_and_acknowledged_in_one_call(
    redis_url: str, redis: aioredis.Redis
) -> None:
    client = FastRedis(redis_url)
    await redis.xgroup_create(STREAM, keys.RUNNER_GROUP, id="0", mkstream=True)
    for stream in ("fngate:r:a", "fngate:r:b"):
        await redis.xgroup_create(stream, "alive", id="$", mkstream=True)  # as a live gateway does
    marker = keys.in_flight("f", "k")
    await redis.rpush(queue.waiters(marker), queue.Waiter("fngate:r:b", "w1", 2**62).encode())
    cached = await queued(
        redis,
        client,
        invocation(
            "i1", "fngate:r:a", digest="d", cache_key="fngate:c:f:k", cache_ttl_s=60, in_flight_key=marker
        ),
    )
    failed = await queued(redis, client, invocation("i2", "fngate:r:gone", digest="d"))
    out = {"y": np.full((1, 2), 3, np.float32)}
    replies = [Reply("i1", "1", out, None, "b", 2), Reply("i2", "1", {}, ModelFailed("no"), "b", 2)]
    await Outbox(client, STREAM, RunnerSettings(redis_url=redis_url)).send(
        [cached, failed], replies, ran_digest="d"
    )

    (a,) = [fields for _, fields in await redis.xrange("fngate:r:a")]
    assert Reply.decode(a).outputs["y"].tolist() == [[3.0, 3.0]]
    (b,) = [fields for _, fields in await redis.xrange("fngate:r:b")]
    assert queue.answered_id(b, Reply.decode(b).id) == "w1"  # the waiter got the same answer
    assert await redis.exists("fngate:r:gone") == 0  # a stopped gateway's stream is not made again
    assert await redis.hget("fngate:c:f:k", "h") is not None  # the success is cached, with its TTL
    assert 0 < await redis.ttl("fngate:c:f:k") <= 60
    assert await redis.exists(marker, queue.waiters(marker)) == 0
    assert await redis.xlen(STREAM) == 0  # acknowledged and deleted
    assert (await redis.xpending(STREAM, keys.RUNNER_GROUP))["pending"] == 0
    assert await redis.exists(queue.queue_bytes(STREAM)) == 0  # an empty queue holds no bytes
    await client.aclose()


async def test_an_answer_from_other_files_than_the_gateway_keyed_on_is_not_cached(
    redis_url: str, redis: aioredis.Redis
) -> None:
    client = FastRedis(redis_url)
    await redis.xgroup_create(STREAM, keys.RUNNER_GROUP, id="0", mkstream=True)
    entry = await queued(
        redis, client, invocation("i1", "fngate:r:a", digest="new", cache_key="fngate:c:f:k2", cache_ttl_s=60)
    )
    reply = Reply("i1", "1", {"y": np.zeros((1, 2), np.float32)})
    await Outbox(client, STREAM, RunnerSettings(redis_url=redis_url)).send([entry], [reply], ran_digest="old")
    assert await redis.exists("fngate:c:f:k2") == 0
    await client.aclose()


@on_cluster_too
async def test_a_batchs_replies_to_one_gateway_travel_in_one_entry(
    redis_url: str, redis: aioredis.Redis
) -> None:
    """Three replies for gateway a that need nothing but delivery: one entry; b's one reply: an
    entry of its own; a's cached answer: alone on one Redis, with the others on a Redis Cluster
    (where the replies of other slots than the function's are delivered ahead of FINISH). Each
    decodes to its own reply, outputs and errors intact."""
    client = clients.fastredis(redis_url)
    await redis.xgroup_create(STREAM, keys.RUNNER_GROUP, id="0", mkstream=True)
    for stream in ("fngate:r:a", "fngate:r:b"):
        await redis.xgroup_create(stream, "alive", id="$", mkstream=True)
    entries = [
        await queued(redis, client, invocation("a1", "fngate:r:a")),
        await queued(redis, client, invocation("b1", "fngate:r:b")),
        await queued(redis, client, invocation("a2", "fngate:r:a")),
        await queued(
            redis, client, invocation("ac", "fngate:r:a", digest="d", cache_key="fngate:c:f:x", cache_ttl_s=9)
        ),
        await queued(redis, client, invocation("a3", "fngate:r:a")),
    ]
    replies = [
        Reply("a1", "1", {"y": np.full((1, 2), 1, np.float32)}, None, "b", 5),
        Reply("b1", "1", {"y": np.full((1, 2), 2, np.float32)}, None, "b", 5),
        Reply("a2", "1", {}, ModelFailed("row 2 is bad"), "b", 5),
        Reply("ac", "1", {"y": np.full((1, 2), 4, np.float32)}, None, "b", 5),
        Reply("a3", "1", {"y": np.arange(6, dtype=np.int64).reshape(1, 6), "z": np.ones((1, 1), np.uint8)}),
    ]
    await Outbox(client, STREAM, RunnerSettings(redis_url=redis_url)).send(entries, replies, ran_digest="d")

    a = [fields for _, fields in await redis.xrange("fngate:r:a")]
    b = [fields for _, fields in await redis.xrange("fngate:r:b")]
    # One Redis writes the cached answer's reply with its cache entry, alone; a cluster writes the
    # cache entry first, and the reply then needs nothing but delivery too.
    together = [4] if clients.is_cluster(redis_url) else [1, 3]
    assert sorted(len(replies_of(fields)) for fields in a) == together and len(b) == 1
    got = {reply.id: reply for fields in a + b for reply in replies_of(fields)}
    assert got.keys() == {"a1", "a2", "a3", "ac", "b1"}
    assert got["a1"].outputs["y"].tolist() == [[1.0, 1.0]] and got["b1"].outputs["y"].tolist() == [[2.0, 2.0]]
    assert isinstance(got["a2"].error, ModelFailed) and got["a2"].error.message == "row 2 is bad"
    assert (
        got["a3"].outputs["y"].tolist() == [[0, 1, 2, 3, 4, 5]] and got["a3"].outputs["z"].dtype == np.uint8
    )
    assert got["ac"].outputs["y"].tolist() == [[4.0, 4.0]]
    assert await redis.hget("fngate:c:f:x", "h") is not None  # the cached one stored, as alone
    assert await redis.xlen(STREAM) == 0
    await client.aclose()
