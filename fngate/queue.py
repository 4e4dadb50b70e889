"""The queue protocol between gateways and runners: entry field names, the waiter format, the enqueue
and finish scripts, and pure builders of their arguments and parsers of their outcomes.

Gateway and runner only call these; what a stream entry or a script argument looks like is decided
here alone. Pipelines and asynchronous invocations extend this contract, not their callers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

HEADER = b"h"
"""An entry's JSON header (fngate.wire)."""
BODY = b"b"
"""An entry's tensors, back to back (fngate.wire)."""
FOR = b"for"
"""On a reply: the id of the invocation it answers when that is not the reply's own (a waiter)."""
STEP = b"p"
"""On an invocation entry that is a pipeline step: its context (fngate.pipeline.StepContext)."""
AS, TO, BY = b"as", b"to", b"by"
"""On an invocation entry: a waiter promoted to run in place of an identical invocation that expired
runs under its own id (`as`), reply stream (`to`) and deadline in ms (`by`)."""

# admit(bucket, busy, share, rps, burst, cap, share_cap, member, ttl_ms)
#   -> {'ok'} | {'busy'|'share'|'rate', retry_after_ms}
# A token bucket (`burst` tokens, `rps` per second, Redis time) and two sorted sets of the key's
# invocations with their expiry: all of them (`busy`, at most `cap`) and those of one function
# (`share`, at most `share_cap`). A dead gateway's members lapse at their expiry. Limits of 0 are
# off; a refused invocation takes neither a token nor a place.
ADMIT_LUA = """
local function admit(bucket, busy, share, rps, burst, cap, share_cap, member, ttl_ms)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local sets = {{busy, cap, 'busy'}, {share, share_cap, 'share'}}
  for _, set in ipairs(sets) do
    if set[2] > 0 then
      redis.call('ZREMRANGEBYSCORE', set[1], '-inf', now)
      if redis.call('ZCARD', set[1]) >= set[2] then
        local first = redis.call('ZRANGE', set[1], 0, 0, 'WITHSCORES')
        return {set[3], math.max(1, math.min(1000, tonumber(first[2]) - now))}
      end
    end
  end
  if rps > 0 then
    local state = redis.call('HMGET', bucket, 't', 'ms')
    local tokens = tonumber(state[1]) or burst
    local last = tonumber(state[2]) or now
    tokens = math.min(burst, tokens + math.max(0, now - last) * rps / 1000)
    if tokens < 1 then
      return {'rate', math.ceil((1 - tokens) * 1000 / rps)}
    end
    redis.call('HSET', bucket, 't', tostring(tokens - 1), 'ms', now)
    redis.call('PEXPIRE', bucket, math.ceil(burst * 1000 / rps) + 1000)
  end
  for _, set in ipairs(sets) do
    if set[2] > 0 then
      redis.call('ZADD', set[1], now + ttl_ms, member)
      redis.call('PEXPIRE', set[1], ttl_ms)
    end
  end
  return {'ok'}
end
"""

