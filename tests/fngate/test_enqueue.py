"""ENQUEUE and ENQUEUE_MANY on a real Redis: each invocation of a bundle is decided as ENQUEUE alone
would decide it, in order; a pipeline's first steps are queued all or none. WITHDRAW takes back an
entry no runner read, unless identical invocations wait on it."""

from __future__ import annotations

import redis.asyncio as aioredis

from fngate import clients, queue
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
    ((s1_id, _),) = await redis.xrange("s1")
    ((s2_id, _),) = await redis.xrange("s2")
    assert [outcome.entry_id for outcome in outcomes if isinstance(outcome, queue.Queued)] == [s1_id, s2_id]
    assert outcomes == [
        queue.Queued(s1_id),
        queue.Full("count", 0),
        queue.Hit({queue.HEADER: b"head", queue.BODY: b"body"}),
        queue.Queued(s2_id),
        queue.Full("count", 1),
    ]
    assert [await redis.xlen(stream) for stream in ("s1", "s2", "s3")] == [1, 1, 1]
    ((_, fields),) = await redis.xrange("s3")
    assert fields[queue.STEP] == b"q"


async def test_withdraw_takes_back_only_what_no_runner_read_and_no_one_waits_on(
    redis_url: str, redis: aioredis.Redis
) -> None:
    client = FastRedis(redis_url)
    enqueue, withdraw = Script(client, queue.ENQUEUE), Script(client, queue.WITHDRAW)

    async def queued(invocation: str, in_flight: str = "") -> bytes:
        script = call("s", 10, invocation, in_flight=in_flight)
        outcome = queue.parse_enqueue(await enqueue(script.keys, script.args))
        assert isinstance(outcome, queue.Queued)
        return outcome.entry_id

    channel = "{s}:left"  # in the stream's slot, as fngate.keys.left_channel is in its function's

    async def withdrawn(entry_id: bytes, in_flight: str = "") -> bytes:
        script = queue.withdraw_call("s", entry_id, in_flight, "runners", channel, client.cluster)
        answer: bytes = await withdraw(script.keys, script.args)
        return answer

    pubsub = redis.pubsub()
    try:
        await clients.subscribe(pubsub, channel)
        await redis.xgroup_create("s", "runners", "$", mkstream=True)
        read, read_shared = await queued("read", in_flight="f0"), await queued("read-shared", in_flight="f3")
        await redis.xreadgroup("runners", "r1", {"s": ">"}, count=2)
        alone, shared = await queued("alone", in_flight="f1"), await queued("shared", in_flight="f2")
        for twin, in_flight in (("twin", "f2"), ("twin-read", "f3")):
            again = queue.parse_enqueue(await enqueue(*_args(call("s", 10, twin, in_flight=in_flight))))
            assert again == queue.Coalesced()  # waits on "shared", on "read-shared"

        assert await withdrawn(read, "f0") == b"stopped"  # its runner is told; no one may wait on it
        assert not await redis.exists("f0")
        assert await withdrawn(read_shared, "f3") == b"running"  # it runs for "twin-read"
        assert await withdrawn(shared, "f2") == b"shared"
        assert await withdrawn(alone, "f1") == b"withdrawn"
        assert await withdrawn(alone, "f1") == b"gone"
        assert [entry_id for entry_id, _ in await redis.xrange("s")] == [read, read_shared, shared]
        assert int(await redis.get(queue.queue_bytes("s"))) == 3 * len(b"{}xy")
        assert not await redis.exists("f1", queue.waiters("f1"))  # an identical call queues anew
        assert await redis.exists("f2", queue.waiters("f2")) == 2
        told = [await clients.next_message(pubsub, 0.5) for _ in range(3)]  # the first: SUBSCRIBE's
        assert [message["data"] for message in told if message] == [b"s " + read]
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        await client.aclose()


def _args(script: queue.ScriptCall) -> tuple[list[str], list[bytes | str | int | float]]:
    return script.keys, script.args


async def test_a_turns_plain_invocations_are_packed_into_one_entry_when_all_fit(
    redis_url: str, redis: aioredis.Redis
) -> None:
    client = FastRedis(redis_url)
    many = Script(client, queue.ENQUEUE_MANY)

    async def decided(turn: queue.TurnCall) -> tuple[list[queue.EnqueueOutcome | None], list[int]]:
        raws, again = queue.turn_outcomes(turn, await many(turn.call.keys, turn.call.args))
        return [queue.parse_enqueue(raw) if raw is not None else None for raw in raws], again

    limited = queue.Admission(("bucket", "busy", ""), (100, 100, 0, 0, "m", 1000))
    try:
        # Three plain calls of s1 and one with caller limits, which is decided on its own.
        calls = [call("s1", 10, "a"), call("s1", 10, "b", admission=limited), call("s1", 10, "c")]
        calls.append(call("s1", 10, "d"))
        assert [queue.packable(one) for one in calls] == [True, False, True, True]
        outcomes, again = await decided(queue.turn_call(calls, [8, 8, 8, 8]))
        assert again == []
        entries = {entry_id: fields for entry_id, fields in await redis.xrange("s1")}
        packed = next(entry_id for entry_id, fields in entries.items() if queue.HEADERS in fields)
        assert entries[packed] == {queue.HEADERS: b"[{},{},{}]", queue.BODIES: b"xy" * 3}
        assert [outcome.entry_id for outcome in outcomes if isinstance(outcome, queue.Queued)] == [
            packed + b"/0",
            next(entry_id for entry_id in entries if entry_id != packed),  # b, alone: a plain entry
            packed + b"/1",
            packed + b"/2",
        ]
        assert int(await redis.get(queue.extra_count("s1"))) == 2  # four invocations in two entries
        assert int(await redis.get(queue.queue_bytes("s1"))) == len(b"[{},{},{}]" + b"xy" * 3) + 4

        # Packed calls that would not all fit are sent again each on its own, and decided exactly
        # as ENQUEUE decides them: by count, then by bytes.
        for stream, max_size, max_bytes, queued in (("s2", 2, 0, 2), ("s3", 10, 6, 2)):
            calls = [call(stream, max_size, name, max_queue_bytes=max_bytes) for name in "xyz"]
            outcomes, again = await decided(queue.turn_call(calls, [8, 8, 8]))
            assert (outcomes, again) == ([None, None, None], [0, 1, 2])
            assert not await redis.exists(stream, queue.queue_bytes(stream), queue.extra_count(stream))
            alone = queue.enqueue_many_call([calls[at] for at in again], [8, 8, 8])
            decisions = [queue.parse_enqueue(raw) for raw in await many(alone.keys, alone.args)]
            refused = "count" if max_bytes == 0 else "bytes"
            assert decisions[queued:] == [queue.Full(refused, 0)] * (3 - queued)
            assert all(isinstance(outcome, queue.Queued) for outcome in decisions[:queued])
            assert await redis.xlen(stream) + int(await redis.get(queue.extra_count(stream)) or 0) == queued
    finally:
        await client.aclose()
