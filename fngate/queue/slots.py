"""On a Redis Cluster, the steps that stand in for what one script does across slots on one Redis:
a batch's replies and cache entries of other slots delivered before its FINISH (DELIVER), the
entries of a pipeline queued one slot at a time (FORWARD per slot), an idempotency key taken
apart from the submission that it names (CLAIM), a key's result quota checked before a submission
(QUOTA) and charged once a result is stored (CHARGE), and an asynchronous pipeline cancelled slot
by slot (FIRST_STEPS, ASIDE, PUT_BACK, then CANCEL). Pure builders and parsers; fngate.delivery and
gateway.slots run them, in the order that keeps the guarantees (docs/faults.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from fngate import keys
from fngate.queue.invocations import BODY, HEADER, UNQUEUE_LUA, Forward, Outgoing, ScriptCall, Waiter
from fngate.queue.results import (
    ASYNC_MEMORY_RATIO,
    PRESSURE_LUA,
    QUEUED_ENTRIES_LUA,
    SETTLED_LUA,
    ResultQuota,
)
from fngate.queue.steps import forward_call
from fngate.queue.stored import PACKED_LUA, QUOTA_LUA, STORE_RESULT_LUA, Charge, parse_charges, text

# KEYS: streams and cache entries of one slot. ARGV[1]: the reply streams' maxlen, then groups of
# six: the kind ('r' a reply, 'p' replies packed into one entry, 'c' a cache entry), the index of
# its key in KEYS, header, body (packed: the headers as one JSON array and the bodies back to back,
# HEADERS and BODIES, as FINISH packs a batch's replies to one gateway), then for a reply the
# invocation it answers ('' its own: the reply's) and how long in ms to keep it (0: a gateway's
# reply stream; else an asynchronous result's, stored as FINISH stores it), for a cache entry its
# TTL in s and '' (packed: '' and ''). Replies go only to streams that exist (NOMKSTREAM), as
# FINISH's.
# Answers what the results it stored owe quotas in other slots ({{quota, bytes, ttl_ms}, ...}).
DELIVER = (
    STORE_RESULT_LUA
    + """