# One round trip for the whole decision. KEYS: the stream, its byte counter, the cache entry ('' to
# skip the lookup), the in-flight marker and its waiters list ('' for no coalescing), then the
# caller's admission keys (bucket, busy, share; '' for a caller without limits). ARGV: max queue
# size, max queue bytes (0: no limit), header, body, this invocation as a waiter, marker TTL in ms,
# then admit()'s rps, burst, cap, share_cap, member and ttl_ms. Entries leave the stream when a
# runner acknowledges them, so XLEN counts queued or in flight.
ENQUEUE = (
    ADMIT_LUA
    + """
if KEYS[6] ~= '' then
  local verdict = admit(KEYS[6], KEYS[7], KEYS[8], tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]),
    tonumber(ARGV[10]), ARGV[11], tonumber(ARGV[12]))
  if verdict[1] ~= 'ok' then return {'limited', verdict[1], verdict[2]} end
end
if KEYS[3] ~= '' then
  local hit = redis.call('HMGET', KEYS[3], 'h', 'b')
  if hit[1] then return {'hit', hit[1], hit[2]} end
end
if KEYS[4] ~= '' then
  if not redis.call('SET', KEYS[4], '1', 'NX', 'PX', ARGV[6]) then
    redis.call('RPUSH', KEYS[5], ARGV[5])
    redis.call('PEXPIRE', KEYS[5], ARGV[6])
    return {'wait'}
  end
end
local full = nil
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  full = 'count'
elseif tonumber(ARGV[2]) > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= tonumber(ARGV[2]) then
  full = 'bytes'
end
if full then
  if KEYS[4] ~= '' then redis.call('DEL', KEYS[4]) end
  if KEYS[6] ~= '' then  -- refused: it holds no place in the caller's limits
    redis.call('ZREM', KEYS[7], ARGV[11])
    redis.call('ZREM', KEYS[8], ARGV[11])
  end
  return {'full', full}
end
if ARGV[13] then  -- a pipeline step (STEP)
  redis.call('XADD', KEYS[1], '*', 'h', ARGV[3], 'b', ARGV[4], 'p', ARGV[13])
  redis.call('INCRBY', KEYS[2], #ARGV[3] + #ARGV[4] + #ARGV[13])
  return {'queued'}
end
redis.call('XADD', KEYS[1], '*', 'h', ARGV[3], 'b', ARGV[4])
redis.call('INCRBY', KEYS[2], #ARGV[3] + #ARGV[4])
return {'queued'}
"""
)

FINISH_ITEM = 11
"""Arguments per reply in FINISH."""

# KEYS[1]: the invocation stream, KEYS[2]: its byte counter, KEYS[3..]: reply streams.
# ARGV: group, reply maxlen, bytes acknowledged, the number of replies n, the statistics hash ('' for
# none), the time of the batch's end in ms for it, the number m of its counters, m pairs (field,
# amount) to add, then n groups of
# FINISH_ITEM (index into KEYS, header, body, cache entry or '', its TTL in s, in-flight marker or
# '', its waiters list, what to do with the waiters: 'share' the reply, 'drop' them, or 'promote'
# the first to run in place of this one, and for 'promote' the invocation's own header and body,
# and how long in ms to keep the reply stream from now on (0: leave its TTL as it is; an
# asynchronous result is kept result_ttl_s after it is done)), then the entry ids to acknowledge
# and delete. Replies go only to reply streams that exist (NOMKSTREAM): a gateway that stopped took
# its stream with it. One command per batch.
FINISH = """
local n = tonumber(ARGV[4])
local maxlen = ARGV[2]
local m = tonumber(ARGV[7])
if ARGV[5] ~= '' then
  for j = 0, m - 1 do redis.call('HINCRBY', ARGV[5], ARGV[8 + j * 2], ARGV[9 + j * 2]) end
  redis.call('HSET', ARGV[5], 'last_inference', ARGV[6])
end
local first = 8 + m * 2
for i = 0, n - 1 do
  local at = first + i * 11
  local h, b = ARGV[at + 1], ARGV[at + 2]
  local reply_to = KEYS[tonumber(ARGV[at])]
  redis.call('XADD', reply_to, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*', 'h', h, 'b', b)
  if ARGV[at + 10] ~= '0' then redis.call('PEXPIRE', reply_to, ARGV[at + 10]) end
  if ARGV[at + 3] ~= '' then
    redis.call('HSET', ARGV[at + 3], 'h', h, 'b', b)
    redis.call('EXPIRE', ARGV[at + 3], ARGV[at + 4])
  end
  local marker, waiters, mode = ARGV[at + 5], ARGV[at + 6], ARGV[at + 7]
  if marker ~= '' then
    local promoted = false
    if mode == 'share' then
      for _, waiter in ipairs(redis.call('LRANGE', waiters, 0, -1)) do
        local stream, id = string.match(waiter, '^(%S+) (%S+)')
        redis.call('XADD', stream, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*', 'h', h, 'b', b, 'for', id)
      end
    elseif mode == 'promote' then
      local now = redis.call('TIME')
      local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
      local waiter = redis.call('LPOP', waiters)
      while waiter do
        local stream, id, by = string.match(waiter, '^(%S+) (%S+) (%d+)$')
        if by and tonumber(by) > now_ms then
          local ih, ib = ARGV[at + 8], ARGV[at + 9]
          redis.call('XADD', KEYS[1], '*', 'h', ih, 'b', ib, 'as', id, 'to', stream, 'by', by)
          redis.call('INCRBY', KEYS[2], #ih + #ib)
          redis.call('PEXPIRE', marker, tonumber(by) - now_ms)
          promoted = true
          break
        end
        waiter = redis.call('LPOP', waiters)
      end
    end
    if not promoted then redis.call('DEL', marker, waiters) end
  end
end
local ids = {}
for i = first + n * 11, #ARGV do ids[#ids + 1] = ARGV[i] end
if #ids > 0 then
  redis.pcall('XACK', KEYS[1], ARGV[1], unpack(ids))
  redis.call('XDEL', KEYS[1], unpack(ids))
  if redis.call('XLEN', KEYS[1]) == 0 then
    redis.call('DEL', KEYS[2])
  else
    redis.call('DECRBY', KEYS[2], ARGV[3])
  end
end
return n
"""


