"""The asynchronous section of the queue protocol: key builders, argument builders and parsers
(table tests), and its scripts on a real Redis (priority read, submit, result, cancel)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from fngate import keys, queue
from fngate.fastredis import FastRedis, Script
from fngate.queue import slots

FIELDS = {queue.HEADER: b"h" * 10, queue.BODY: b"b" * 10}


def test_levels_keep_the_synchronous_name_and_number_the_rest() -> None:
    assert keys.invocations("f") == keys.invocations("f", keys.SYNC) == "fngate:q:{f}"
    assert keys.invocations("f", keys.ASYNC) == "fngate:q:{f}:1"
    assert keys.levels("f") == ("fngate:q:{f}", "fngate:q:{f}:1")
    assert queue.queue_bytes(keys.invocations("f", keys.ASYNC)) != queue.queue_bytes(keys.invocations("f"))


def test_idempotency_keys_cannot_collide_across_api_keys() -> None:
    assert keys.idempotency("ab", "c:d") != keys.idempotency("ab:c", "d")
    assert keys.idempotency("a", "x") == keys.idempotency("a", "x")
    assert len(keys.idempotency("a", "x" * 10_000)) < 120  # the client's key is hashed


def test_submit_async_call_with_callback_and_idempotency() -> None:
    call = queue.submit_async_call(
        "q", FIELDS, keys.result("i"), b"{}", 5000, "i", 10, 100, "idem", "fngate:callbacks", None, "d1"
    )
    assert call.keys == [
        "q",
        "q:bytes",
        keys.result("i"),
        "idem",
        keys.result("i") + ":cb:w",
        "",
        "",
        "",
        "",
        "",
        "q:extra",  # declared for a Redis Cluster: the stream's count of what shared entries hold
    ]
    assert call.args[:9] == [10, 100, b"h" * 10, b"b" * 10, b"{}", 5000, "i", "fngate:callbacks i 0", "d1"]


def test_submit_async_call_plain() -> None:
    call = queue.submit_async_call("q", FIELDS, keys.result("i"), b"{}", 0, "i", 10)
    assert call.keys[3:5] == ["", ""]
    assert call.args[5] == 1  # never a TTL of 0
    assert call.args[7:9] == ["", ""]
    assert call.keys[8:] == ["", "", "q:extra"]  # no cache lookup, no result quota
    # a done TTL of at least 1 ms, no cached answer, no step, no quota, refused from 80% of maxmemory,
    # no quota in another slot and no first steps queued on others (a Redis Cluster's), no share
    assert call.args[15:] == [1, "", "", b"", 0, 800, "", 0, 0]


@pytest.mark.parametrize(("result_stream", "digest"), [(keys.result("other"), ""), (keys.result("i"), "a b")])
def test_submit_async_call_refuses_what_the_script_cannot_read(result_stream: str, digest: str) -> None:
    with pytest.raises(ValueError, match="named by its invocation id"):
        queue.submit_async_call("q", FIELDS, result_stream, b"{}", 1, "i", 10, request_digest=digest)


@pytest.mark.parametrize(
    ("raw", "outcome"),
    [
        ([b"queued", b"1-0"], queue.Queued()),
        ([b"again", b"abc"], queue.Again("abc")),
        ([b"conflict", b"abc"], queue.Conflict("abc")),
        ([b"full", b"count"], queue.Full("count")),
        ([b"limited", b"rate", 10], queue.Limited("rate", 10)),
        ([b"limited", b"quota", 60_000], queue.Limited("quota", 60_000)),
        ([b"pressure", 900, 1000], queue.Pressure(900, 1000)),
    ],
)
def test_parse_submit_async(raw: list[bytes], outcome: queue.SubmitOutcome) -> None:
    assert queue.parse_submit_async(raw) == outcome


def test_parse_result_states() -> None:
    first = (b"1-0", [b"s", b"queued", b"q", b"s", b"e", b"1-0", b"m", b"{}"])
    assert queue.parse_result([[], 0]) is None
    assert queue.parse_result([[first], 0]).state == "queued"  # type: ignore[union-attr]
    assert queue.parse_result([[first], 1]).state == "running"  # type: ignore[union-attr]
    cancelled = queue.parse_result([[first, (b"2-0", [b"s", b"cancelled"])], 0])
    assert cancelled is not None
    assert (cancelled.state, cancelled.last_id) == ("cancelled", b"2-0")
    done = queue.parse_result([[first, (b"3-0", [b"h", b"H", b"b", b"B"]), (b"4-0", [b"cb", b"{}"])], 0])
    assert done is not None
    assert done.state == "done"
    assert done.reply == {queue.HEADER: b"H", queue.BODY: b"B"}
    assert done.callbacks == (b"{}",)


def test_level_entries_of_the_script_and_of_a_blocking_read() -> None:
    streams = ("q", "q:1")
    scripted = [[0, [(b"1-0", [b"h", b"x"])]], [1, [(b"2-0", None)]]]
    assert queue.level_entries(scripted, streams) == [(0, b"1-0", {b"h": b"x"}), (1, b"2-0", None)]
    blocking = [[b"q:1", [(b"3-0", [b"h", b"y"])]]]
    assert queue.level_entries(blocking, streams) == [(1, b"3-0", {b"h": b"y"})]
    assert queue.level_entries(None, streams) == []


async def test_scripts_on_redis(redis_url: str) -> None:
    """A runner's read fills its room from the synchronous level first; a queued asynchronous
    invocation cancels (and leaves its queue), one a runner holds does not."""
    client = FastRedis(redis_url)
    await client.execute("FLUSHALL")
    submit, read_levels = Script(client, queue.SUBMIT_ASYNC), Script(client, queue.READ_LEVELS)
    read, cancel = Script(client, queue.READ_RESULT), Script(client, queue.CANCEL)
    sync, later = keys.levels("f")
    for stream in (sync, later):
        await client.execute("XGROUP", "CREATE", stream, "runners", "0", "MKSTREAM")
    for index in range(3):
        call = queue.submit_async_call(later, FIELDS, keys.result(str(index)), b"{}", 60_000, str(index), 10)
        assert queue.parse_submit_async(await submit(call.keys, call.args)) == queue.Queued()
    await client.execute("XADD", sync, "*", "h", "s", "b", "")
    again = queue.submit_async_call(
        later, FIELDS, keys.result("9"), b"{}", 60_000, "9", 10, idempotency_key="k", request_digest="d"
    )
    assert queue.parse_submit_async(await submit(again.keys, again.args)) == queue.Queued()
    assert queue.parse_submit_async(await submit(again.keys, again.args)) == queue.Again("9")
    other = queue.submit_async_call(
        later, FIELDS, keys.result("8"), b"{}", 60_000, "8", 10, idempotency_key="k", request_digest="e"
    )
    assert queue.parse_submit_async(await submit(other.keys, other.args)) == queue.Conflict("9")

    taken = queue.level_entries(await read_levels([sync, later], ["runners", "c", 2]), (sync, later))
    assert [level for level, _, _ in taken] == [0, 1]  # the synchronous one, then one slot left
    assert queue.cancel_outcome(await cancel([keys.result("0")], ["runners"])) == "running"
    result = queue.parse_result(await read([keys.result("0")], ["runners"]))
    assert result is not None
    assert result.state == "running"
    assert queue.cancel_outcome(await cancel([keys.result("1")], ["runners"])) == "cancelled"
    assert queue.cancel_outcome(await cancel([keys.result("1")], ["runners"])) == "cancelled"
    assert queue.cancel_outcome(await cancel(["nothing"], ["runners"])) == "gone"
    assert await client.execute("XLEN", later) == 3  # 0 (held), 2 and 9; 1 left
    rest = queue.level_entries(await read_levels([sync, later], ["runners", "c", 10]), (sync, later))
    assert len(rest) == 2
    assert 0 < int(await client.execute("PTTL", keys.result("2"))) <= 60_000  # results always carry a TTL
    assert int(await client.execute("PTTL", later)) == -1  # queued work never does
    await client.execute("DEL", keys.result("9"))  # the first result expired: its key serves a new request
    assert queue.parse_submit_async(await submit(other.keys, other.args)) == queue.Queued()
    assert queue.parse_submit_async(await submit(other.keys, other.args)) == queue.Again("8")
    await client.aclose()


async def test_finish_keeps_a_result_its_ttl_after_it_is_done(redis_url: str) -> None:
    """A result submitted with a long TTL (its deadline) is kept result_ttl_s from the moment the
    reply is written, in a hash of its own; its stream says `done` and goes BELL_MS later. A reply
    without a TTL leaves its stream's as it was."""
    client = FastRedis(redis_url)
    await client.execute("FLUSHALL")
    submit, finish = Script(client, queue.SUBMIT_ASYNC), Script(client, queue.FINISH)
    later = keys.invocations("f", keys.ASYNC)
    await client.execute("XGROUP", "CREATE", later, "runners", "0", "MKSTREAM")
    call = queue.submit_async_call(later, FIELDS, keys.result("i"), b"{}", 3_600_000, "i", 10)
    assert queue.parse_submit_async(await submit(call.keys, call.args)) == queue.Queued()
    await client.execute("XADD", "gateway-replies", "*", "h", "", "b", "")
    entries = await client.execute("XREADGROUP", "GROUP", "runners", "c", "STREAMS", later, ">")
    entry_id = entries[0][1][0][0]
    assert int(await client.execute("PTTL", keys.result("i"))) > 3_000_000
    reply = {queue.HEADER: b"h", queue.BODY: b"b"}
    done = queue.finish_call(
        later,
        "runners",
        [
            queue.Outgoing(reply, keys.result("i"), reply_ttl_ms=2000),
            queue.Outgoing(reply, "gateway-replies"),
        ],
        [entry_id],
        queue.entry_bytes(FIELDS),
        100,
    )
    await finish(done.keys, done.args)
    assert 0 < int(await client.execute("PTTL", queue.stored_result(keys.result("i")))) <= 2000
    assert 0 < int(await client.execute("PTTL", keys.result("i"))) <= queue.BELL_MS
    assert int(await client.execute("PTTL", "gateway-replies")) == -1
    assert await client.execute("XLEN", keys.result("i")) == 2  # the state, then `done`
    stored = queue.parse_result(await Script(client, queue.READ_RESULT)([keys.result("i")], ["runners"]))
    assert stored is not None and (stored.state, stored.record, stored.reply) == ("done", b"{}", reply)
    await client.aclose()


