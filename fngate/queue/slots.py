"""On a Redis Cluster, the steps that stand in for what one script does across slots on one Redis:
a batch's replies and cache entries of other slots delivered before its FINISH (DELIVER), the
entries of a pipeline queued one slot at a time (FORWARD per slot), and an idempotency key taken
apart from the submission that it names (CLAIM). Pure builders and parsers; fngate.delivery and
gateway.slots run them, in the order that keeps the guarantees (docs/faults.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from fngate import keys
from fngate.queue.invocations import BODY, HEADER, Forward, Outgoing, ScriptCall, Waiter
from fngate.queue.steps import forward_call
from fngate.queue.stored import STORE_RESULT_LUA

# KEYS: streams and cache entries of one slot. ARGV[1]: the reply streams' maxlen, then groups of
# six: the kind ('r' a reply, 'c' a cache entry), the index of its key in KEYS, header, body, then
# for a reply the invocation it answers ('' its own: the reply's) and how long in ms to keep it
# (0: a gateway's reply stream; else an asynchronous result's, stored as FINISH stores it), for a
# cache entry its TTL in s and ''. Replies go only to streams that exist (NOMKSTREAM), as FINISH's.
DELIVER = (
    STORE_RESULT_LUA
    + """
local maxlen = ARGV[1]
for at = 2, #ARGV, 6 do
  local key, h, b = KEYS[tonumber(ARGV[at + 1])], ARGV[at + 2], ARGV[at + 3]
  if ARGV[at] == 'c' then
    redis.call('HSET', key, 'h', h, 'b', b)
    redis.call('EXPIRE', key, ARGV[at + 4])
  elseif ARGV[at + 4] ~= '' then
    redis.call('XADD', key, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*', 'h', h, 'b', b, 'for', ARGV[at + 4])
  elseif ARGV[at + 5] ~= '0' then
    store_result(key, h, b, ARGV[at + 5])
  else
    redis.call('XADD', key, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*', 'h', h, 'b', b)
  end
end
return 1
"""
)

# KEYS[1]: the waiters list of an in-flight marker of another slot than its batch's (an asynchronous
# pipeline's callback marker, in the slot of its first step). WAITERS reads it, FORGET drops marker
# and list once the batch is acknowledged.
WAITERS = "return redis.call('LRANGE', KEYS[1], 0, -1)"
FORGET = "return redis.call('DEL', KEYS[1], KEYS[2])"

# KEYS[1]: an idempotency key (keys.idempotency). ARGV: what it is to hold ('' to free it), its
# TTL in ms, and what the caller saw it hold ('' for nothing). Compare and set: done when it still
# holds what the caller saw (answers ''), else answers what it holds now.
CLAIM = """
local held = redis.call('GET', KEYS[1]) or ''
if held ~= ARGV[3] then return held end
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return ''
"""


@dataclasses.dataclass(frozen=True, slots=True)
class Delivery:
    """A reply (or an answer for the response cache) that DELIVER writes."""

    key: str
    fields: Mapping[bytes, bytes]
    answers: str = ""
    """A reply addressed `for` this invocation (an identical one that waited); '' for its own."""
    ttl_ms: int = 0
    """An asynchronous result's reply: kept this long, stored as FINISH stores it (0: a reply stream's)."""
    cache_ttl_s: int = 0
    """More than 0: an answer for the response cache, kept this long."""

    @property
    def is_cached(self) -> bool:
        return self.cache_ttl_s > 0


@dataclasses.dataclass(frozen=True, slots=True)
class Split:
    """A batch's replies as FINISH on its stream's slot takes them, and the rest."""

    kept: list[Outgoing]
    """Each reply, marked delivered where it is in another slot, without its cache entry where
    that is delivered, and without its in-flight marker where that is in another slot."""
    deliveries: list[Delivery]
    """What DELIVER writes before FINISH: the cache entries, then the replies (Delivery.is_cached)."""
    markers: list[tuple[str, Mapping[bytes, bytes]]]
    """In-flight markers of other slots, with the reply their waiters get (WAITERS, FORGET)."""


def split_replies(stream: str, replies: Sequence[Outgoing]) -> Split:
    """Where each part of a batch's replies goes on a Redis Cluster."""
    home = keys.slot(stream)
    split = Split([], [], [])
    kept, deliveries = split.kept, split.deliveries
    for out in replies:
        changes: dict[str, Any] = {}
        delivered = keys.slot(out.reply_to) != home
        # A reply delivered ahead of FINISH takes its cache entry with it (written first), so that
        # a repeat sent once the answer is in hits, as on one Redis.
        if out.cache_entry and (delivered or keys.slot(out.cache_entry) != home):
            deliveries.append(Delivery(out.cache_entry, out.reply, cache_ttl_s=max(out.cache_ttl_s, 1)))
            changes["cache_entry"] = ""
        if delivered:
            deliveries.append(Delivery(out.reply_to, out.reply, ttl_ms=out.reply_ttl_ms))
            changes["delivered"] = True
        if out.in_flight and keys.slot(out.in_flight) != home:
            split.markers.append((out.in_flight, out.reply))
            changes["in_flight"] = ""
        kept.append(dataclasses.replace(out, **changes) if changes else out)
    return split


def deliver_calls(deliveries: Sequence[Delivery], reply_maxlen: int) -> list[ScriptCall]:
    """One DELIVER per slot."""
    by_slot: dict[int, tuple[dict[str, int], list[bytes | str | int | float]]] = {}
    for item in deliveries:
        named, args = by_slot.setdefault(keys.slot(item.key), ({}, [reply_maxlen]))
        index = named.setdefault(item.key, len(named) + 1)
        fields = (item.fields[HEADER], item.fields.get(BODY, b""))
        if item.cache_ttl_s:
            args += ["c", index, *fields, item.cache_ttl_s, ""]
        else:
            args += ["r", index, *fields, item.answers, item.ttl_ms]
    return [ScriptCall(list(named), args) for named, args in by_slot.values()]


def parse_finish(raw: Any) -> list[tuple[int, list[Waiter]]]:
    """FINISH's answer: [] once done, else the waiters that joined each counted reply (by its
    index) and still need its answer."""
    if not isinstance(raw, list) or not raw or raw[0] != b"more":
        return []
    return [(int(index), [Waiter.decode(item) for item in joined]) for index, joined in raw[1]]


def forward_calls(entries: Sequence[Forward]) -> list[tuple[list[int], ScriptCall]]:
    """FORWARD per slot: each call with the indexes (in `entries`) of the entries it queues."""
    by_slot: dict[int, list[int]] = {}
    for index, item in enumerate(entries):
        by_slot.setdefault(keys.slot(item.stream), []).append(index)
    return [(indexes, forward_call([entries[i] for i in indexes])) for indexes in by_slot.values()]


def claim_call(idempotency_key: str, holds: str, ttl_ms: int, seen: str) -> ScriptCall:
    """CLAIM's arguments: `idempotency_key` to hold `holds` ('' to free it) if it holds `seen`."""
    return ScriptCall([idempotency_key], [holds, max(ttl_ms, 1), seen])
