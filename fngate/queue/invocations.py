"""Invocations on a function's stream: entry field names, the waiter format, the enqueue and finish
scripts, and pure builders of their arguments and parsers of their outcomes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from fngate.queue.stored import STORE_RESULT_LUA

HEADER = b"h"
"""An entry's JSON header (fngate.wire)."""
BODY = b"b"
"""An entry's tensors, back to back (fngate.wire)."""
HEADERS = b"H"
"""On a reply entry of several replies (a batch's replies to one gateway): their headers, as one
JSON array of the headers `h` holds on a reply entry of one."""
BODIES = b"B"
"""On a reply entry of several replies: their bodies, back to back in the order of HEADERS."""
FOR = b"for"
"""On a reply: the id of the invocation it answers when that is not the reply's own (a waiter)."""
STEP = b"p"
"""On an invocation entry that is a pipeline step: its context (fngate.pipeline.StepContext)."""
SEQUENCE_STATE = b"s"
"""On an invocation entry that is a step of a stateful model's sequence: the sequence's implicit
state as its last step left it (fngate.sequences; absent at its start)."""
AS, TO, BY = b"as", b"to", b"by"
"""On an invocation entry: a waiter promoted to run in place of an identical invocation that expired
runs under its own id (`as`), reply stream (`to`) and deadline in ms (`by`)."""

# given(key): a key the caller passed. One that is not given is '' on one Redis; on a Redis Cluster
# it is the hash tag of the call's first key alone ('{tiny}': fngate.fastredis_cluster.placeheld), since a
# declared key of another slot (slot 0, for '') would refuse the whole call. No key fngate names
# starts with '{'.
GIVEN_LUA = """
local function given(key) return key ~= '' and string.byte(key, 1) ~= 123 end
"""

# full(stream, counter, max_size, max_bytes) -> nil | 'count' | 'bytes': whether a stream is at its
# max_queue_size (its invocations: its entries, plus what its grouped entries hold beyond one each,
# in its EXTRA counter, plus those this script call defers to a grouped entry) or (max_bytes > 0) its
# byte counter at max_queue_bytes.
# push(stream, counter, header, body, step) -> the entry id: the entry added (with its pipeline step
# context when `step` is not '') and its bytes counted. Every script that queues work uses both.
# `turn`: per stream, the invocations ENQUEUE_MANY defers to grouped entries (empty elsewhere).
# `seen`: per stream, its invocations and bytes as this script call read them once and counted
# since (a command a Lua script calls costs about as much as the decision around it).
PUSH_LUA = """
local turn = {}
local seen = {}
local function waiting(stream)
  local s = seen[stream]
  if not s then
    s = {n = redis.call('XLEN', stream) + tonumber(redis.call('GET', stream .. ':extra') or '0')}
    seen[stream] = s
  end
  local t = turn[stream]
  return s.n + (t and t.count or 0)
end
local function full(stream, counter, max_size, max_bytes)
  if waiting(stream) >= tonumber(max_size) then return 'count' end
  local limit = tonumber(max_bytes)
  if limit > 0 then
    local s, t = seen[stream], turn[stream]
    if not s.bytes then s.bytes = tonumber(redis.call('GET', counter) or '0') end
    if s.bytes + (t and t.bytes or 0) >= limit then return 'bytes' end
  end
  return nil
end
local function push(stream, counter, h, b, step, state)
  local id
  if step and step ~= '' then
    id = redis.call('XADD', stream, '*', 'h', h, 'b', b, 'p', step)
  elseif state and state ~= '' then
    id = redis.call('XADD', stream, '*', 'h', h, 'b', b, 's', state)
  else
    id = redis.call('XADD', stream, '*', 'h', h, 'b', b)
  end
  local size = #h + #b + #(step or '') + #(state or '')
  redis.call('INCRBY', counter, size)
  local s = seen[stream]
  if s then
    s.n = s.n + 1
    if s.bytes then s.bytes = s.bytes + size end
  end
  return id
end
"""

# entry_bytes(fields): what push counted of an entry in its stream's byte counter (queue_bytes).
# unqueue(stream, id): an entry no runner took, out of its stream (no runner ever reads it) and out
# of the counter, which goes with the stream's last entry; answers its fields (nil: not there).
UNQUEUE_LUA = """
local function entry_bytes(fields)
  local size = 0
  for i = 1, #fields, 2 do
    local name = fields[i]
    if name == 'h' or name == 'b' or name == 'p' or name == 's' or name == 'H' or name == 'B' then
      size = size + #fields[i + 1]
    end
  end
  return size
end
local function unqueue(stream, id)
  local found = redis.call('XRANGE', stream, id, id)[1]
  if not found then return nil end
  redis.call('XDEL', stream, id)
  if redis.call('XLEN', stream) == 0 then
    redis.call('DEL', stream .. ':bytes', stream .. ':extra')
  else
    redis.call('DECRBY', stream .. ':bytes', entry_bytes(found[2]))
  end
  return found[2]
end
"""