@dataclasses.dataclass(frozen=True, slots=True)
class ScriptCall:
    """The KEYS and ARGV of one script call."""

    keys: list[str]
    args: list[bytes | str | int | float]


@dataclasses.dataclass(frozen=True, slots=True)
class Waiter:
    """An invocation waiting on an identical one in flight: where its answer goes, and until when."""

    stream: str
    id: str
    deadline_ms: int

    def encode(self) -> str:
        return f"{self.stream} {self.id} {self.deadline_ms}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Waiter:
        text = raw.decode() if isinstance(raw, bytes) else raw
        stream, invocation_id, deadline = text.split(" ")
        return cls(stream, invocation_id, int(deadline))


def waiters(in_flight_key: str) -> str:
    """The list of Waiters of an in-flight invocation."""
    return f"{in_flight_key}:w"


def queue_bytes(stream: str) -> str:
    """The byte counter of an invocation stream: what its entries hold, for max_queue_bytes."""
    return f"{stream}:bytes"


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """admit()'s KEYS (bucket, busy, share) and ARGV (rps, burst, cap, share_cap, member, ttl_ms)
    for a caller with limits (gateway.limits builds it)."""

    keys: tuple[str, str, str]
    args: tuple[float, int, int, int, str, int]


NO_ADMISSION = Admission(("", "", ""), (0, 0, 0, 0, "", 0))