async def test_submit_answers_from_the_cache_at_once(redis_url: str) -> None:
    """A cached answer (read by the script, or found by the caller in a cache of its own) is the
    result at once, kept its done TTL; nothing is queued, and a callback gets its copy."""
    client = FastRedis(redis_url)
    await client.execute("FLUSHALL")
    submit = Script(client, queue.SUBMIT_ASYNC)
    later = keys.invocations("f", keys.ASYNC)
    await client.execute("XGROUP", "CREATE", keys.callbacks(), "g", "0", "MKSTREAM")
    await client.execute("HSET", "entry", "h", "H", "b", "B")
    looked_up = queue.submit_async_call(
        later, FIELDS, keys.result("a"), b"{}", 60_000, "a", 10, done_ttl_ms=2000, lookup="entry"
    )
    found = queue.submit_async_call(
        later,
        FIELDS,
        keys.result("b"),
        b"{}",
        60_000,
        "b",
        10,
        callbacks=keys.callbacks(),
        cached={queue.HEADER: b"H2", queue.BODY: b"B2"},
    )
    missed = queue.submit_async_call(later, FIELDS, keys.result("c"), b"{}", 60_000, "c", 10, lookup="none")
    assert queue.parse_submit_async(await submit(looked_up.keys, looked_up.args)) == queue.Done()
    assert queue.parse_submit_async(await submit(found.keys, found.args)) == queue.Done()
    assert queue.parse_submit_async(await submit(missed.keys, missed.args)) == queue.Queued()
    assert await client.execute("XLEN", later) == 1  # only the miss
    read = Script(client, queue.READ_RESULT)
    done = queue.parse_result(await read([keys.result("a")], ["runners"]))
    assert done is not None
    assert (done.state, done.reply) == ("done", {queue.HEADER: b"H", queue.BODY: b"B"})
    assert 0 < int(await client.execute("PTTL", queue.stored_result(keys.result("a")))) <= 2000
    copies = await client.execute("XRANGE", keys.callbacks(), "-", "+")
    assert [fields for _, fields in copies] == [[b"h", b"H2", b"b", b"B2", b"for", b"b"]]
    await client.aclose()


