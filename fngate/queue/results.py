"""Asynchronous invocations: submission, the result stream any gateway reads, and cancellation."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from fngate import keys
from fngate.queue.invocations import (
    ADMIT_LUA,
    BODY,
    GIVEN_LUA,
    HEADER,
    NO_ADMISSION,
    PUSH_LUA,
    UNQUEUE_LUA,
    Admission,
    Forward,
    Full,
    Limited,
    Queued,
    ScriptCall,
    Waiter,
    extra_count,
    forward_args,
    parse_enqueue,
    queue_bytes,
    waiters,
)
from fngate.queue.stored import PACKED_LUA, QUOTA_LUA, STORE_RESULT_LUA, Charge, parse_charges

# --- Asynchronous invocations -------------------------------------------------------------------
# An asynchronous invocation waits in its function's stream of priority level keys.ASYNC and
# replies to a result stream of its own (keys.result), created here at submission with a TTL of
# the invocation's deadline plus result_ttl_s; any gateway reads it. The result stream's first
# entry holds the state `queued`, the queue entry (stream `q`, id `e`), the gateway's own record
# (`m`, JSON) and the submitting key's result quota (`k`, a hash; '' for none); on a Redis Cluster,
# where the quota is in another slot, it is `kc` instead (checked and charged in steps of their own,
# fngate.queue.slots), and a pipeline's first steps queued on other slots after the script are
# counted (`o`) and recorded in later entries (`f`: their index, stream and id, space-separated;
# the last record of an index holds). A cancellation adds `s` = `cancelled`. An invocation with a
# callback URL names the callbacks stream as the one waiter on a marker of its own, so that
# FINISH's 'share' copies its reply there, addressed `for` it, exactly as it answers coalesced
# invocations.
# Once done, the result is kept compactly (fngate.queue.stored): FINISH packs the record and the
# reply into one string (callback attempts are appended) for result_ttl_s, charges its bytes to the
# key's quota, and adds `s` = `done` to the stream, which wakes long-polls and expires BELL_MS later.
STATE, QUEUE_STREAM, QUEUE_ENTRY, RECORD, CALLBACK, QUOTA = b"s", b"q", b"e", b"m", b"cb", b"k"
QUEUED, CANCELLED = b"queued", b"cancelled"
ASYNC_MEMORY_RATIO = 0.8
"""From this share of Redis's maxmemory on, asynchronous submissions are refused (503): what they
would keep must not crowd out what the queue needs (noeviction: past maxmemory writes fail)."""

# memory() -> used, maxmemory (nil where INFO does not say; 0: none set).
# pressure(ratio, used, limit) -> nil | {used, maxmemory}: Redis's memory past `ratio` (in
# thousandths) of its maxmemory (none set: never).
# key_limit(max_bytes, ratio, share, limit) -> the bytes one key's results may hold: the smaller of
# `max_bytes` (0: no limit of its own, math.huge) and `share` (in thousandths) of the memory from
# which submissions are refused (`ratio` of maxmemory `limit`; no maxmemory: no share).
PRESSURE_LUA = """
local function memory()
  local info = redis.call('INFO', 'memory')
  return tonumber(string.match(info, 'used_memory:(%d+)')), tonumber(string.match(info, 'maxmemory:(%d+)'))
end
local function pressure(ratio, used, limit)
  if ratio <= 0 then return nil end
  if used and limit and limit > 0 and used * 1000 >= limit * ratio then return {used, limit} end
  return nil
end
local function key_limit(max_bytes, ratio, share, limit)
  local bytes = max_bytes > 0 and max_bytes or math.huge
  if ratio <= 0 or share <= 0 or not limit or limit <= 0 then return bytes end
  return math.min(bytes, math.floor(limit * ratio / 1000 * share / 1000))