# admit(bucket, busy, share, rps, burst, cap, share_cap, member, ttl_ms)
#   -> {'ok'} | {'budget'|'busy'|'share'|'rate', retry_after_ms}
# A key past its compute budget has `over` (ms, Redis time) in its bucket, set by the runner that
# charged it past (runner.consumer): refused until then.
# A token bucket (`burst` tokens, `rps` per second, Redis time) and two sorted sets of the key's
# invocations with their expiry: all of them (`busy`, at most `cap`) and those of one function
# (`share`, at most `share_cap`). A dead gateway's members lapse at their expiry. Limits of 0 are
# off; a refused invocation takes neither a token nor a place.
ADMIT_LUA = """
local function admit(bucket, busy, share, rps, burst, cap, share_cap, member, ttl_ms)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if bucket ~= '' then
    local over = tonumber(redis.call('HGET', bucket, 'over') or '0')
    if over > now then
      return {'budget', over - now}
    end
  end
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
    local keep = math.ceil(burst * 1000 / rps) + 1000
    if redis.call('PTTL', bucket) < keep then  -- a budget's `over` may keep it longer
      redis.call('PEXPIRE', bucket, keep)
    end
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

# One round trip for the whole decision; a queued invocation's answer names its entry ({'queued',
# id}), which WITHDRAW takes back if its caller leaves before a runner reads it. KEYS: the stream,
# its byte counter, the cache entry ('' to skip the lookup), the in-flight marker and its waiters
# list ('' for no coalescing), then the caller's admission keys (bucket, busy, share; '' for a caller
# without limits); last of all, the stream's EXTRA counter (declared only: `declared`). ARGV: max
# queue size, max queue bytes (0: no limit), header, body, this invocation as a waiter, marker TTL
# in ms, then admit()'s rps, burst, cap, share_cap, member and ttl_ms, then a pipeline step's
# context (STEP; absent or '' for an invocation of its own). Entries
# leave the stream when a runner acknowledges them, so XLEN counts queued or in flight.
# A pipeline queues its first steps together: each further first step adds its stream and byte
# counter to KEYS after the eighth (all streams, then all counters) and a group of FORWARD's five
# arguments to ARGV after the thirteenth. All are queued or none ({'full', limit, index of the
# entry refused}). enqueue(K, A, ko, ao, nk, na, ...) reads one invocation's KEYS[n] as K[ko + n]
# and its ARGV[n] as A[ao + n] (nk, na: how many it has), in place: ENQUEUE_MANY copies none.
ENQUEUE_LUA = (
    GIVEN_LUA
    + ADMIT_LUA
    + PUSH_LUA
    + """