def test_submit_async_call_of_a_pipelines_first_steps() -> None:
    """The first entry carries its step context; each further first step adds its stream, its
    byte counter and FORWARD's five arguments."""
    other = queue.Forward("q2", FIELDS, b"ctx2", 3, 0)
    call = queue.submit_async_call(
        "q", FIELDS, keys.result("i"), b"{}", 5000, "i", 10, step=b"ctx", more=[other]
    )
    assert call.keys[10:] == ["q2", "q2:bytes", "q:extra"]
    assert call.args[18:] == [b"ctx", 0, 800, "", 0, 0, 3, 0, b"h" * 10, b"b" * 10, b"ctx2"]
    plain = queue.submit_async_call("q", FIELDS, keys.result("i"), b"{}", 5000, "i", 10)
    assert len(plain.keys) == 11 and len(plain.args) == 24


async def test_a_pipelines_first_steps_queue_together_and_cancel_together(redis_url: str) -> None:
    """Two first steps on two streams: both queued or neither (the full one named by its index),
    `running` once a runner took one or one left its stream, cancelled only while none was taken,
    and then both leave their queues, their byte counts with them."""
    client = FastRedis(redis_url)
    await client.execute("FLUSHALL")
    submit, read = Script(client, queue.SUBMIT_ASYNC), Script(client, queue.READ_RESULT)
    cancel = Script(client, queue.CANCEL)
    one, two = keys.invocations("one", keys.ASYNC), keys.invocations("two", keys.ASYNC)
    for stream in (one, two):
        await client.execute("XGROUP", "CREATE", stream, "runners", "0", "MKSTREAM")

    def first_steps(invocation_id: str, room: int = 10) -> queue.ScriptCall:
        return queue.submit_async_call(
            one,
            FIELDS,
            keys.result(invocation_id),
            b"{}",
            60_000,
            invocation_id,
            10,
            step=b"ctx1",
            more=[queue.Forward(two, FIELDS, b"ctx2", room, 0)],
        )

    full = first_steps("a", room=0)
    assert queue.parse_submit_async(await submit(full.keys, full.args)) == queue.Full("count", 1)
    assert [await client.execute("XLEN", stream) for stream in (one, two)] == [0, 0]
    for invocation_id in ("b", "c", "d"):
        call = first_steps(invocation_id)
        assert queue.parse_submit_async(await submit(call.keys, call.args)) == queue.Queued()
    assert [await client.execute("XLEN", stream) for stream in (one, two)] == [3, 3]
    stepped = await client.execute("XRANGE", one, "-", "+", "COUNT", 1)
    assert dict(zip(stepped[0][1][::2], stepped[0][1][1::2], strict=True))[queue.STEP] == b"ctx1"
    pending = queue.parse_result(await read([keys.result("b")], ["runners"]))
    assert pending is not None and pending.state == "queued"

    taken = await client.execute("XREADGROUP", "GROUP", "runners", "x", "COUNT", 1, "STREAMS", two, ">")
    assert taken[0][1][0][1] is not None  # `b`'s second step, held by a runner
    running = queue.parse_result(await read([keys.result("b")], ["runners"]))
    assert running is not None and running.state == "running"
    assert queue.cancel_outcome(await cancel([keys.result("b")], ["runners"])) == "running"
    first = await client.execute("XRANGE", one, "-", "+", "COUNT", 2)
    await client.execute("XDEL", one, first[1][0])  # `c`'s first step finished: its pipeline went on
    moved_on = queue.parse_result(await read([keys.result("c")], ["runners"]))
    assert moved_on is not None and moved_on.state == "running"
    assert queue.cancel_outcome(await cancel([keys.result("c")], ["runners"])) == "running"

    before = [int(await client.execute("GET", queue.queue_bytes(stream))) for stream in (one, two)]
    assert queue.cancel_outcome(await cancel([keys.result("d")], ["runners"])) == "cancelled"
    after = [int(await client.execute("GET", queue.queue_bytes(stream))) for stream in (one, two)]
    size = queue.entry_bytes({**FIELDS, queue.STEP: b"ctx1"})
    assert [b - a for b, a in zip(before, after, strict=True)] == [size, size]
    assert [await client.execute("XLEN", stream) for stream in (one, two)] == [1, 2]
    await client.aclose()