end
"""

# KEYS: the level's stream, its byte counter, the result stream, the idempotency key ('' for none),
# the callback marker's waiters list ('' for no callback), then admit()'s keys (bucket, busy,
# share; '' for a caller without limits), then the cache entry to answer from ('' for none), then
# the key's result quota ('' for none).
# ARGV: max queue size, max queue bytes (0: no limit), header, body, the record, the result TTL in
# ms while pending, the invocation id, the callback waiter, the request's digest, admit()'s six
# arguments, then the result TTL in ms once done, and a cached reply's header and body that the
# caller found itself (a cache Redis of its own; '' for none), the first entry's step context, the
# quota's bytes, the share of maxmemory (in thousandths, 0: off) from which submissions are refused
# ({'pressure', used, maxmemory}), the key's quota in another slot ('' for none: a Redis Cluster's,
# which the caller checked, and whoever stores the result charges), and the number of first steps
# the caller queues on other slots after this script (a Redis Cluster's; 0 for none), and the share
# (in thousandths) of the memory from which submissions are refused that one key's results may hold
# (0: none, the quota's bytes alone); a key that holds its quota (the smaller of the two) is
# refused {'limited', 'quota', retry_after_ms}, before anything is queued. The
# idempotency key holds the first invocation's id and its request's digest: a repeat answers that
# id while its result is kept ('again'), or 'conflict' when the request differs; once the result
# expired the key is free again.
# The result stream is named by the invocation id (keys.result), so the first one's name follows.
# A cached answer is the result at once ('hit', and what it owes a quota in another slot: {'hit',
# quota, bytes, ttl_ms}): nothing is queued, and a callback gets it as from FINISH.
# An asynchronous pipeline (fngate.plan) queues its first steps: ARGV[19] is the first entry's step
# context (STEP; '' for a function's own invocation), and each further first step adds its stream
# and byte counter to KEYS after the tenth (all streams, then all counters) and a group of
# FORWARD's five arguments to ARGV after the twenty-fourth. All are queued or none ({'full', limit,
# index of the entry refused}); the result stream's first entry names them all, space-separated
# (`q`, `e`), for READ_RESULT and CANCEL. Queued, it answers {'queued', the first entry's id, the
# length of its stream} (admission by deadline counts what waits from it).
SUBMIT_ASYNC = (
    GIVEN_LUA
    + ADMIT_LUA
    + PUSH_LUA
    + STORE_RESULT_LUA
    + PRESSURE_LUA
    + keys.RESULT_KEY_LUA
    + """
if given(KEYS[4]) then
  local first = redis.call('GET', KEYS[4])
  local id, digest = string.match(first or '', '^(%S+) (%S*)$')
  local earlier = result_key(id or '')
  if id and redis.call('EXISTS', earlier, earlier .. ':done') > 0 then
    if digest ~= ARGV[9] then return {'conflict', id} end
    return {'again', id}
  end
end
local ratio = tonumber(ARGV[21])
local used, limit = nil, nil
if ratio > 0 then used, limit = memory() end
local tight = pressure(ratio, used, limit)
if tight then return {'pressure', tight[1], tight[2]} end
local quota = given(KEYS[10]) and KEYS[10] or ''
if quota ~= '' then
  local bytes, wait = held(quota, now_ms())
  if bytes >= key_limit(tonumber(ARGV[20]), ratio, tonumber(ARGV[24]), limit) then
    return {'limited', 'quota', math.max(1000, wait)}
  end
end
if given(KEYS[6]) then
  local verdict = admit(KEYS[6], KEYS[7], KEYS[8], tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12]),
    tonumber(ARGV[13]), ARGV[14], tonumber(ARGV[15]))
  if verdict[1] ~= 'ok' then return {'limited', verdict[1], verdict[2]} end
end
local hit_h, hit_b = ARGV[17], ARGV[18]
if hit_h == '' and given(KEYS[9]) then
  local hit = redis.call('HMGET', KEYS[9], 'h', 'b')
  hit_h, hit_b = hit[1] or '', hit[2] or ''
