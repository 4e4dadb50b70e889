"""Hash tags and slots: what a script touches shares a slot, slots as Redis Cluster computes them,
and asynchronous results placed in the slot of the stream they were queued on."""

from __future__ import annotations

import pytest

from fngate import keys, queue

FUNCTION_KEYS = [
    keys.invocations("tiny"),
    keys.invocations("tiny", keys.ASYNC),
    queue.queue_bytes(keys.invocations("tiny")),
    keys.dead_letters("tiny"),
    keys.cache_entry("tiny", "ab12"),
    keys.in_flight("tiny", "ab12"),
    queue.waiters(keys.in_flight("tiny", "ab12")),
    keys.statistics("tiny", "3"),
]


def test_what_a_functions_scripts_touch_shares_its_slot() -> None:
    assert {keys.slot(key) for key in FUNCTION_KEYS} == {keys.slot("tiny")}
    limits = [keys.key_rate("k1"), keys.key_in_flight("k1"), keys.key_share("k1", "tiny")]
    assert {keys.slot(key) for key in limits} == {keys.slot("k1")}
    assert keys.slot(keys.replies("0123abcd")) == keys.slot("0123abcd")


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("foo", 12182),  # the Redis Cluster specification's examples
        ("{user1000}.following", keys.slot("user1000")),
        ("{user1000}.followers", keys.slot("user1000")),
        ("foo{}{bar}", keys.slot("foo{}{bar}")),  # an empty first tag: the whole key
        (b"fngate:q:{tiny}", keys.slot("tiny")),
    ],
)
def test_slot_follows_the_hash_tag_rules(key: str | bytes, expected: int) -> None:
    assert keys.slot(key) == expected
    assert keys.hash_tag("foo{}{bar}") == "foo{}{bar}"
    assert keys.hash_tag("a{b}c{d}") == "b"


def test_an_asynchronous_result_lives_in_the_slot_of_its_stream() -> None:
    for function in ("tiny", "wide", "classifier", "text-classifier", "a"):
        stream = keys.invocations(function, keys.ASYNC)
        invocation_id = keys.result_id(stream)
        assert len(invocation_id) == 32 and int(invocation_id, 16) >= 0
        assert keys.slot(keys.result(invocation_id)) == keys.slot(stream)
        assert keys.result_id(stream) != invocation_id  # the rest is random
    tagged = "fngate:result:{012345}6789abcdef0123456789abcdef"
    assert keys.result("0123456789abcdef0123456789abcdef") == tagged


def test_every_slot_has_a_tag_of_digits() -> None:
    tags = [keys._slot_tag(slot) for slot in range(keys.SLOTS)]
    assert all(len(tag) == keys.RESULT_TAG_DIGITS and tag.isdigit() for tag in tags)
    assert [keys.slot(tag) for tag in tags] == list(range(keys.SLOTS))