async def submitted_and_done(
    client: FastRedis, invocation_id: str, output_bytes: int, **options: Any
) -> queue.SubmitOutcome:
    """Submit an asynchronous invocation; once queued, a runner's FINISH answers it with a reply
    of `output_bytes`, kept an hour."""
    stream = keys.invocations("f", keys.ASYNC)
    with contextlib.suppress(Exception):
        await client.execute("XGROUP", "CREATE", stream, "runners", "0", "MKSTREAM")
    result = keys.result(invocation_id)
    call = queue.submit_async_call(stream, FIELDS, result, b"{}", 60_000, invocation_id, 100, **options)
    outcome = queue.parse_submit_async(await Script(client, queue.SUBMIT_ASYNC)(call.keys, call.args))
    if outcome != queue.Queued():
        return outcome
    taken = await client.execute("XREADGROUP", "GROUP", "runners", "c", "COUNT", 1, "STREAMS", stream, ">")
    reply = {queue.HEADER: b"h" * 100, queue.BODY: b"\0" * output_bytes}
    done = queue.finish_call(
        stream,
        "runners",
        [queue.Outgoing(reply, result, reply_ttl_ms=3_600_000)],
        [taken[0][1][0][0]],
        queue.entry_bytes(FIELDS),
        100,
    )
    await Script(client, queue.FINISH)(done.keys, done.args)
    return outcome


