from __future__ import annotations

import pytest

from fngate import queue


def test_waiter_round_trip() -> None:
    waiter = queue.Waiter("fngate:r:abc", "0123", 1_764_000_000_123)
    assert waiter.encode() == "fngate:r:abc 0123 1764000000123"
    assert queue.Waiter.decode(waiter.encode().encode()) == waiter


def test_enqueue_call_without_cache() -> None:
    call = queue.enqueue_call(
        "fngate:q:f", {queue.HEADER: b"{}", queue.BODY: b"xy"}, queue.Waiter("r", "i", 9), 500, 100, 4096
    )
    assert call.keys == ["fngate:q:f", "fngate:q:f:bytes", "", "", "", "", "", ""]
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
    assert call.keys[5:] == ["rate", "busy", "share"]
    assert call.args[6:] == [2.5, 5, 3, 1, "member", 300_000]


@pytest.mark.parametrize(
    ("raw", "outcome"),
    [
        ([b"queued"], queue.Queued()),
        ([b"wait"], queue.Waiting()),
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
    assert call.keys == ["q", "q:bytes", "r1", "r2", "fngate:result:i"]
    assert call.args[:7] == ["runners", 1000, 123, 5, "", 0, 0]  # no statistics
    first = 7
    items = [call.args[first + i * queue.FINISH_ITEM : first + (i + 1) * queue.FINISH_ITEM] for i in range(5)]
    assert items[0] == [3, b"h", b"b", "", 0, "", "", "share", "", "", 0]
    assert items[1] == [4, b"h", b"b", "c", 60, "m", "m:w", "share", "", "", 0]
    assert items[2] == [3, b"h", b"b", "", 0, "m2", "m2:w", "promote", b"ih", b"ib", 0]
    assert items[3][7] == "drop"
    assert items[4] == [5, b"h", b"b", "", 0, "", "", "share", "", "", 1000]
    assert call.args[first + 5 * queue.FINISH_ITEM :] == [b"1-0", b"2-0", b"3-0", b"4-0", b"5-0"]


def test_finish_call_carries_the_batch_statistics() -> None:
    reply = {queue.HEADER: b"h", queue.BODY: b"b"}
    stats = queue.Statistics("fngate:stats:f:1", {"success_count": 2, "queue_ns": 50}, 99)
    call = queue.finish_call("q", "g", [queue.Outgoing(reply, "r")], [b"1-0"], 10, 100, stats)
    assert call.args[4:11] == ["fngate:stats:f:1", 99, 2, "success_count", 2, "queue_ns", 50]
    assert call.args[11] == 3  # the first reply's stream


def test_answered_id_prefers_the_waiter_named() -> None:
    assert queue.answered_id({queue.FOR: b"w1"}, "own") == "w1"
    assert queue.answered_id({}, "own") == "own"
