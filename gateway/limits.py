"""Per-key limits counted in Redis, so that they hold in total across every gateway: a rate with a
burst, a cap on invocations in flight, and a share of each function's queue. The Lua is one function
that the enqueue script can include; here it also runs as a script of its own."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys
from fngate.errors import Unavailable
from gateway.auth import Principal, RateLimited

log = logging.getLogger(__name__)

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
ADMIT_SCRIPT = (
    ADMIT_LUA + "return admit(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[1]), tonumber(ARGV[2]), "
    "tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]))\n"
)


def admission(principal: Principal, function: str, member: str, ttl_ms: int) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ADMIT_SCRIPT for one invocation of `function` by `principal`; `member`
    names it in the key's sets until released or `ttl_ms` passes."""
    ident = principal.key_id
    return (
        [keys.key_rate(ident), keys.key_in_flight(ident), keys.key_share(ident, function)],
        [principal.rps, principal.burst, principal.max_in_flight, principal.max_queued, member, ttl_ms],
    )


def admitted(principal: Principal, function: str, outcome: list[Any]) -> None:
    """Raise RateLimited for a refusal from ADMIT_SCRIPT (or the enqueue script that includes it)."""
    verdict = outcome[0].decode() if isinstance(outcome[0], bytes) else outcome[0]
    if verdict == "ok":
        return
    retry_after_s = max(1, -(-int(outcome[1]) // 1000))
    who = f"the API key {principal.key_id}"
    if verdict == "rate":
        message = (
            f"{who} is over its rate of {principal.rps:g} invocations per second "
            f"(burst {principal.burst}); retry in {retry_after_s} s"
        )
    elif verdict == "share":
        message = (
            f"{who} has {principal.max_queued} invocations of '{function}' queued or running "
            "(max_queued); retry later"
        )
    else:
        message = f"{who} has {principal.max_in_flight} invocations in flight (max_in_flight); retry later"
    raise RateLimited(message, retry_after_s)


class Limiter:
    """Runs ADMIT_SCRIPT as its own call before an invocation is dispatched, and takes the
    invocation out of the key's sets when it is over."""

    def __init__(self, in_flight_ttl_s: float) -> None:
        self._redis: aioredis.Redis | None = None
        self._script: Any = None
        self._ttl_ms = int(in_flight_ttl_s * 1000)

    def bind(self, redis: aioredis.Redis) -> None:
        """Use this client (the invocations' pool), once the lifespan has opened it."""
        self._redis = redis
        self._script = redis.register_script(ADMIT_SCRIPT)

    async def admit(self, principal: Principal, function: str) -> str:
        """The member to release when the invocation is over; raises RateLimited or Unavailable."""
        if self._script is None:
            raise Unavailable("the rate limiter is not connected to Redis yet")
        member = uuid.uuid4().hex
        script_keys, args = admission(principal, function, member, self._ttl_ms)
        try:
            outcome = await self._script(keys=script_keys, args=args)
        except RedisError as exc:
            raise Unavailable(f"the rate limiter is unavailable: {exc}") from exc
        admitted(principal, function, outcome)
        return member

    async def release(self, principal: Principal, function: str, member: str) -> None:
        if self._redis is None or not (principal.max_in_flight or principal.max_queued):
            return
        ident = principal.key_id
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.zrem(keys.key_in_flight(ident), member)
                pipe.zrem(keys.key_share(ident, function), member)
                await pipe.execute()
        except RedisError as exc:  # the member lapses at its expiry
            log.warning("could not release an invocation of key %s: %s", ident, exc)