local maxlen = ARGV[1]
local owed = {}
for at = 2, #ARGV, 6 do
  local key, h, b = KEYS[tonumber(ARGV[at + 1])], ARGV[at + 2], ARGV[at + 3]
  if ARGV[at] == 'c' then
    redis.call('HSET', key, 'h', h, 'b', b)
    redis.call('EXPIRE', key, ARGV[at + 4])
  elseif ARGV[at] == 'p' then
    redis.call('XADD', key, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*', 'H', h, 'B', b)
  elseif ARGV[at + 4] ~= '' then
    redis.call('XADD', key, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*', 'h', h, 'b', b, 'for', ARGV[at + 4])
  elseif ARGV[at + 5] ~= '0' then
    owed[#owed + 1] = store_result(key, h, b, ARGV[at + 5])
  else
    redis.call('XADD', key, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*', 'h', h, 'b', b)
  end
end
return owed
"""
)

# KEYS[1]: an API key's result quota (keys.result_quota), in another slot than the results it
# counts. ARGV: the bytes the key may hold (0: no limit of its own), the share of maxmemory (in
# thousandths) from which submissions are refused, and the key's share of that (in thousandths; 0:
# none), read on the quota's node. Checked before SUBMIT_ASYNC, as it checks the quota on one Redis:
# answers 0 while the key holds less, else the ms until some of it is freed (at least 1000),
# SUBMIT_ASYNC's {'limited', 'quota', retry_after_ms}.
QUOTA = (
    QUOTA_LUA
    + PRESSURE_LUA
    + """
local ratio, share = tonumber(ARGV[2]), tonumber(ARGV[3])
local limit = nil
if ratio > 0 and share > 0 then limit = select(2, memory()) end
local bytes, wait = held(KEYS[1], now_ms())
if bytes >= key_limit(tonumber(ARGV[1]), ratio, share, limit) then return math.max(1000, wait) end
return 0
"""
)

# KEYS[1]: an API key's result quota. ARGV: pairs (bytes, ms they are kept) of results stored in
# other slots (what FINISH, DELIVER and SUBMIT_ASYNC answered owed), each charged as one Redis
# charges it when it stores the result.
CHARGE = (
    QUOTA_LUA
    + """
for at = 1, #ARGV, 2 do charge(KEYS[1], tonumber(ARGV[at]), tonumber(ARGV[at + 1])) end
return 1
"""
)

# KEYS[1]: an API key's result quota. ARGV: the bytes of a result dropped early (DROP_RESULT's
# answer on the result's slot) and the ms it had left: freed as one Redis frees them.
UNCHARGE = (
    QUOTA_LUA
    + """
uncharge(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))
return 1
"""
)

# The cancellation of an asynchronous pipeline whose first steps are on several slots, in steps
# (gateway.slots.SlotSteps.cancel): FIRST_STEPS on the result's slot, ASIDE (to look, then to set
# aside) on each other slot, CANCEL on the result's slot, then PUT_BACK on each other slot (to drop
# what was set aside once cancelled, else to queue it again).

# KEYS[1]: the result stream. ARGV[1]: the runner group, ARGV[2]: '1' when some of its other first
# steps may never have been queued (the submission's own cancel, once a slot refused them). Answers
# as CANCEL does once settled ('gone', 'done', 'cancelled'), 'running' while the submission has not
# yet recorded every other first step (`o`, `f`), else {its TTL in ms, {{index, stream, id}, ...},
# 1 when the entry of its own slot is taken (too late: only what an interrupted cancellation set
# aside is to be put back) else 0}: the other first steps as last recorded.
FIRST_STEPS = (
    QUEUED_ENTRIES_LUA
    + SETTLED_LUA
    + """
local state = settled(KEYS[1])
if state then return state end
local taken = 0
for _, item in ipairs(queued_entries(KEYS[1])) do
  if not item[2] then return 'gone' end
  if is_taken(item[1], item[2], ARGV[1]) then taken = 1 end
end
local expected, found, count = 0, {}, 0
for _, item in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
  local fields = item[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'o' then
      expected = tonumber(fields[i + 1])
    elseif fields[i] == 'f' then
      for index, stream, id in string.gmatch(fields[i + 1], '(%S+) (%S+) (%S+)') do
        if not found[index] then count = count + 1 end
        found[index] = {stream, id}
      end
    end
  end
end
if count < expected and ARGV[2] ~= '1' then return 'running' end
local steps = {}
for index, item in pairs(found) do steps[#steps + 1] = {index, item[1], item[2]} end
return {redis.call('PTTL', KEYS[1]), steps, taken}
"""
)

# KEYS: the streams of some of a pipeline's first steps, all in one slot. ARGV[1]: the runner
# group, ARGV[2]: '1' to set them aside, '0' only to look; ARGV[3]: how long in ms what is set aside
# is kept; then each entry's id, in KEYS' order. Answers 'running' when one of them is taken (and
# changes nothing), else 'untaken', and when asked each is moved out of its stream (no runner reads
# it) into `<stream>:aside:<id>`, its fields packed; one found there already (set aside by a cancel
# that stopped midway) stays.
ASIDE = (
    QUEUED_ENTRIES_LUA
    + UNQUEUE_LUA
    + PACKED_LUA
    + """
for i, stream in ipairs(KEYS) do
  local id = ARGV[3 + i]
  if redis.call('EXISTS', stream .. ':aside:' .. id) == 0 and is_taken(stream, id, ARGV[1]) then
    return 'running'
  end
end
if ARGV[2] ~= '1' then return 'untaken' end
for i, stream in ipairs(KEYS) do
  local id = ARGV[3 + i]
  local aside = stream .. ':aside:' .. id
  local fields = redis.call('EXISTS', aside) == 0 and unqueue(stream, id)
  if fields then
    local kept = ''
    for j = 1, #fields do kept = kept .. packed(fields[j]) end
    redis.call('SET', aside, kept, 'PX', ARGV[3])
  end
end
return 'untaken'
"""
)

# KEYS as ASIDE's. ARGV[1]: 'back' to queue again what ASIDE set aside (at the end of its stream),
# 'drop' to forget it (the pipeline is cancelled); then each entry's id, in KEYS' order. Answers each
# entry's new id ('' where nothing was set aside, or it was dropped).
PUT_BACK = (
    PACKED_LUA
    + UNQUEUE_LUA
    + """
local ids = {}
for i, stream in ipairs(KEYS) do
  local aside = stream .. ':aside:' .. ARGV[1 + i]
  local kept = redis.call('GET', aside)
  ids[i] = ''
  if kept and ARGV[1] == 'back' then
    local fields = unpacked(kept)
    ids[i] = redis.call('XADD', stream, '*', unpack(fields))
    redis.call('INCRBY', stream .. ':bytes', entry_bytes(fields))
  end
  redis.call('DEL', aside)
end
return ids
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
    """One DELIVER per slot. The replies to one gateway's stream that need nothing but delivery
    (not an identical invocation's, not kept as a result) travel packed in one entry, as FINISH
    packs them on one Redis: one XADD, and one entry for the gateway to read, per gateway."""
    plain: dict[str, list[Delivery]] = {}
    for item in deliveries:
        if not (item.is_cached or item.answers or item.ttl_ms):
            plain.setdefault(item.key, []).append(item)
    packed = {key: items for key, items in plain.items() if len(items) > 1}
    by_slot: dict[int, tuple[dict[str, int], list[bytes | str | int | float]]] = {}
    for item in deliveries:
        if item.key in packed and not (item.is_cached or item.answers or item.ttl_ms):
            continue
        named, args = by_slot.setdefault(keys.slot(item.key), ({}, [reply_maxlen]))
        index = named.setdefault(item.key, len(named) + 1)
        fields = (item.fields[HEADER], item.fields.get(BODY, b""))
        if item.cache_ttl_s:
            args += ["c", index, *fields, item.cache_ttl_s, ""]
        else:
            args += ["r", index, *fields, item.answers, item.ttl_ms]
    for key, items in packed.items():
        named, args = by_slot.setdefault(keys.slot(key), ({}, [reply_maxlen]))
        headers = b"[" + b",".join(item.fields[HEADER] for item in items) + b"]"
        bodies = b"".join(item.fields.get(BODY, b"") for item in items)
        args += ["p", named.setdefault(key, len(named) + 1), headers, bodies, "", ""]
    return [ScriptCall(list(named), args) for named, args in by_slot.values()]


def parse_owed(raw: Any) -> list[Charge]:
    """What FINISH's answer says the results it stored owe quotas in other slots."""
    if isinstance(raw, list) and raw and raw[0] == b"charge":
        return parse_charges(raw[1])
    return []


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


def quota_call(quota: ResultQuota, memory_ratio: float = ASYNC_MEMORY_RATIO) -> ScriptCall:
    """QUOTA's arguments."""
    return ScriptCall(
        [quota.key], [quota.max_bytes, round(memory_ratio * 1000), round(quota.memory_share * 1000)]
    )


def charge_calls(charges: Sequence[Charge]) -> list[ScriptCall]:
    """One CHARGE per quota."""
    by_quota: dict[str, list[bytes | str | int | float]] = {}
    for item in charges:
        by_quota.setdefault(item.quota, []).extend([item.size, max(item.ttl_ms, 1)])
    return [ScriptCall([quota], args) for quota, args in by_quota.items()]


@dataclasses.dataclass(frozen=True, slots=True)
class FirstStep:
    """One of an asynchronous pipeline's first steps queued on another slot than its result."""

    index: int
    """Its place among the submission's other first steps (Entries.rest)."""
    stream: str
    entry: str
    """Its entry's id."""


def record(steps: Sequence[FirstStep]) -> str:
    """The result stream's record of first steps (`f`: index, stream and id, space-separated)."""
    return " ".join(f"{step.index} {step.stream} {step.entry}" for step in steps)


@dataclasses.dataclass(frozen=True, slots=True)
class FirstSteps:
    """FIRST_STEPS' answer where it did not decide."""

    ttl_ms: int
    """The result's: how long what is set aside is kept."""
    others: list[FirstStep]
    """The first steps of other slots, as last recorded."""
    taken: bool
    """The entry in the result's slot is taken: too late to cancel."""


def parse_first_steps(raw: Any) -> str | FirstSteps:
    """FIRST_STEPS' answer: CANCEL's outcome where it decided, else FirstSteps."""
    if not isinstance(raw, list):
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    found = [FirstStep(int(index), text(stream), text(entry)) for index, stream, entry in raw[1]]
    return FirstSteps(int(raw[0]), sorted(found, key=lambda step: step.index), bool(raw[2]))


def by_slot(steps: Sequence[FirstStep]) -> list[list[FirstStep]]:
    """The steps grouped by the slot of their streams, for one ASIDE or PUT_BACK each."""
    grouped: dict[int, list[FirstStep]] = {}
    for step in steps:
        grouped.setdefault(keys.slot(step.stream), []).append(step)
    return list(grouped.values())


def aside_call(steps: Sequence[FirstStep], group: str, set_aside: bool, ttl_ms: int) -> ScriptCall:
    """ASIDE's arguments for steps of one slot: to look whether one is taken, or to set them aside."""
    return ScriptCall(
        [step.stream for step in steps],
        [group, "1" if set_aside else "0", max(ttl_ms, 1), *(step.entry for step in steps)],
    )


def put_back_call(steps: Sequence[FirstStep], back: bool) -> ScriptCall:
    """PUT_BACK's arguments for steps of one slot: queued again (`back`), or forgotten."""
    mode = "back" if back else "drop"
    return ScriptCall([step.stream for step in steps], [mode, *(step.entry for step in steps)])