async def test_a_done_result_is_stored_in_an_eighth_of_a_stream(redis_url: str) -> None:
    """Kept for its TTL: its record, its reply and a little more, not a stream's 4 KiB node."""
    client = FastRedis(redis_url)
    await client.execute("FLUSHALL")
    assert await submitted_and_done(client, "a" * 32, 64) == queue.Queued()
    stored = int(await client.execute("MEMORY", "USAGE", queue.stored_result(keys.result("a" * 32))))
    await client.execute("XADD", "a-stream", "*", "m", "{}", "h", "h" * 100, "b", "\0" * 64)
    as_a_stream = int(await client.execute("MEMORY", "USAGE", "a-stream"))
    assert as_a_stream > 4096 and stored < as_a_stream / 8
    await client.aclose()


async def test_a_key_over_its_result_quota_is_refused_until_its_results_expire(redis_url: str) -> None:
    """Each done result charges its bytes to its key; a key that holds its quota gets
    Limited('quota') before anything is queued, another key does not; bytes whose minute has passed
    are freed (here an expired minute, written as the script writes one)."""
    client = FastRedis(redis_url)
    await client.execute("FLUSHALL")
    quota = queue.ResultQuota(keys.result_quota("k1"), 400)
    assert await submitted_and_done(client, "1" * 32, 300, quota=quota) == queue.Queued()
    charged = int(await client.execute("HGET", quota.key, "total"))
    assert charged == 2 + 100 + 300  # record, header, body
    refused = await submitted_and_done(client, "2" * 32, 300, quota=quota)
    assert isinstance(refused, queue.Limited) and refused.limit == "quota"
    assert 1000 <= refused.retry_after_ms <= 3_660_000
    assert await client.execute("XLEN", keys.invocations("f", keys.ASYNC)) == 0
    other = queue.ResultQuota(keys.result_quota("k2"), 500)
    assert await submitted_and_done(client, "3" * 32, 10, quota=other) == queue.Queued()
    # The minute of the first result has passed: its bytes go at the next submission.
    for field in await client.execute("HKEYS", quota.key):
        if field != b"total":
            await client.execute("ZADD", quota.key + ":at", 60_000, field)
    assert await submitted_and_done(client, "4" * 32, 10, quota=quota) == queue.Queued()
    assert int(await client.execute("HGET", quota.key, "total")) == 2 + 100 + 10
    await client.aclose()


