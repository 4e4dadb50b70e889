from __future__ import annotations

import pytest

from fngate import keys, queue
from fngate.queue import slots


def test_waiter_round_trip() -> None:
    waiter = queue.Waiter("fngate:r:abc", "0123", 1_764_000_000_123)
    assert waiter.encode() == "fngate:r:abc 0123 1764000000123"
    assert queue.Waiter.decode(waiter.encode().encode()) == waiter


def test_enqueue_call_without_cache() -> None:
    call = queue.enqueue_call(
        "fngate:q:f", {queue.HEADER: b"{}", queue.BODY: b"xy"}, queue.Waiter("r", "i", 9), 500, 100, 4096
    )
    # The last: the stream's count of what its shared entries hold, declared for a Redis Cluster.
    assert call.keys == ["fngate:q:f", "fngate:q:f:bytes", "", "", "", "", "", "", "fngate:q:f:extra"]
    assert call.args == [100, 4096, b"{}", b"xy", "r i 9", 500, 0, 0, 0, 0, "", 0]  # no admission


def test_enqueue_call_with_lookup_and_coalescing() -> None:
    call = queue.enqueue_call(
        "s", {queue.HEADER: b"h", queue.BODY: b""}, queue.Waiter("r", "i", 9), 0, 1, lookup="c", in_flight="m"
    )
    assert call.keys[:5] == ["s", "s:bytes", "c", "m", "m:w"]
    assert call.args[5] == 1  # a marker never gets a TTL of 0


def test_enqueue_call_with_an_admission() -> None:
    admission = queue.Admission(("rate", "busy", "share"), (2.5, 5, 3, 1, "member", 300_000))
    call = queue.enqueue_call(
        "s", {queue.HEADER: b"h", queue.BODY: b""}, queue.Waiter("r", "i", 9), 10, 1, admission=admission
    )
    assert call.keys[5:8] == ["rate", "busy", "share"]
    assert call.args[6:] == [2.5, 5, 3, 1, "member", 300_000]


@pytest.mark.parametrize(
    ("raw", "outcome"),
    [
        ([b"queued"], queue.Queued()),
        ([b"wait"], queue.Coalesced()),
        ([b"hit", b"head", None], queue.Hit({queue.HEADER: b"head", queue.BODY: b""})),
        ([b"full", b"count"], queue.Full("count")),
        ([b"full", b"bytes"], queue.Full("bytes")),
        ([b"limited", b"rate", 250], queue.Limited("rate", 250)),
    ],
)
def test_parse_enqueue(raw: list[bytes | None], outcome: queue.EnqueueOutcome) -> None:
    assert queue.parse_enqueue(raw) == outcome


def test_parse_enqueue_refuses_what_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="unknown"):
        queue.parse_enqueue([b"maybe"])


def test_finish_call_numbers_each_reply_stream_once() -> None:
    reply = {queue.HEADER: b"h", queue.BODY: b"b"}
    invocation = {queue.HEADER: b"ih", queue.BODY: b"ib"}
    call = queue.finish_call(
        "q",
        "runners",
        [
            queue.Outgoing(reply, "r1"),
            queue.Outgoing(reply, "r2", "c", 60, "m", "share"),
            queue.Outgoing(reply, "r1", in_flight="m2", waiters="promote", invocation=invocation),
            queue.Outgoing(reply, "r2", in_flight="m3", waiters="promote"),  # nothing to promote with
            queue.Outgoing(reply, "fngate:result:i", reply_ttl_ms=1000),  # an asynchronous result
        ],
        [b"1-0", b"2-0", b"3-0", b"4-0", b"5-0"],
        123,
        1000,
    )
    assert call.keys == ["q", "q:bytes", "r1", "r2", "fngate:result:i", "q:extra"]
    assert call.args[:7] == ["runners", 1000, 123, 5, "", 0, 0]  # no statistics
    first = 7
    items = [call.args[first + i * queue.FINISH_ITEM : first + (i + 1) * queue.FINISH_ITEM] for i in range(5)]
    assert items[0] == [3, b"h", b"b", "", 0, "", "", "share", "", "", 0]
    assert items[1] == [4, b"h", b"b", "c", 60, "m", "m:w", "share", "", "", 0]
    assert items[2] == [3, b"h", b"b", "", 0, "m2", "m2:w", "promote", b"ih", b"ib", 0]
    assert items[3][7] == "drop"
    assert items[4] == [5, b"h", b"b", "", 0, "", "", "share", "", "", 1000]
    assert call.args[first + 5 * queue.FINISH_ITEM] == 0  # nothing packed: r1's second needs waiters
    assert call.args[first + 5 * queue.FINISH_ITEM + 1] == 0  # no grouped entry: none to take back
    assert call.args[first + 5 * queue.FINISH_ITEM + 2 :] == [b"1-0", b"2-0", b"3-0", b"4-0", b"5-0"]


def test_finish_call_packs_what_one_stream_gets_and_needs_nothing_else() -> None:
    def reply(number: int) -> dict[bytes, bytes]:
        return {queue.HEADER: b'{"id":"%d"}' % number, queue.BODY: b"b%d" % number}

    call = queue.finish_call(
        "q",
        "g",
        [
            queue.Outgoing(reply(1), "r1"),
            queue.Outgoing(reply(2), "r2"),
            queue.Outgoing(reply(3), "r1", "c", 60),  # cached: an item of its own
            queue.Outgoing(reply(4), "r1"),
            queue.Outgoing(reply(5), "r1", delivered=True),  # in its stream already
        ],
        [b"1-0"],
        10,
        100,
    )
    assert call.keys == ["q", "q:bytes", "r2", "r1", "q:extra"]
    assert call.args[3] == 3  # items: r2's one reply, r1's cached one and the one delivered already
    items = [call.args[7 + i * queue.FINISH_ITEM : 7 + (i + 1) * queue.FINISH_ITEM] for i in range(3)]
    assert [item[0:2] for item in items] == [[3, b'{"id":"2"}'], [4, b'{"id":"3"}'], [0, b'{"id":"5"}']]
    packed = 7 + 3 * queue.FINISH_ITEM
    assert call.args[packed:] == [1, 4, b'[{"id":"1"},{"id":"4"}]', b"b1b4", 0, b"1-0"]