def enqueue_call(
    stream: str,
    fields: Mapping[bytes, bytes],
    waiter: Waiter,
    ttl_ms: int,
    max_queue_size: int,
    max_queue_bytes: int = 0,
    lookup: str = "",
    in_flight: str = "",
    admission: Admission | None = None,
    step: bytes | None = None,
) -> ScriptCall:
    """ENQUEUE's arguments. `lookup`: the cache entry to answer from ('' for none); `in_flight`: the
    marker that makes identical invocations wait on this one ('' for no coalescing); `admission`:
    the caller's limits, checked first in the same round trip (None: a caller without limits);
    `step`: a pipeline step's context (STEP), None for an invocation of its own."""
    admit = admission or NO_ADMISSION
    return ScriptCall(
        keys=[
            stream,
            queue_bytes(stream),
            lookup,
            in_flight,
            waiters(in_flight) if in_flight else "",
            *admit.keys,
        ],
        args=[
            max_queue_size,
            max_queue_bytes,
            fields[HEADER],
            fields[BODY],
            waiter.encode(),
            max(ttl_ms, 1),
            *admit.args,
            *((step,) if step is not None else ()),
        ],
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Queued:
    """On the stream; the reply will come to the reply stream."""


@dataclasses.dataclass(frozen=True, slots=True)
class Waiting:
    """An identical invocation is in flight: its reply will come, addressed `for` this one."""


@dataclasses.dataclass(frozen=True, slots=True)
class Hit:
    fields: dict[bytes, bytes]
    """The cached reply's entry fields."""


@dataclasses.dataclass(frozen=True, slots=True)
class Full:
    limit: str
    """'count' (max_queue_size) or 'bytes' (max_queue_bytes)."""
    index: int = 0
    """Which of the entries was refused (an asynchronous pipeline's first steps, in order)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Limited:
    """Refused by the caller's limits before anything else: 'rate', 'busy' (in flight) or 'share'."""

    limit: str
    retry_after_ms: int


EnqueueOutcome = Queued | Waiting | Hit | Full | Limited


def parse_enqueue(raw: Sequence[Any]) -> EnqueueOutcome:
    kind = raw[0]
    if kind == b"queued":
        return Queued()
    if kind == b"wait":
        return Waiting()
    if kind == b"hit":
        return Hit({HEADER: raw[1], BODY: raw[2] or b""})
    if kind == b"full":
        return Full(raw[1].decode(), int(raw[2]) if len(raw) > 2 else 0)
    if kind == b"limited":
        return Limited(raw[1].decode(), int(raw[2]))
    raise ValueError(f"unknown enqueue outcome {kind!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Outgoing:
    """One reply of a batch and what to do around it."""

    reply: Mapping[bytes, bytes]
    """The reply's entry fields."""
    reply_to: str
    cache_entry: str = ""
    """Store the reply there ('' not to)."""
    cache_ttl_s: int = 0
    in_flight: str = ""
    """The invocation's in-flight marker, if identical invocations may wait on it."""
    waiters: str = "share"
    """'share' the reply with them, 'drop' them, or 'promote' one to run instead."""
    invocation: Mapping[bytes, bytes] | None = None
    """For 'promote': the invocation's own entry fields, which the promoted waiter runs with."""
    reply_ttl_ms: int = 0
    """Keep the reply stream this long after this reply (an asynchronous result's stream); 0 leaves
    its TTL alone."""


@dataclasses.dataclass(frozen=True, slots=True)
class Statistics:
    """A batch's share of its function version's statistics (fngate.statistics)."""

    key: str
    increments: Mapping[str, int]
    ended_ms: int


def finish_call(
    stream: str,
    group: str,
    replies: Sequence[Outgoing],
    entry_ids: Sequence[bytes],
    entry_bytes: int,
    reply_maxlen: int,
    statistics: Statistics | None = None,
) -> ScriptCall:
    """FINISH's arguments: write `replies`, acknowledge and delete `entry_ids` (which held
    `entry_bytes` of the stream's byte count), and add the batch to its `statistics`."""
    reply_keys: dict[str, int] = {}
    items: list[bytes | str | int | float] = []
    for out in replies:
        index = reply_keys.setdefault(out.reply_to, len(reply_keys) + 3)
        promote = out.waiters == "promote" and out.invocation is not None
        items += [
            index,
            out.reply[HEADER],
            out.reply[BODY],
            out.cache_entry,
            out.cache_ttl_s,
            out.in_flight,
            waiters(out.in_flight) if out.in_flight else "",
            out.waiters if out.waiters != "promote" or promote else "drop",
            out.invocation[HEADER] if promote and out.invocation else "",
            out.invocation[BODY] if promote and out.invocation else "",
            out.reply_ttl_ms,
        ]
    counters: list[bytes | str | int | float] = []
    for field, amount in statistics.increments.items() if statistics else ():
        counters += [field, amount]
    return ScriptCall(
        keys=[stream, queue_bytes(stream), *reply_keys],
        args=[
            group,
            reply_maxlen,
            entry_bytes,
            len(replies),
            statistics.key if statistics else "",
            statistics.ended_ms if statistics else 0,
            len(counters) // 2,
            *counters,
            *items,
            *entry_ids,
        ],
    )


def entry_bytes(fields: Mapping[bytes, bytes]) -> int:
    """What an entry counts against max_queue_bytes."""
    return len(fields.get(HEADER, b"")) + len(fields.get(BODY, b"")) + len(fields.get(STEP, b""))


def answered_id(fields: Mapping[bytes, bytes], reply_id: str) -> str:
    """The invocation a reply entry answers: the waiter it names, or the reply's own."""
    target = fields.get(FOR)
    return target.decode() if target else reply_id


# --- Asynchronous invocations -------------------------------------------------------------------
# An asynchronous invocation waits in its function's stream of priority level keys.ASYNC and
# replies to a result stream of its own (keys.result), created here at submission with a TTL of
# the invocation's deadline plus result_ttl_s: FINISH's XADD NOMKSTREAM delivers its reply there
# unchanged, and any gateway reads it. The result stream's first entry holds the state `queued`, the
# queue entry (stream `q`, id `e`) and the gateway's own record (`m`, JSON); a cancellation adds
# `s` = `cancelled`, a callback attempt an entry `cb` (JSON). An invocation with a callback URL
# names the callbacks stream as the one waiter on a marker of its own, so that FINISH's 'share'
# copies its reply there, addressed `for` it, exactly as it answers coalesced invocations.
STATE, QUEUE_STREAM, QUEUE_ENTRY, RECORD, CALLBACK = b"s", b"q", b"e", b"m", b"cb"
QUEUED, CANCELLED = b"queued", b"cancelled"

# KEYS: the level's stream, its byte counter, the result stream, the idempotency key ('' for none),
# the callback marker's waiters list ('' for no callback), then admit()'s keys (bucket, busy,
# share; '' for a caller without limits), then the cache entry to answer from ('' for none).
# ARGV: max queue size, max queue bytes (0: no limit), header, body, the record, the result TTL in
# ms while pending, the invocation id, the callback waiter, the request's digest, admit()'s six
# arguments, then the result TTL in ms once done, and a cached reply's header and body that the
# caller found itself (a cache Redis of its own; '' for none). The idempotency key holds the first
# invocation's id and its request's digest: a repeat answers that id while its result is kept
# ('again'), or 'conflict' when the request differs; once the result expired the key is free again.
# The result stream is named by the invocation id at its end (keys.result), so the first one's
# name follows. A cached answer is the result at once ('hit'): nothing is queued, and a callback
# gets it as from FINISH.
# An asynchronous pipeline (fngate.plan) queues its first steps: ARGV[19] is the first entry's step
# context (STEP; '' or absent for a function's own invocation), and each further first step adds
# its stream and byte counter to KEYS after the ninth (all streams, then all counters) and a group
# of FORWARD's five arguments to ARGV after the nineteenth. All are queued or none ({'full', limit,
# index of the entry refused}); the result stream's first entry names them all, space-separated
# (`q`, `e`), for READ_RESULT and CANCEL.
SUBMIT_ASYNC = (
    ADMIT_LUA
    + """
if KEYS[4] ~= '' then
  local first = redis.call('GET', KEYS[4])
  local id, digest = string.match(first or '', '^(%S+) (%S*)$')
  if id and redis.call('EXISTS', string.sub(KEYS[3], 1, #KEYS[3] - #ARGV[7]) .. id) == 1 then
    if digest ~= ARGV[9] then return {'conflict', id} end
    return {'again', id}
  end
end
if KEYS[6] ~= '' then
  local verdict = admit(KEYS[6], KEYS[7], KEYS[8], tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12]),
    tonumber(ARGV[13]), ARGV[14], tonumber(ARGV[15]))
  if verdict[1] ~= 'ok' then return {'limited', verdict[1], verdict[2]} end
end
local hit_h, hit_b = ARGV[17], ARGV[18]
if hit_h == '' and KEYS[9] ~= '' then
  local hit = redis.call('HMGET', KEYS[9], 'h', 'b')
  hit_h, hit_b = hit[1] or '', hit[2] or ''
end
if hit_h ~= '' then
  redis.call('XADD', KEYS[3], '*', 's', 'queued', 'm', ARGV[5])
  redis.call('XADD', KEYS[3], '*', 'h', hit_h, 'b', hit_b)
  redis.call('PEXPIRE', KEYS[3], ARGV[16])
  if KEYS[4] ~= '' then redis.call('SET', KEYS[4], ARGV[7] .. ' ' .. ARGV[9], 'PX', ARGV[6]) end
  local callbacks, id = string.match(ARGV[8], '^(%S+) (%S+)')
  if callbacks then
    redis.call('XADD', callbacks, 'NOMKSTREAM', '*', 'h', hit_h, 'b', hit_b, 'for', id)
  end
  return {'hit'}
end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  return {'full', 'count', 0}
elseif tonumber(ARGV[2]) > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= tonumber(ARGV[2]) then
  return {'full', 'bytes', 0}
end
local more = (#KEYS - 9) / 2
for i = 1, more do
  local at = 20 + (i - 1) * 5
  if redis.call('XLEN', KEYS[9 + i]) >= tonumber(ARGV[at]) then return {'full', 'count', i} end
  local limit = tonumber(ARGV[at + 1])
  if limit > 0 and tonumber(redis.call('GET', KEYS[9 + more + i]) or '0') >= limit then
    return {'full', 'bytes', i}
  end
end
local entry
local step = ARGV[19] or ''
if step ~= '' then
  entry = redis.call('XADD', KEYS[1], '*', 'h', ARGV[3], 'b', ARGV[4], 'p', step)
else
  entry = redis.call('XADD', KEYS[1], '*', 'h', ARGV[3], 'b', ARGV[4])
end
redis.call('INCRBY', KEYS[2], #ARGV[3] + #ARGV[4] + #step)
local streams, entries = KEYS[1], entry
for i = 1, more do
  local at = 20 + (i - 1) * 5
  local h, b, p = ARGV[at + 2], ARGV[at + 3], ARGV[at + 4]
  streams = streams .. ' ' .. KEYS[9 + i]
  entries = entries .. ' ' .. redis.call('XADD', KEYS[9 + i], '*', 'h', h, 'b', b, 'p', p)
  redis.call('INCRBY', KEYS[9 + more + i], #h + #b + #p)
end
redis.call('XADD', KEYS[3], '*', 's', 'queued', 'q', streams, 'e', entries, 'm', ARGV[5])
redis.call('PEXPIRE', KEYS[3], ARGV[6])
if KEYS[4] ~= '' then redis.call('SET', KEYS[4], ARGV[7] .. ' ' .. ARGV[9], 'PX', ARGV[6]) end
if KEYS[5] ~= '' then
  redis.call('RPUSH', KEYS[5], ARGV[8])
  redis.call('PEXPIRE', KEYS[5], ARGV[6])
end
return {'queued', entry}
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
# one of its queue entries (running): one round trip for a GET.
READ_RESULT = (
    QUEUED_ENTRIES_LUA
    + """
local entries = redis.call('XRANGE', KEYS[1], '-', '+')
if #entries == 0 then return {{}, 0} end
local running = 0
for _, item in ipairs(queued_entries(KEYS[1])) do
  if item[2] and is_taken(item[1], item[2], ARGV[1]) then running = 1 end
end
return {entries, running}
"""
)

# KEYS[1]: the result stream. ARGV[1]: the runner group. Cancels an invocation no runner has taken:
# its queue entry is deleted (so no runner ever reads it) and `cancelled` is recorded. Answers
# 'gone' (no such result), 'done' (it has a reply), 'cancelled' (now or before) or 'running'.
# A pipeline is cancelled only while none of its first steps was taken: then all their entries go.
CANCEL = (
    QUEUED_ENTRIES_LUA
    + """
local entries = redis.call('XRANGE', KEYS[1], '-', '+')
if #entries == 0 then return 'gone' end
for _, item in ipairs(entries) do
  local fields = item[2]
  for i = 1, #fields, 2 do
    local name = fields[i]
    if name == 'h' then return 'done' end
    if name == 's' and fields[i + 1] == 'cancelled' then return 'cancelled' end
  end
end
local queued = queued_entries(KEYS[1])
if #queued == 0 then return 'gone' end
for _, item in ipairs(queued) do
  if not item[2] then return 'gone' end
  if is_taken(item[1], item[2], ARGV[1]) then return 'running' end
end
for _, item in ipairs(queued) do
  local stream, entry = item[1], item[2]
  local size = 0
  local fields = redis.call('XRANGE', stream, entry, entry)[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 'h' or fields[i] == 'b' or fields[i] == 'p' then size = size + #fields[i + 1] end
  end
  redis.call('XDEL', stream, entry)
  if redis.call('XLEN', stream) == 0 then
    redis.call('DEL', stream .. ':bytes')
  else
    redis.call('DECRBY', stream .. ':bytes', size)
  end
end
redis.call('XADD', KEYS[1], '*', 's', 'cancelled')
return 'cancelled'
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
) -> ScriptCall:
    """SUBMIT_ASYNC's arguments. `ttl_ms`: how long the result stream (and the idempotency key)
    live while pending, `done_ttl_ms` once done; `callbacks`: the callbacks stream when the
    invocation has a callback URL, else ''; `request_digest`: what a repeat of `idempotency_key`
    must match (no spaces); `lookup`: the cache entry to answer from ('' for none), or `cached`:
    the cached reply's fields the caller already found. For a pipeline, `step` is the first
    entry's step context and `more` the entries of its other first steps."""
    if not result_stream.endswith(invocation_id) or " " in request_digest:
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
            *(item.stream for item in more),
            *(queue_bytes(item.stream) for item in more),
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
            *((step,) if step or more else ()),
            *_forward_args(more),
        ],
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


SubmitOutcome = Queued | Done | Again | Conflict | Full | Limited


def parse_submit_async(raw: Sequence[Any]) -> SubmitOutcome:
    """SUBMIT_ASYNC's answer: ENQUEUE's outcomes (but a wait), Done for a cache hit, Again or
    Conflict."""
    if raw[0] == b"again":
        return Again(raw[1].decode())
    if raw[0] == b"conflict":
        return Conflict(raw[1].decode())
    if raw[0] == b"hit":
        return Done()
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


# --- Priority levels ------------------------------------------------------------------------------
# KEYS: a function's invocation streams, highest priority first (keys.levels). ARGV: the group, the
# consumer, the room. Reads up to `room` new entries, from each level only the room that the levels
# before it left. Answers {level, entries} pairs.
READ_LEVELS = """
local room = tonumber(ARGV[3])
local out = {}
for i, key in ipairs(KEYS) do
  if room <= 0 then break end
  local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', room, 'STREAMS', key, '>')
  if got then
    local entries = got[1][2]
    room = room - #entries
    out[#out + 1] = {i - 1, entries}
  end
end
return out
"""


def level_entries(reply: Any, streams: Sequence[str]) -> list[tuple[int, bytes, dict[bytes, bytes] | None]]:
    """(level, id, fields) of READ_LEVELS' answer or of a blocking XREADGROUP over `streams`;
    fields None for an entry deleted after delivery."""
    found = []
    for name, entries in reply or ():
        level = name if isinstance(name, int) else streams.index(name.decode())
        for entry_id, flat in entries:
            fields = dict(zip(flat[::2], flat[1::2], strict=True)) if flat is not None else None
            found.append((level, entry_id, fields))
    return found


# Pipelines: a finished step's result goes to the next steps' streams instead of a gateway.

# KEYS: the streams of the entries to add, then their byte counters (same order). ARGV: n, then n
# groups of (max queue size, max queue bytes (0: no limit), header, body, step context). All or
# nothing: {'queued'}, or {'full', index (0-based), 'count'|'bytes'} and nothing is added.
FORWARD = """
local n = tonumber(ARGV[1])
for i = 0, n - 1 do
  local at = 2 + i * 5
  if redis.call('XLEN', KEYS[i + 1]) >= tonumber(ARGV[at]) then return {'full', i, 'count'} end
  local limit = tonumber(ARGV[at + 1])
  if limit > 0 and tonumber(redis.call('GET', KEYS[n + i + 1]) or '0') >= limit then
    return {'full', i, 'bytes'}
  end
end
for i = 0, n - 1 do
  local at = 2 + i * 5
  redis.call('XADD', KEYS[i + 1], '*', 'h', ARGV[at + 2], 'b', ARGV[at + 3], 'p', ARGV[at + 4])
  redis.call('INCRBY', KEYS[n + i + 1], #ARGV[at + 2] + #ARGV[at + 3] + #ARGV[at + 4])
end
return {'queued'}
"""

# KEYS[1]: a join of one pipeline invocation (joins()). ARGV: this predecessor's name, what it
# contributes, how many predecessors the join has, the TTL in ms (to the deadline). Returns every
# contribution once the last one arrives (and forgets them), else nothing.
JOIN = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then
  local all = redis.call('HGETALL', KEYS[1])
  redis.call('DEL', KEYS[1])
  return all
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {}
"""


def joins(invocation_id: str, node: int) -> str:
    """Where the predecessors of a pipeline step (or of its outputs) leave their results."""
    return f"fngate:j:{invocation_id}:{node}"


@dataclasses.dataclass(frozen=True, slots=True)
class Forward:
    """One entry FORWARD adds: a pipeline step's invocation and its context."""

    stream: str
    fields: Mapping[bytes, bytes]
    step: bytes
    max_queue_size: int
    max_queue_bytes: int


def forward_call(entries: Sequence[Forward]) -> ScriptCall:
    return ScriptCall(
        keys=[*(item.stream for item in entries), *(queue_bytes(item.stream) for item in entries)],
        args=[len(entries), *_forward_args(entries)],
    )


def _forward_args(entries: Sequence[Forward]) -> list[bytes | str | int | float]:
    """Five arguments per entry, as FORWARD and SUBMIT_ASYNC read them."""
    args: list[bytes | str | int | float] = []
    for item in entries:
        args += [item.max_queue_size, item.max_queue_bytes, item.fields[HEADER], item.fields[BODY], item.step]
    return args


def parse_forward(raw: Sequence[Any]) -> tuple[int, str] | None:
    """None when queued, else (index of the entry refused, 'count' or 'bytes')."""
    if raw[0] == b"queued":
        return None
    return int(raw[1]), raw[2].decode()


def join_call(
    invocation_id: str, node: int, source: str, contribution: bytes, count: int, ttl_ms: int
) -> ScriptCall:
    return ScriptCall(keys=[joins(invocation_id, node)], args=[source, contribution, count, max(ttl_ms, 1)])


def parse_join(raw: Sequence[Any]) -> dict[str, bytes] | None:
    """Every contribution by predecessor once complete, else None."""
    if not raw:
        return None
    return {raw[index].decode(): raw[index + 1] for index in range(0, len(raw), 2)}
