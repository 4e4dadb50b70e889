"""A done asynchronous result as Redis keeps it: one string of its parts, each after its length (8 hex
digits): the gateway's record, the reply's header and body, then each callback attempt. Not a
stream (which holds at least 4 KiB: Redis allocates its first node whole), nor a hash (a third more
than the string for a small result). Charged to the submitting key's quota of result bytes. Written
by FINISH (fngate.queue.invocations) and, for a cached answer, SUBMIT_ASYNC; read by READ_RESULT
and RECORD_CALLBACK (fngate.queue.results)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

BELL_MS = 5000
"""How long a result stream outlives its reply: a long-poll that read the state just before it
still finds the reply's entry (one that comes later blocks on nothing, then reads the result)."""

# charge(quota, size, ttl_ms): `size` bytes held by `quota`'s key until ttl_ms from now.
# uncharge(quota, size, ttl_ms): `size` bytes it was charged until ttl_ms from now, freed now (a
# result dropped early); never below what its minute holds.
# held(quota, now_ms) -> bytes, ms until some are freed: what the key holds now (expired minutes
# dropped first). A quota is a hash (minute -> bytes, and 'total') and a sorted set of its minutes
# (`quota:at`), both kept as long as its last minute.
QUOTA_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function charge(quota, size, ttl_ms)
  local now = now_ms()
  local minute = math.ceil((now + ttl_ms) / 60000)
  redis.call('HINCRBY', quota, minute, size)
  redis.call('HINCRBY', quota, 'total', size)
  redis.call('ZADD', quota .. ':at', minute * 60000, minute)
  local keep = minute * 60000 - now + 60000
  if redis.call('PTTL', quota) < keep then
    redis.call('PEXPIRE', quota, keep)
    redis.call('PEXPIRE', quota .. ':at', keep)
  end
end
local function uncharge(quota, size, ttl_ms)  -- `size` bytes charged to expire ttl_ms from now, freed
  local minute = math.ceil((now_ms() + ttl_ms) / 60000)
  for m = minute - 1, minute + 1 do  -- its minute, or one beside it (a charge made a moment apart)
    local take = math.min(size, tonumber(redis.call('HGET', quota, m) or '0'))
    if take > 0 then
      redis.call('HINCRBY', quota, m, -take)
      redis.call('HINCRBY', quota, 'total', -take)
      size = size - take
    end
  end
end
local function held(quota, now)  -- a key's bytes count until the end of the minute they expire in
  local gone = redis.call('ZRANGEBYSCORE', quota .. ':at', '-inf', now)
  for _, minute in ipairs(gone) do
    redis.call('HINCRBY', quota, 'total', -tonumber(redis.call('HGET', quota, minute) or '0'))
    redis.call('HDEL', quota, minute)
  end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', quota .. ':at', '-inf', now) end
  local next = redis.call('ZRANGE', quota .. ':at', 0, 0, 'WITHSCORES')
  local wait = next[2] and (tonumber(next[2]) - now) or 1000
  return tonumber(redis.call('HGET', quota, 'total') or '0'), wait
end
"""

# packed(part) -> the part after its length; unpacked(stored) -> the parts of a stored result.
PACKED_LUA = """
local function packed(part)
  return string.format('%08x', #part) .. part
end
local function unpacked(stored)
  local parts, at = {}, 1
  while at + 7 <= #stored do
    local size = tonumber(string.sub(stored, at, at + 7), 16)
    parts[#parts + 1] = string.sub(stored, at + 8, at + 7 + size)
    at = at + 8 + size
  end
  return parts
end
"""

# store_result(stream, h, b, ttl_ms) -> nil | {quota, bytes, ttl_ms}: a reply to an asynchronous
# invocation, kept compactly (see above); nothing when its stream has gone (expired, so nobody may
# read it) or it was stored before (a redelivered entry answered twice: the first answer stays).
# Its bytes are charged to the quota its stream's first entry names: `k`, charged here (one Redis),
# or `kc`, a quota in another slot (a Redis Cluster's), answered for the caller to charge in a step
# of its own (fngate.queue.slots.CHARGE) once it is stored: only the call that stored it answers it.
STORE_RESULT_LUA = (
    QUOTA_LUA
    + PACKED_LUA
    + """
local function store_result(stream, h, b, ttl_ms)
  local first = redis.call('XRANGE', stream, '-', '+', 'COUNT', 1)
  local stored = stream .. ':done'
  if #first == 0 or redis.call('EXISTS', stored) == 1 then return end
  local record, quota, elsewhere = '', '', ''
  local fields = first[1][2]
  for i = 1, #fields, 2 do
    local name = fields[i]
    if name == 'm' then record = fields[i + 1] elseif name == 'k' then quota = fields[i + 1]
    elseif name == 'kc' then elsewhere = fields[i + 1] end
  end
  redis.call('SET', stored, packed(record) .. packed(h) .. packed(b), 'PX', ttl_ms)
  redis.call('XADD', stream, '*', 's', 'done')
  redis.call('PEXPIRE', stream, math.min("""
    + str(BELL_MS)
    + """, tonumber(ttl_ms)))
  if quota ~= '' then charge(quota, #record + #h + #b, tonumber(ttl_ms)) end
  if elsewhere ~= '' then return {elsewhere, #record + #h + #b, tonumber(ttl_ms)} end
  return nil
end
"""
)


@dataclasses.dataclass(frozen=True, slots=True)
class Charge:
    """A stored result's bytes, owed to its key's quota in another slot (store_result's answer)."""

    quota: str
    size: int
    ttl_ms: int


def parse_charges(raw: Sequence[Any]) -> list[Charge]:
    """store_result's answers, as a script passes them on ({quota, bytes, ttl_ms} each)."""
    return [Charge(text(quota), int(size), int(ttl_ms)) for quota, size, ttl_ms in raw]


def text(value: bytes | str) -> str:
    """A string of a Redis reply (redis-py answers bytes unless its client decodes)."""
    return value.decode() if isinstance(value, bytes) else value


def stored_result(result_stream: str) -> str:
    """Where a done result is kept (STORE_RESULT_LUA), beside its result stream."""
    return f"{result_stream}:done"