def test_finish_call_carries_the_batch_statistics() -> None:
    reply = {queue.HEADER: b"h", queue.BODY: b"b"}
    stats = queue.Statistics("fngate:stats:f:1", {"success_count": 2, "queue_ns": 50}, 99)
    call = queue.finish_call("q", "g", [queue.Outgoing(reply, "r")], [b"1-0"], 10, 100, stats)
    assert call.args[4:11] == ["fngate:stats:f:1", 99, 2, "success_count", 2, "queue_ns", 50]
    assert call.args[11] == 3  # the first reply's stream


def test_answered_id_prefers_the_waiter_named() -> None:
    assert queue.answered_id({queue.FOR: b"w1"}, "own") == "w1"
    assert queue.answered_id({}, "own") == "own"


def test_finish_call_counts_the_waiters_its_caller_answered() -> None:
    reply = {queue.HEADER: b"h", queue.BODY: b"b"}
    outgoing = [
        queue.Outgoing(reply, "r1", delivered=True),
        queue.Outgoing(reply, "r2", in_flight="m", delivered=True),
        queue.Outgoing(reply, "q-result", in_flight="m2", waiters="drop"),
    ]
    call = queue.finish_call("q", "g", outgoing, [b"1-0"], 10, 100, answered={1: 3})
    assert call.keys == ["q", "q:bytes", "q-result", "q:extra"]  # replies delivered already are not KEYS
    items = [call.args[7 + i * queue.FINISH_ITEM : 7 + (i + 1) * queue.FINISH_ITEM] for i in range(3)]
    assert items[0][0] == 0 and items[0][7:9] == ["counted", 0]
    assert items[1][0] == 0 and items[1][7:9] == ["counted", 3]
    assert items[2][0] == 3 and items[2][7:9] == ["drop", ""]


def test_a_batch_splits_into_what_its_slot_holds_and_what_is_delivered_first() -> None:
    reply = {queue.HEADER: b"h", queue.BODY: b"b"}
    stream = keys.invocations("tiny")
    result = keys.result(keys.result_id(keys.invocations("tiny", keys.ASYNC)))
    pipeline_cache = keys.cache_entry("pipe", "ff")
    callback = queue.callback_marker(keys.result(keys.result_id(keys.invocations("first", keys.ASYNC))))
    split = slots.split_replies(
        stream,
        [
            queue.Outgoing(reply, keys.replies("gw1"), keys.cache_entry("tiny", "aa"), 60),
            queue.Outgoing(reply, result, reply_ttl_ms=5000, in_flight=queue.callback_marker(result)),
            queue.Outgoing(reply, keys.replies("gw2"), pipeline_cache, 30, in_flight=callback),
        ],
    )
    kept, deliveries = split.kept, split.deliveries
    assert [out.delivered for out in kept] == [True, False, True]
    assert [out.cache_entry for out in kept] == ["", "", ""]  # delivered with their replies
    assert [out.in_flight for out in kept] == ["", queue.callback_marker(result), ""]
    assert split.markers == [(callback, reply)]  # answered by the batch, in its own slot
    assert deliveries == [
        slots.Delivery(keys.cache_entry("tiny", "aa"), reply, cache_ttl_s=60),
        slots.Delivery(keys.replies("gw1"), reply),
        slots.Delivery(pipeline_cache, reply, cache_ttl_s=30),
        slots.Delivery(keys.replies("gw2"), reply),
    ]
    waiter = slots.Delivery(keys.replies("gw1"), reply, answers="w1")
    calls = slots.deliver_calls([*deliveries, waiter], 1000)
    by_first_key = {call.keys[0]: call for call in calls}
    assert len(calls) == 4  # one DELIVER per slot
    own, waiter_copy = ["r", 1, b"h", b"b", "", 0], ["r", 1, b"h", b"b", "w1", 0]
    assert by_first_key[keys.replies("gw1")].args == [1000, *own, *waiter_copy]
    assert by_first_key[pipeline_cache].args == [1000, "c", 1, b"h", b"b", 30, ""]
    assert by_first_key[keys.cache_entry("tiny", "aa")].args == [1000, "c", 1, b"h", b"b", 60, ""]


@pytest.mark.parametrize(
    ("raw", "joined"),
    [
        (3, []),
        ([b"more", [[1, [b"fngate:r:{g} i1 99"]]]], [(1, [queue.Waiter("fngate:r:{g}", "i1", 99)])]),
    ],
)
def test_parse_finish(raw: object, joined: list[tuple[int, list[queue.Waiter]]]) -> None:
    assert slots.parse_finish(raw) == joined


def test_forward_calls_group_a_pipelines_entries_by_slot() -> None:
    entries = [
        queue.Forward(keys.invocations(name), {queue.HEADER: b"h", queue.BODY: b"b"}, b"s", 10, 0)
        for name in ("a", "b", "a")
    ]
    grouped = slots.forward_calls(entries)
    assert [indexes for indexes, _ in grouped] == [[0, 2], [1]]
    assert grouped[0][1].keys[:2] == [keys.invocations("a")] * 2