local order = {}
-- defer(...): an invocation that ENQUEUE_MANY queues in a grouped entry of its stream, with the
-- others of this call (at most group_max an entry), once every invocation of the call is decided.
local function defer(stream, counter, h, b, group_max, at)
  local t = turn[stream]
  if not t then
    t = {count = 0, bytes = 0, counter = counter, groups = {}}
    turn[stream] = t
    order[#order + 1] = stream
  end
  local g = t.groups[#t.groups]
  if not g or #g.h >= group_max then
    g = {h = {}, b = {}, at = {}}
    t.groups[#t.groups + 1] = g
  end
  g.h[#g.h + 1], g.b[#g.b + 1], g.at[#g.at + 1] = h, b, at
  t.count = t.count + 1
  t.bytes = t.bytes + #h + #b
end
local function enqueue(K, A, ko, ao, nk, na, group_max, index)
  if given(K[ko + 6]) then
    local verdict = admit(K[ko + 6], K[ko + 7], K[ko + 8], tonumber(A[ao + 7]), tonumber(A[ao + 8]),
      tonumber(A[ao + 9]), tonumber(A[ao + 10]), A[ao + 11], tonumber(A[ao + 12]))
    if verdict[1] ~= 'ok' then return {'limited', verdict[1], verdict[2]} end
  end
  if given(K[ko + 3]) then
    local hit = redis.call('HMGET', K[ko + 3], 'h', 'b')
    if hit[1] then return {'hit', hit[1], hit[2]} end
  end
  if given(K[ko + 4]) then
    if not redis.call('SET', K[ko + 4], '1', 'NX', 'PX', A[ao + 6]) then
      redis.call('RPUSH', K[ko + 5], A[ao + 5])
      redis.call('PEXPIRE', K[ko + 5], A[ao + 6])
      return {'wait'}
    end
  end
  local function refuse(limit, index)
    if given(K[ko + 4]) then redis.call('DEL', K[ko + 4]) end
    if given(K[ko + 6]) then  -- refused: it holds no place in the caller's limits
      redis.call('ZREM', K[ko + 7], A[ao + 11])
      redis.call('ZREM', K[ko + 8], A[ao + 11])
    end
    return {'full', limit, index}
  end
  -- A step of a sequence (ARGV[14] 'sequence'): KEYS[9] is its sequence's key, whose value is its
  -- implicit state ('' for none yet), ARGV[15] its flags ('S' start, 'E' end), ARGV[16] how long
  -- it lives from now in ms (the step's deadline and the idle timeout: the gateway shortens it to
  -- the idle timeout at the answer, and sets the state the step left). One not started is refused.
  -- KEYS[10]: the function's live sequences (sorted set: sequence key -> the latest it may live
  -- to, in ms), at most ARGV[17]: a start past them is refused ({'sequences'}).
  local sequence = na >= 14 and A[ao + 14] == 'sequence'
  local starts = sequence and string.find(A[ao + 15], 'S', 1, true)
  local now_ms = 0
  if sequence then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  if starts then
    redis.call('ZREMRANGEBYSCORE', K[ko + 10], '-inf', now_ms)
    if redis.call('EXISTS', K[ko + 9]) == 0 and redis.call('ZCARD', K[ko + 10]) >= tonumber(A[ao + 17]) then
      if given(K[ko + 6]) then
        redis.call('ZREM', K[ko + 7], A[ao + 11])
        redis.call('ZREM', K[ko + 8], A[ao + 11])
      end
      return {'sequences', tonumber(A[ao + 17])}
    end
  end
  local state = nil
  if sequence and not starts then
    state = redis.call('GET', K[ko + 9])
    if not state then
      if given(K[ko + 6]) then
        redis.call('ZREM', K[ko + 7], A[ao + 11])
        redis.call('ZREM', K[ko + 8], A[ao + 11])
      end
      return {'unstarted'}
    end
  end
  local limit = full(K[ko + 1], K[ko + 2], A[ao + 1], A[ao + 2])
  if limit then return refuse(limit, 0) end
  local more = sequence and 0 or (nk - 8) / 2
  for i = 1, more do
    local at = 14 + (i - 1) * 5
    limit = full(K[ko + 8 + i], K[ko + 8 + more + i], A[ao + at], A[ao + at + 1])
    if limit then return refuse(limit, i) end
  end
  -- ARGV[13]: a pipeline step's context (STEP)
  local step = na >= 13 and A[ao + 13] or ''
  if group_max and group_max > 1 and not sequence and more == 0 and step == '' then
    defer(K[ko + 1], K[ko + 2], A[ao + 3], A[ao + 4], group_max, index)
    return {'deferred'}
  end
  local id = push(K[ko + 1], K[ko + 2], A[ao + 3], A[ao + 4], step, state)
  if sequence then
    if string.find(A[ao + 15], 'E', 1, true) then
      redis.call('DEL', K[ko + 9])
      redis.call('ZREM', K[ko + 10], K[ko + 9])
    elseif starts then
      redis.call('SET', K[ko + 9], '', 'PX', A[ao + 16])
      redis.call('ZADD', K[ko + 10], now_ms + tonumber(A[ao + 16]), K[ko + 9])
    else
      redis.call('PEXPIRE', K[ko + 9], A[ao + 16])
      redis.call('ZADD', K[ko + 10], 'XX', now_ms + tonumber(A[ao + 16]), K[ko + 9])
    end
  end
  for i = 1, more do
    local at = 14 + (i - 1) * 5
    push(K[ko + 8 + i], K[ko + 8 + more + i], A[ao + at + 2], A[ao + at + 3], A[ao + at + 4])
  end
  return {'queued', id, waiting(K[ko + 1])}
end
"""
)
ENQUEUE = ENQUEUE_LUA + "return enqueue(KEYS, ARGV, 0, 0, #KEYS - 1, #ARGV)\n"

# Several invocations in one call (every ENQUEUE of one event-loop turn): ARGV[1] is their number n,
# then n triples (its number of KEYS, its number of ARGV, how many may share an entry: 0 or 1 for
# none), then each one's ARGV in order; KEYS holds each one's KEYS in order. Each is decided as
# ENQUEUE decides it, in order; the answer is the list of their outcomes. Those that may share an
# entry (a synchronous invocation of its own: no pipeline step, no sequence) and are queued go, per
# stream, in grouped entries of up to that many (HEADERS: their headers as one JSON array; BODIES:
# their bodies back to back), one XADD a group; each one's outcome names its place in its entry,
# `<entry id>/<index>` (one alone takes a plain entry, named by its id). The stream's EXTRA counter
# holds what its grouped entries hold beyond one each (runners take it back as they acknowledge them).
# A packed item (its third number -m, m > 1) is m invocations that need no decision of their own
# (packable), whose entry the gateway built: KEYS the stream and its byte counter, ARGV max queue
# size, max queue bytes, HEADERS and BODIES. It is queued whole, as one entry, when all m fit (the
# byte limit is checked with the whole entry's size, so that each would fit as ENQUEUE decides it);
# else it answers {'split'} and does nothing, and the gateway sends the m again, each to be decided.
# A packed item's outcome names its entry; its m invocations are `<entry id>/0` to `/m-1`.
ENQUEUE_MANY = (
    ENQUEUE_LUA
    + """
local function enqueue_packed(K, A, ko, ao, m)
  local stream, counter, h, b = K[ko + 1], K[ko + 2], A[ao + 3], A[ao + 4]
  if waiting(stream) + m > tonumber(A[ao + 1]) then return {'split'} end
  local s, t, size = seen[stream], turn[stream], #h + #b
  local limit = tonumber(A[ao + 2])
  if limit > 0 then
    if not s.bytes then s.bytes = tonumber(redis.call('GET', counter) or '0') end
    if s.bytes + (t and t.bytes or 0) + size >= limit then return {'split'} end
  end
  local id = redis.call('XADD', stream, '*', 'H', h, 'B', b)
  redis.call('INCRBY', counter, size)
  redis.call('INCRBY', stream .. ':extra', m - 1)
  s.n = s.n + m
  if s.bytes then s.bytes = s.bytes + size end
  return {'queued', id, waiting(stream)}
end
local n = tonumber(ARGV[1])
local outcomes = {}
local ko, ao = 0, 1 + 3 * n
for i = 1, n do
  local nk, na, g = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  if g < 0 then
    outcomes[i] = enqueue_packed(KEYS, ARGV, ko, ao, -g)
  else
    outcomes[i] = enqueue(KEYS, ARGV, ko, ao, nk - 1, na, g, i)
  end
  ko, ao = ko + nk, ao + na
end
for _, stream in ipairs(order) do
  local t = turn[stream]
  local added = 0
  for _, g in ipairs(t.groups) do
    if #g.h == 1 then
      g.id = redis.call('XADD', stream, '*', 'h', g.h[1], 'b', g.b[1])
      redis.call('INCRBY', t.counter, #g.h[1] + #g.b[1])
    else
      local h, b = '[' .. table.concat(g.h, ',') .. ']', table.concat(g.b)
      g.id = redis.call('XADD', stream, '*', 'H', h, 'B', b)
      redis.call('INCRBY', t.counter, #h + #b)
      added = added + #g.h - 1
    end
  end
  if added > 0 then redis.call('INCRBY', stream .. ':extra', added) end
  local s = seen[stream]
  s.n, s.bytes = s.n + t.count, nil
  turn[stream] = nil
  local depth = waiting(stream)
  for _, g in ipairs(t.groups) do
    for j, at in ipairs(g.at) do
      outcomes[at] = {'queued', #g.h == 1 and g.id or (g.id .. '/' .. (j - 1)), depth}
    end
  end
end
return outcomes
"""
)

# KEYS[1]: an invocation stream, KEYS[2]: the invocation's in-flight marker ('' for none), KEYS[3]:
# its waiters list. ARGV[1]: the runner group, ARGV[2]: the invocation's entry id, ARGV[3]: the
# function's channel of callers that left (fngate.keys.left_channel), ARGV[4]: '1' on a Redis
# Cluster (a shard channel, SPUBLISH: it is in the stream's slot). Takes back a synchronous
# invocation whose caller left (a reset RPC, a closed connection) while no runner has read it: its
# entry leaves the stream unread, so no runner runs it. Answers 'withdrawn'; 'stopped' (a runner
# read it: it is told, on the channel, to answer it unrun, and no identical invocation may wait on
# it from now); 'shared' (identical invocations wait on it: it runs for them); 'running' (a runner
# read it and it runs for those waiting); 'gone' (answered or removed already). One of a grouped
# entry's invocations (`<entry id>/<index>`) cannot leave its entry: it is named in the stream's set
# of invocations whose callers left (LEFT_SET, which a runner reads when it starts to read the
# stream) and on the channel, so that whichever runner reads it answers it unrun; 'marked', or
# 'stopped' when a runner read it already.
WITHDRAW = (
    GIVEN_LUA
    + UNQUEUE_LUA
    + """
local entry = string.match(ARGV[2], '^([^/]+)/%d+$')
if entry then
  local read = redis.pcall('XPENDING', KEYS[1], ARGV[1], entry, entry, 1)
  read = type(read) == 'table' and #read > 0
  if given(KEYS[2]) then
    if redis.call('LLEN', KEYS[3]) > 0 then return read and 'running' or 'shared' end
    redis.call('DEL', KEYS[2])
  end
  redis.call('SADD', KEYS[1] .. ':left', ARGV[2])
  redis.call('PEXPIRE', KEYS[1] .. ':left', ARGV[5])
  redis.call(ARGV[4] == '1' and 'SPUBLISH' or 'PUBLISH', ARGV[3], KEYS[1] .. ' ' .. ARGV[2])
  return read and 'stopped' or 'marked'
end
local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if type(pending) == 'table' and #pending > 0 then
  if given(KEYS[2]) then
    if redis.call('LLEN', KEYS[3]) > 0 then return 'running' end
    redis.call('DEL', KEYS[2])
  end
  redis.call(ARGV[4] == '1' and 'SPUBLISH' or 'PUBLISH', ARGV[3], KEYS[1] .. ' ' .. ARGV[2])
  return 'stopped'
end
if given(KEYS[2]) and redis.call('LLEN', KEYS[3]) > 0 then return 'shared' end
if not unqueue(KEYS[1], ARGV[2]) then return 'gone' end
if given(KEYS[2]) then redis.call('DEL', KEYS[2], KEYS[3]) end
return 'withdrawn'
"""
)


def withdraw_call(
    stream: str, entry_id: bytes, in_flight: str, group: str, channel: str, cluster: bool = False
) -> ScriptCall:
    """WITHDRAW's arguments for the invocation queued as `entry_id` on `stream`, of the function
    whose channel of callers that left is `channel`."""
    # The byte and EXTRA counters and LEFT_SET are reached by name: declared, for a Redis Cluster's
    # migrating slot (a script that reaches an undeclared key of one fails).
    declared = [queue_bytes(stream), extra_count(stream), left_set(stream)]
    keys_ = [stream, in_flight, waiters(in_flight) if in_flight else "", *declared]
    return ScriptCall(keys_, [group, entry_id, channel, "1" if cluster else "0", LEFT_TTL_MS])


LEFT_TTL_MS = 3_600_000
"""How long a stream's LEFT_SET lasts after the last invocation named in it (its entries wait no
longer than their deadlines; the runner that answers one takes it out)."""


def extra_count(stream: str) -> str:
    """The counter of what a stream's grouped entries hold beyond one invocation each (ENQUEUE_MANY):
    its invocations queued or in flight are its length plus this."""
    return f"{stream}:extra"


def left_set(stream: str) -> str:
    """The set of a stream's invocations in grouped entries whose callers left (WITHDRAW)."""
    return f"{stream}:left"


def enqueue_many_call(calls: Sequence[ScriptCall], grouped: Sequence[int] = ()) -> ScriptCall:
    """ENQUEUE_MANY's arguments for these ENQUEUE calls, each decided on its own; its answer is their
    outcomes in order. `grouped`: for each, how many invocations may share its entry (none given: 0
    for all)."""
    return turn_call(calls, grouped, pack=False).call


def packable(call: ScriptCall) -> bool:
    """Whether an ENQUEUE needs no decision of its own beyond its stream's room: no cache lookup, no
    identical invocation to join, no caller limits, no pipeline step, no sequence."""
    return len(call.keys) == 9 and len(call.args) == 12 and not any(call.keys[2:8])


@dataclasses.dataclass(frozen=True, slots=True)
class TurnCall:
    """ENQUEUE_MANY's arguments for one event-loop turn's ENQUEUE calls, and the calls each of its
    items carries: one, or the several of a packed entry."""

    call: ScriptCall
    items: list[list[int]]


def turn_call(calls: Sequence[ScriptCall], grouped: Sequence[int] = (), pack: bool = True) -> TurnCall:
    """ENQUEUE_MANY for these calls. `grouped`: for each, how many invocations may share its entry
    (none given: 0 for all). With `pack`, the packable calls of one stream that may share go as
    packed items of up to that many, their entry built here (its HEADERS one JSON array of their
    headers, its BODIES their bodies back to back); the others are decided each on its own."""
    items: list[list[int]] = []
    packs: dict[str, list[int]] = {}
    for at, call in enumerate(calls):
        if pack and grouped and grouped[at] > 1 and packable(call):
            packs.setdefault(call.keys[0], []).append(at)
        else:
            items.append([at])
    counts: list[bytes | str | int | float] = []
    args: list[bytes | str | int | float] = []
    keys: list[str] = []

    def alone(call: ScriptCall, shares: int) -> None:
        counts.extend((len(call.keys), len(call.args), shares))
        keys.extend(call.keys)
        args.extend(call.args)

    for (item,) in items:
        alone(calls[item], grouped[item] if grouped else 0)
    for members in packs.values():
        most = min(grouped[member] for member in members)  # a stream's versions may batch apart
        for start in range(0, len(members), most):
            chunk = members[start : start + most]
            if len(chunk) == 1:  # one alone: decided as ENQUEUE decides it, in a plain entry
                alone(calls[chunk[0]], 0)
            else:
                first = calls[chunk[0]]
                headers = b",".join(_as_bytes(calls[member].args[2]) for member in chunk)
                bodies = b"".join(_as_bytes(calls[member].args[3]) for member in chunk)
                counts += [3, 4, -len(chunk)]
                keys += [first.keys[0], first.keys[1], first.keys[-1]]
                args += [first.args[0], first.args[1], b"[" + headers + b"]", bodies]
            items.append(chunk)
    return TurnCall(ScriptCall(keys, [len(items), *counts, *args]), items)


def _as_bytes(value: bytes | str | int | float) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def turn_outcomes(turn: TurnCall, raw: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """Each call's raw ENQUEUE outcome from ENQUEUE_MANY's answer to `turn` (a packed entry's
    invocations each named `<entry id>/<index>`), and the calls of packed items that did not fit
    whole: those have no outcome (None) and are to be sent again, unpacked."""
    outcomes: list[Any] = [None] * sum(len(item) for item in turn.items)
    again: list[int] = []
    for item, answer in zip(turn.items, raw, strict=True):
        if len(item) == 1:
            outcomes[item[0]] = answer
        elif answer[0] == b"split":
            again += item
        else:
            _, entry_id, depth = answer
            for index, at in enumerate(item):
                outcomes[at] = [b"queued", b"%s/%d" % (entry_id, index), depth]
    return outcomes, sorted(again)


FINISH_ITEM = 11
"""Arguments per reply in FINISH."""

# KEYS[1]: the invocation stream, KEYS[2]: its byte counter, KEYS[3..]: reply streams, then the
# stream's EXTRA counter (declared only). ARGV: group, reply maxlen, bytes acknowledged, the number
# of replies n, the statistics hash ('' for
# none), the time of the batch's end in ms for it, the number m of its counters, m pairs (field,
# amount) to add, then n groups of
# FINISH_ITEM (index into KEYS (0: the reply was delivered already), header, body, cache entry or
# '', its TTL in s, in-flight marker or '', its waiters list, what to do with the waiters: 'share'
# the reply, 'drop' them, 'promote' the first to run in place of this one, or 'counted': the caller
# answered as many as the next argument says, and for 'promote' the invocation's own header and
# body, and how long in ms to keep the reply stream from now on (0: leave its TTL as it is; an
# asynchronous result is kept result_ttl_s after it is done)), then the number p of packed reply
# entries and p triples (index into KEYS, HEADERS, BODIES: the replies of the batch to one gateway
# that need nothing else, in one entry), then the invocations the acknowledged entries held beyond
# one each (grouped entries: taken from the stream's EXTRA counter), then the entry ids to
# acknowledge and delete. Replies go
# only to reply streams that exist (NOMKSTREAM): a gateway that stopped took its stream with it. A
# reply kept for a time (an asynchronous result's) is stored compactly instead
# (fngate.queue.stored). One command per batch on one Redis. Answers n once done, or
# {'charge', {{quota, bytes, ttl_ms}, ...}} once done when results it stored owe their bytes to
# quotas in other slots (a Redis Cluster's: fngate.delivery charges them); or, when waiters joined
# a 'counted' list beyond its count, {'more', {{i, the new waiters}, ...}} and does nothing (a Redis
# Cluster's FINISH, fngate.delivery, answers them and calls again).
FINISH = (
    STORE_RESULT_LUA
    + """
local n = tonumber(ARGV[4])
local maxlen = ARGV[2]
local m = tonumber(ARGV[7])
local first = 8 + m * 2
local more = {}
for i = 0, n - 1 do
  local at = first + i * 11
  if ARGV[at + 7] == 'counted' and ARGV[at + 5] ~= '' then
    local known = tonumber(ARGV[at + 8])
    if redis.call('LLEN', ARGV[at + 6]) > known then
      more[#more + 1] = {i, redis.call('LRANGE', ARGV[at + 6], known, -1)}
    end
  end
end
if #more > 0 then return {'more', more} end
if ARGV[5] ~= '' then
  for j = 0, m - 1 do redis.call('HINCRBY', ARGV[5], ARGV[8 + j * 2], ARGV[9 + j * 2]) end
  redis.call('HSET', ARGV[5], 'last_inference', ARGV[6])
end
local owed = {}
for i = 0, n - 1 do
  local at = first + i * 11
  local h, b = ARGV[at + 1], ARGV[at + 2]
  if ARGV[at] ~= '0' then
    local reply_to = KEYS[tonumber(ARGV[at])]
    if ARGV[at + 10] ~= '0' then
      owed[#owed + 1] = store_result(reply_to, h, b, ARGV[at + 10])
    else
      redis.call('XADD', reply_to, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*', 'h', h, 'b', b)
    end
  end
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
local packed = first + n * 11
for j = 0, tonumber(ARGV[packed]) - 1 do
  local at = packed + 1 + j * 3
  redis.call('XADD', KEYS[tonumber(ARGV[at])], 'NOMKSTREAM', 'MAXLEN', '~', maxlen, '*', 'H', ARGV[at + 1],
    'B', ARGV[at + 2])
end
local ids = {}
local extra_at = packed + 1 + tonumber(ARGV[packed]) * 3
for i = extra_at + 1, #ARGV do ids[#ids + 1] = ARGV[i] end
if #ids > 0 then
  redis.pcall('XACK', KEYS[1], ARGV[1], unpack(ids))
  redis.call('XDEL', KEYS[1], unpack(ids))
  if redis.call('XLEN', KEYS[1]) == 0 then
    redis.call('DEL', KEYS[2], KEYS[1] .. ':extra')
  else
    redis.call('DECRBY', KEYS[2], ARGV[3])
    if ARGV[extra_at] ~= '0' then redis.call('DECRBY', KEYS[1] .. ':extra', ARGV[extra_at]) end
  end
end
if #owed > 0 then return {'charge', owed} end
return n
"""
)


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


def entry_runs(stream: str) -> str:
    """The hash of an invocation stream's entries that ran alone (runner.reclaim): entry id -> runs."""
    return f"{stream}:runs"


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """admit()'s KEYS (bucket, busy, share) and ARGV (rps, burst, cap, share_cap, member, ttl_ms)
    for a caller with limits (gateway.limits builds it)."""

    keys: tuple[str, str, str]
    args: tuple[float, int, int, int, str, int]


NO_ADMISSION = Admission(("", "", ""), (0, 0, 0, 0, "", 0))


@dataclasses.dataclass(frozen=True, slots=True)
class SequenceGate:
    """What ENQUEUE checks and keeps of a sequence's step: the sequence's key (fngate.keys.sequence),
    the step's flags (fngate.sequences.Step.flags) and how long the sequence lives from the step's
    enqueue (its deadline and then the idle timeout: a step that waits or runs long never ends its
    own sequence)."""

    key: str
    flags: str
    live_ms: int
    live: str = ""
    """The function's live sequences (fngate.keys.live_sequences)."""
    max_live: int = 1000
    """How many may be live at once: a start past them is refused (TooManySequences)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Forward:
    """One entry FORWARD adds: a pipeline step's invocation and its context."""

    stream: str
    fields: Mapping[bytes, bytes]
    step: bytes
    max_queue_size: int
    max_queue_bytes: int


def forward_args(entries: Sequence[Forward]) -> list[bytes | str | int | float]:
    """Five arguments per entry, as FORWARD and SUBMIT_ASYNC read them."""
    args: list[bytes | str | int | float] = []
    for item in entries:
        args += [item.max_queue_size, item.max_queue_bytes, item.fields[HEADER], item.fields[BODY], item.step]
    return args


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
    more: Sequence[Forward] = (),
    sequence: SequenceGate | None = None,
) -> ScriptCall:
    """ENQUEUE's arguments. `lookup`: the cache entry to answer from ('' for none); `in_flight`: the
    marker that makes identical invocations wait on this one ('' for no coalescing); `admission`:
    the caller's limits, checked first in the same round trip (None: a caller without limits);
    `step`: a pipeline step's context (STEP), None for an invocation of its own; `more`: a
    pipeline's other first steps, queued with this one or not at all; `sequence`: a step of a
    sequence, refused unless its sequence is live or it starts it (never with `step` or `more`)."""
    admit = admission or NO_ADMISSION
    if sequence is not None:
        assert step is None and not more
        return ScriptCall(
            keys=[stream, queue_bytes(stream), lookup, in_flight, waiters(in_flight) if in_flight else "",
                  *admit.keys, sequence.key, sequence.live, extra_count(stream)],
            args=[max_queue_size, max_queue_bytes, fields[HEADER], fields[BODY], waiter.encode(),
                  max(ttl_ms, 1), *admit.args, b"", "sequence", sequence.flags, max(sequence.live_ms, 1),
                  sequence.max_live],
        )  # fmt: skip
    return ScriptCall(
        keys=[
            stream,
            queue_bytes(stream),
            lookup,
            in_flight,
            waiters(in_flight) if in_flight else "",
            *admit.keys,
            *(item.stream for item in more),
            *(queue_bytes(item.stream) for item in more),
            extra_count(stream),
        ],
        args=[
            max_queue_size,
            max_queue_bytes,
            fields[HEADER],
            fields[BODY],
            waiter.encode(),
            max(ttl_ms, 1),
            *admit.args,
            *((step or b"",) if step is not None or more else ()),
            *forward_args(more),
        ],
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Queued:
    """On the stream; the reply will come to the reply stream."""

    entry_id: bytes = dataclasses.field(default=b"", compare=False)
    """Its entry on the stream (WITHDRAW takes it back); outcomes compare without it."""
    depth: int = dataclasses.field(default=0, compare=False)
    """The stream's entries once it was added, itself included (queued or running)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Coalesced:
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


@dataclasses.dataclass(frozen=True, slots=True)
class TooManySequences:
    """A start of a sequence refused: its function has as many sequences live as it may."""

    max_live: int


@dataclasses.dataclass(frozen=True, slots=True)
class Unstarted:
    """A step of a sequence that is not live (never started, ended, or idle past its timeout), and
    not its start."""


EnqueueOutcome = Queued | Coalesced | Hit | Full | Limited | Unstarted | TooManySequences


def full_message(what: str, limit: str, asynchronous: bool = False) -> str:
    """The refusal of an entry by a full queue: `what` names the entry's function (or pipeline
    step), `limit` is Full.limit, `asynchronous` for a stream of level keys.ASYNC."""
    if limit == "bytes":
        setting = "max_queue_bytes"
    else:
        setting = "max_async_queue_size" if asynchronous else "max_queue_size"
    return f"{what} has too many invocations queued ({setting}); retry later"


def parse_enqueue(raw: Sequence[Any]) -> EnqueueOutcome:
    kind = raw[0]
    if kind == b"queued":
        return Queued(raw[1] if len(raw) > 1 else b"", int(raw[2]) if len(raw) > 2 else 0)
    if kind == b"wait":
        return Coalesced()
    if kind == b"hit":
        return Hit({HEADER: raw[1], BODY: raw[2] or b""})
    if kind == b"full":
        return Full(raw[1].decode(), int(raw[2]) if len(raw) > 2 else 0)
    if kind == b"limited":
        return Limited(raw[1].decode(), int(raw[2]))
    if kind == b"unstarted":
        return Unstarted()
    if kind == b"sequences":
        return TooManySequences(int(raw[1]))
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
    delivered: bool = False
    """The reply is in `reply_to` already (a Redis Cluster's DELIVER, fngate.queue.slots)."""


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
    answered: Mapping[int, int] | None = None,
    extra: int = 0,
) -> ScriptCall:
    """FINISH's arguments: write `replies` (those to one gateway packed into one entry where they
    need nothing else), acknowledge and delete `entry_ids` (which held `entry_bytes` of the
    stream's byte count, and `extra` invocations beyond one each: grouped entries), and add the
    batch to its `statistics`. `answered` (a Redis Cluster's
    FINISH): the caller answers the waiters of each reply that shares its answer itself, and has
    answered this many of the reply at each index (none when missing); nothing is packed then."""
    reply_keys: dict[str, int] = {}
    together = _packable(replies) if answered is None else {}
    packed_at = {at for indices in together.values() for at in indices}
    items: list[bytes | str | int | float] = []
    for at, out in enumerate(replies):
        if at in packed_at:
            continue
        index = 0 if out.delivered else reply_keys.setdefault(out.reply_to, len(reply_keys) + 3)
        promote = out.waiters == "promote" and out.invocation is not None
        mode = out.waiters if out.waiters != "promote" or promote else "drop"
        count = answered.get(at, 0) if answered is not None and mode == "share" else None
        items += [
            index,
            out.reply[HEADER],
            out.reply[BODY],
            out.cache_entry,
            out.cache_ttl_s,
            out.in_flight,
            waiters(out.in_flight) if out.in_flight else "",
            mode if count is None else "counted",
            out.invocation[HEADER] if promote and out.invocation else ("" if count is None else count),
            out.invocation[BODY] if promote and out.invocation else "",
            out.reply_ttl_ms,
        ]
    packed: list[bytes | str | int | float] = [len(together)]
    for reply_to, indices in together.items():
        fields = [replies[at].reply for at in indices]
        packed += [
            reply_keys.setdefault(reply_to, len(reply_keys) + 3),
            b"[" + b",".join(reply[HEADER] for reply in fields) + b"]",
            b"".join(reply[BODY] for reply in fields),
        ]
    counters: list[bytes | str | int | float] = []
    for field, amount in statistics.increments.items() if statistics else ():
        counters += [field, amount]
    return ScriptCall(
        keys=[stream, queue_bytes(stream), *reply_keys, extra_count(stream)],
        args=[
            group,
            reply_maxlen,
            entry_bytes,
            len(items) // FINISH_ITEM,
            statistics.key if statistics else "",
            statistics.ended_ms if statistics else 0,
            len(counters) // 2,
            *counters,
            *items,
            *packed,
            extra,
            *entry_ids,
        ],
    )


def _packable(replies: Sequence[Outgoing]) -> dict[str, list[int]]:
    """The replies that travel packed (their indices), by reply stream: where a stream gets two or
    more replies that need nothing but delivery (no cache entry, no waiters, not kept as a result,
    not delivered already), one entry carries them all (HEADERS, BODIES) and the gateway reads one
    entry for the batch."""
    plain: dict[str, list[int]] = {}
    for at, out in enumerate(replies):
        if not (out.delivered or out.cache_entry or out.in_flight or out.reply_ttl_ms):
            plain.setdefault(out.reply_to, []).append(at)
    return {reply_to: indices for reply_to, indices in plain.items() if len(indices) > 1}


def entry_bytes(fields: Mapping[bytes, bytes]) -> int:
    """What an entry counts against max_queue_bytes."""
    return sum(len(fields.get(name, b"")) for name in (HEADER, BODY, STEP, SEQUENCE_STATE, HEADERS, BODIES))


def answered_id(fields: Mapping[bytes, bytes], reply_id: str) -> str:
    """The invocation a reply entry answers: the waiter it names, or the reply's own."""
    target = fields.get(FOR)
    return target.decode() if target else reply_id