async def test_one_keys_results_hold_at_most_their_share_and_others_still_submit(
    extra_redis: Callable[..., tuple[Any, str]],
) -> None:
    """A key whose quota of bytes (256 MiB) is far above what Redis may hold (8 MiB) holds at most
    its share (a quarter) of the memory from which submissions are refused: past it, that key is
    refused 'quota', and another key still submits, well before the pressure that would refuse
    every key. QUOTA (a Redis Cluster's check on the key's slot) answers the same."""
    _process, url = extra_redis("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
    client = FastRedis(url)
    greedy = queue.ResultQuota(keys.result_quota("greedy"), 256 * 2**20, memory_share=0.25)
    outcomes = []
    for index in range(40):  # 256 KiB a result: the share (1.6 MiB) is passed in 7
        outcomes.append(await submitted_and_done(client, f"{index:032x}", 2**18, quota=greedy))
        if outcomes[-1] != queue.Queued():
            break
    refused = outcomes[-1]
    assert isinstance(refused, queue.Limited) and refused.limit == "quota", outcomes
    assert 5 <= len(outcomes) <= 9
    held = int(await client.execute("HGET", greedy.key, "total"))
    assert 0.25 * 0.8 * 8 * 2**20 <= held < 0.25 * 0.8 * 8 * 2**20 + 2**18 + 200
    other = queue.ResultQuota(keys.result_quota("other"), 256 * 2**20, memory_share=0.25)
    assert await submitted_and_done(client, "f" * 32, 2**18, quota=other) == queue.Queued()
    check = Script(client, slots.QUOTA)
    assert await check(*_call(slots.quota_call(greedy))) >= 1000
    assert await check(*_call(slots.quota_call(other))) == 0
    no_share = dataclasses.replace(greedy, memory_share=0.0)  # the quota's bytes alone
    assert await check(*_call(slots.quota_call(no_share))) == 0
    await client.aclose()


def _call(call: queue.ScriptCall) -> tuple[list[str], list[Any]]:
    return call.keys, list(call.args)


@pytest.mark.parametrize("elsewhere", [False, True])
async def test_a_dropped_result_is_gone_and_freed_from_its_quota(redis_url: str, elsewhere: bool) -> None:
    """DROP_RESULT removes the result and frees its bytes from its key's quota at once, on one
    Redis or (`elsewhere`: the quota in another slot) through UNCHARGE with what it answers; the
    key, refused while it held its quota, submits again."""
    client = FastRedis(redis_url)
    await client.execute("FLUSHALL")
    quota = queue.ResultQuota(keys.result_quota("k1"), 400)
    assert await submitted_and_done(client, "1" * 32, 300, quota=quota) == queue.Queued()
    refused = await submitted_and_done(client, "2" * 32, 300, quota=quota)
    assert isinstance(refused, queue.Limited) and refused.limit == "quota"
    assert await submitted_and_done(client, "3" * 32, 10) == queue.Queued()  # charged to no quota
    result = keys.result("1" * 32)
    drop = Script(client, queue.DROP_RESULT)
    if elsewhere:
        size, left_ms = await drop([result, ""], [])
        assert size == 2 + 100 + 300 and 3_500_000 < left_ms <= 3_600_000
        await Script(client, slots.UNCHARGE)([quota.key], [size, left_ms])
    else:
        assert await drop([result, quota.key], []) == []
    assert int(await client.execute("HGET", quota.key, "total")) == 0
    read = Script(client, queue.READ_RESULT)
    assert queue.parse_result(await read([result], ["runners"])) is None
    assert queue.parse_result(await read([keys.result("3" * 32)], ["runners"])) is not None
    assert await drop([result, quota.key], []) == []  # dropped twice: nothing more is freed
    assert await submitted_and_done(client, "4" * 32, 300, quota=quota) == queue.Queued()
    await client.aclose()


async def test_submissions_are_refused_under_memory_pressure(
    extra_redis: Callable[..., tuple[Any, str]],
) -> None:
    """Past ASYNC_MEMORY_RATIO of maxmemory an asynchronous submission is refused (nothing queued,
    nothing stored); below it, or with no maxmemory, it is queued."""
    _process, url = extra_redis("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
    client = FastRedis(url)
    assert await submitted_and_done(client, "5" * 32, 10) == queue.Queued()
    for index in range(40):  # to 85% of maxmemory, a piece at a time (a client's buffer counts too)
        memory = (await client.execute("INFO", "memory")).decode()
        if int(memory.split("used_memory:")[1].split()[0]) > 0.85 * 8 * 2**20:
            break
        await client.execute("SET", f"ballast{index}", "x" * 2**18)
    refused = await submitted_and_done(client, "6" * 32, 10)
    assert isinstance(refused, queue.Pressure) and refused.max_bytes == 8 * 2**20
    assert refused.used_bytes >= 0.8 * refused.max_bytes
    assert "asynchronous invocations are refused" in refused.describe()
    assert await client.execute("EXISTS", keys.result("6" * 32)) == 0
    assert await submitted_and_done(client, "7" * 32, 10, memory_ratio=0) == queue.Queued()
    await client.aclose()


async def test_callback_attempts_are_kept_with_their_result(redis_url: str) -> None:
    client = FastRedis(redis_url)
    await client.execute("FLUSHALL")
    assert await submitted_and_done(client, "8" * 32, 10) == queue.Queued()
    record = Script(client, queue.RECORD_CALLBACK)
    for attempt in (b'{"attempt":1}', b'{"attempt":2}'):
        assert await record([keys.result("8" * 32)], [attempt]) == 1
    read = queue.parse_result(await Script(client, queue.READ_RESULT)([keys.result("8" * 32)], ["runners"]))
    assert read is not None and read.callbacks == (b'{"attempt":1}', b'{"attempt":2}')
    await client.aclose()