end
local kept = {'m', ARGV[5], 'k', quota}
if ARGV[22] ~= '' then
  kept[#kept + 1] = 'kc'
  kept[#kept + 1] = ARGV[22]
end
if hit_h ~= '' then
  redis.call('XADD', KEYS[3], '*', 's', 'queued', unpack(kept))
  local owed = store_result(KEYS[3], hit_h, hit_b, ARGV[16])
  if given(KEYS[4]) then redis.call('SET', KEYS[4], ARGV[7] .. ' ' .. ARGV[9], 'PX', ARGV[16]) end
  local callbacks, id = string.match(ARGV[8], '^(%S+) (%S+)')
  if callbacks then
    redis.call('XADD', callbacks, 'NOMKSTREAM', '*', 'h', hit_h, 'b', hit_b, 'for', id)
  end
  if owed then return {'hit', owed[1], owed[2], owed[3]} end
  return {'hit'}
end
local limit = full(KEYS[1], KEYS[2], ARGV[1], ARGV[2])
if limit then return {'full', limit, 0} end
local more = (#KEYS - 11) / 2  -- the last key: KEYS[1]'s EXTRA counter, declared for full()
for i = 1, more do
  local at = 25 + (i - 1) * 5
  limit = full(KEYS[10 + i], KEYS[10 + more + i], ARGV[at], ARGV[at + 1])
  if limit then return {'full', limit, i} end
end
local entry = push(KEYS[1], KEYS[2], ARGV[3], ARGV[4], ARGV[19])
local streams, entries = KEYS[1], entry
for i = 1, more do
  local at = 25 + (i - 1) * 5
  local stream = KEYS[10 + i]
  streams = streams .. ' ' .. stream
  entries = entries .. ' ' .. push(stream, KEYS[10 + more + i], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4])
end
if tonumber(ARGV[23]) > 0 then
  kept[#kept + 1] = 'o'
  kept[#kept + 1] = ARGV[23]
end
redis.call('XADD', KEYS[3], '*', 's', 'queued', 'q', streams, 'e', entries, unpack(kept))
redis.call('PEXPIRE', KEYS[3], ARGV[6])
if given(KEYS[4]) then redis.call('SET', KEYS[4], ARGV[7] .. ' ' .. ARGV[9], 'PX', ARGV[6]) end
if given(KEYS[5]) then
  redis.call('RPUSH', KEYS[5], ARGV[8])
  redis.call('PEXPIRE', KEYS[5], ARGV[6])
end
return {'queued', entry, redis.call('XLEN', KEYS[1])}
"""
)

# Both scripts below read the queue entries that the result stream's first entry names (`q`, `e`;
# several, space-separated, for a pipeline's first steps) and ask whether a runner holds them.
QUEUED_ENTRIES_LUA = """
local function queued_entries(result)
  local first = redis.call('XRANGE', result, '-', '+', 'COUNT', 1)
  local found = {}
  if #first == 0 then return found end
  local fields = first[1][2]
  local streams, ids = '', ''
  for i = 1, #fields, 2 do
    if fields[i] == 'q' then streams = fields[i + 1] elseif fields[i] == 'e' then ids = fields[i + 1] end
  end
  for stream in string.gmatch(streams, '%S+') do found[#found + 1] = {stream} end
  local i = 1
  for id in string.gmatch(ids, '%S+') do
    if found[i] then found[i][2] = id end
    i = i + 1
  end
  return found
end

local function is_taken(stream, id, group)
  local pending = redis.pcall('XPENDING', stream, group, id, id, 1)
  if type(pending) == 'table' and #pending > 0 then return true end
  return #redis.call('XRANGE', stream, id, id) == 0
end
"""
"""is_taken: a runner holds the entry, or it left its stream (a pipeline step that finished: the
next steps' entries carry the invocation on; a function's entry leaves with its reply)."""

# KEYS[1]: the result stream. ARGV[1]: the runner group. Its entries, and whether a runner took
# one of its queue entries (running): one round trip for a GET. A done result (fngate.queue.stored)
# is answered as the entries its stream would hold: the record, the reply, each callback attempt.
READ_RESULT = (
    QUEUED_ENTRIES_LUA
    + PACKED_LUA
    + """
local stored = redis.call('GET', KEYS[1] .. ':done')
if stored then
  local parts = unpacked(stored)
  local entries = {{'0-1', {'m', parts[1]}}, {'0-2', {'h', parts[2], 'b', parts[3]}}}
  for i = 4, #parts do entries[#entries + 1] = {'0-' .. i, {'cb', parts[i]}} end
  return {entries, 0}
end
local entries = redis.call('XRANGE', KEYS[1], '-', '+')
if #entries == 0 then return {{}, 0} end
for _, item in ipairs(entries) do  -- done, and its stored result already expired: gone
  if item[2][1] == 's' and item[2][2] == 'done' then return {{}, 0} end
end
local running = 0
for _, item in ipairs(queued_entries(KEYS[1])) do
  if item[2] and is_taken(item[1], item[2], ARGV[1]) then running = 1 end
end
return {entries, running}
"""
)

# settled(result) -> 'gone' (no such result), 'done' (it has a reply), 'cancelled', or nil while
# it may still be cancelled.
SETTLED_LUA = """
local function settled(result)
  if redis.call('EXISTS', result .. ':done') == 1 then return 'done' end
  local entries = redis.call('XRANGE', result, '-', '+')
  if #entries == 0 then return 'gone' end
  for _, item in ipairs(entries) do
    local fields = item[2]
    for i = 1, #fields, 2 do
      local name = fields[i]
      if name == 'h' then return 'done' end
      if name == 's' and fields[i + 1] == 'cancelled' then return 'cancelled' end
    end
  end
  return nil
end
"""

# KEYS[1]: the result stream. ARGV[1]: the runner group. Cancels an invocation no runner has taken:
# its queue entry is deleted (so no runner ever reads it) and `cancelled` is recorded. Answers
# 'gone' (no such result), 'done' (it has a reply), 'cancelled' (now or before) or 'running'.
# A pipeline is cancelled only while none of its first steps was taken: then all their entries go.
# (On a Redis Cluster, the first entry names only the entries of its own slot: gateway.slots sets
# the others aside first, and this cancels the pipeline once they are.)
CANCEL = (
    QUEUED_ENTRIES_LUA
    + SETTLED_LUA
    + UNQUEUE_LUA
    + """
local state = settled(KEYS[1])
if state then return state end
local queued = queued_entries(KEYS[1])
if #queued == 0 then return 'gone' end
for _, item in ipairs(queued) do
  if not item[2] then return 'gone' end
  if is_taken(item[1], item[2], ARGV[1]) then return 'running' end
end
for _, item in ipairs(queued) do unqueue(item[1], item[2]) end
redis.call('XADD', KEYS[1], '*', 's', 'cancelled')
return 'cancelled'
"""
)


# KEYS[1]: the result stream. ARGV[1]: a callback attempt (JSON), recorded with the result it sent
# (appended to the stored result), or on the stream before that.
RECORD_CALLBACK = (
    PACKED_LUA
    + """
local stored = KEYS[1] .. ':done'
if redis.call('EXISTS', stored) == 1 then
  redis.call('APPEND', stored, packed(ARGV[1]))
  return 1
end
redis.call('XADD', KEYS[1], 'NOMKSTREAM', '*', 'cb', ARGV[1])
return 0
"""
)


# KEYS[1]: the result stream, KEYS[2]: its key's result quota ('' for none, or for one in another
# slot). Drops a result that is no longer pending, early: its stream and the result kept beside it,
# whose bytes are freed from the quota. Answers {bytes, ms it had left} for a quota in another slot
# to free (fngate.queue.slots.UNCHARGE), or {} (nothing was stored, or its quota was given).
DROP_RESULT = (
    GIVEN_LUA
    + QUOTA_LUA
    + PACKED_LUA
    + """
local stored = KEYS[1] .. ':done'
local value = redis.call('GET', stored)
local owed = {}
if value then
  local parts = unpacked(value)
  local size = #(parts[1] or '') + #(parts[2] or '') + #(parts[3] or '')
  local left = redis.call('PTTL', stored)
  redis.call('DEL', stored)
  if left > 0 then
    if given(KEYS[2]) then uncharge(KEYS[2], size, left) else owed = {size, left} end
  end
end
redis.call('DEL', KEYS[1])
return owed
"""
)


def callback_marker(result_stream: str) -> str:
    """The in-flight marker of an asynchronous invocation with a callback URL: its waiters list
    names the callbacks stream, so that FINISH copies the reply there (see SUBMIT_ASYNC)."""
    return f"{result_stream}:cb"


def submit_async_call(
    stream: str,
    fields: Mapping[bytes, bytes],
    result_stream: str,
    record: bytes,
    ttl_ms: int,
    invocation_id: str,
    max_queue_size: int,
    max_queue_bytes: int = 0,
    idempotency_key: str = "",
    callbacks: str = "",
    admission: Admission | None = None,
    request_digest: str = "",
    done_ttl_ms: int = 0,
    lookup: str = "",
    cached: Mapping[bytes, bytes] | None = None,
    step: bytes = b"",
    more: Sequence[Forward] = (),
    quota: ResultQuota | None = None,
    memory_ratio: float = ASYNC_MEMORY_RATIO,
    quota_elsewhere: str = "",
    others: int = 0,
) -> ScriptCall:
    """SUBMIT_ASYNC's arguments. `ttl_ms`: how long the result stream (and the idempotency key)
    live while pending, `done_ttl_ms` once done; `callbacks`: the callbacks stream when the
    invocation has a callback URL, else ''; `request_digest`: what a repeat of `idempotency_key`
    must match (no spaces); `lookup`: the cache entry to answer from ('' for none), or `cached`:
    the cached reply's fields the caller already found. For a pipeline, `step` is the first
    entry's step context and `more` the entries of its other first steps. `quota`: the result
    bytes the submitting key may hold (None: no limit, nor charge); `memory_ratio`: the share of Redis's
    maxmemory from which submissions are refused (0: never). On a Redis Cluster, `quota_elsewhere`
    names the key's quota that the caller checked and whoever stores the result charges, and
    `others` counts the pipeline's first steps the caller queues on other slots afterwards."""
    if result_stream != keys.result(invocation_id) or " " in request_digest:
        raise ValueError("the result stream is named by its invocation id; a digest has no spaces")
    admit = admission or NO_ADMISSION
    waiter = Waiter(callbacks, invocation_id, 0).encode() if callbacks else ""
    return ScriptCall(
        keys=[
            stream,
            queue_bytes(stream),
            result_stream,
            idempotency_key,
            waiters(callback_marker(result_stream)) if callbacks else "",
            *admit.keys,
            lookup,
            quota.key if quota else "",
            *(item.stream for item in more),
            *(queue_bytes(item.stream) for item in more),
            extra_count(stream),
        ],
        args=[
            max_queue_size,
            max_queue_bytes,
            fields[HEADER],
            fields[BODY],
            record,
            max(ttl_ms, 1),
            invocation_id,
            waiter,
            request_digest,
            *admit.args,
            max(done_ttl_ms, 1),
            cached[HEADER] if cached else "",
            cached.get(BODY, b"") if cached else "",
            step,
            quota.max_bytes if quota else 0,
            round(memory_ratio * 1000),
            quota_elsewhere,
            others,
            round(quota.memory_share * 1000) if quota else 0,
            *forward_args(more),
        ],
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ResultQuota:
    """What one API key's asynchronous results may hold in Redis, in bytes (records and replies):
    the smaller of `max_bytes` and `memory_share` of the memory from which asynchronous submissions
    are refused (ASYNC_MEMORY_RATIO of maxmemory), so that no key's results lock the others out."""

    key: str
    """The quota's hash (keys.result_quota)."""
    max_bytes: int
    """0: no limit of its own (the share alone)."""
    memory_share: float = 0.0
    """0: no share (max_bytes alone)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Pressure:
    """Redis is past ASYNC_MEMORY_RATIO of its maxmemory: no asynchronous submission now."""

    used_bytes: int
    max_bytes: int

    def describe(self) -> str:
        return (
            f"the queue's Redis holds {self.used_bytes / 2**20:.0f} MiB of its maxmemory of "
            f"{self.max_bytes / 2**20:.0f} MiB: asynchronous invocations are refused until results "
            "expire or are collected; synchronous ones are served"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Again:
    """An earlier submission with the same idempotency key: this is its invocation."""

    invocation_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class Conflict:
    """The idempotency key was used by an earlier submission of another request."""

    invocation_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """Answered from the response cache: the result is there already."""

    charge: Charge | None = None
    """What its stored result owes its key's quota in another slot (a Redis Cluster's)."""


SubmitOutcome = Queued | Done | Again | Conflict | Full | Limited | Pressure


def parse_submit_async(raw: Sequence[Any]) -> SubmitOutcome:
    """SUBMIT_ASYNC's answer: ENQUEUE's outcomes (but a wait; Limited('quota') for a key that holds
    its result quota), Done for a cache hit, Again, Conflict or Pressure."""
    if raw[0] == b"pressure":
        return Pressure(int(raw[1]), int(raw[2]))
    if raw[0] == b"again":
        return Again(raw[1].decode())
    if raw[0] == b"conflict":
        return Conflict(raw[1].decode())
    if raw[0] == b"hit":
        return Done(parse_charges([raw[1:]])[0] if len(raw) > 1 else None)
    outcome = parse_enqueue(raw)
    if isinstance(outcome, Queued | Full | Limited):
        return outcome
    raise ValueError(f"unknown submit outcome {raw[0]!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """What a result stream says of its asynchronous invocation."""

    record: bytes
    """The gateway's record of the submission (JSON)."""
    running: bool
    reply: dict[bytes, bytes] | None = None
    """The reply's entry fields once it came."""
    cancelled: bool = False
    callbacks: tuple[bytes, ...] = ()
    """Each callback attempt's JSON, in order."""
    last_id: bytes = b"0-0"
    """The stream's last entry: a long-poll waits for one after it."""

    @property
    def state(self) -> str:
        if self.reply is not None:
            return "done"
        if self.cancelled:
            return "cancelled"
        return "running" if self.running else "queued"


def parse_result(raw: Sequence[Any]) -> Result | None:
    """READ_RESULT's answer; None when the result stream does not exist (unknown or expired)."""
    entries, running = raw[0], raw[1]
    if not entries:
        return None
    record = b""
    reply = None
    cancelled = False
    attempts = []
    for _entry_id, flat in entries:
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        if RECORD in fields and not record:
            record = fields[RECORD]
        if HEADER in fields and reply is None:
            reply = {HEADER: fields[HEADER], BODY: fields.get(BODY, b"")}
        if fields.get(STATE) == CANCELLED:
            cancelled = True
        if CALLBACK in fields:
            attempts.append(fields[CALLBACK])
    return Result(record, bool(running), reply, cancelled, tuple(attempts), entries[-1][0])


def cancel_outcome(raw: bytes | str) -> str:
    """CANCEL's answer: 'gone', 'done', 'cancelled' or 'running'."""
    return raw.decode() if isinstance(raw, bytes) else raw
