"""A batch's way out: its replies, its answers for the response cache, the invocations that waited
on identical ones, and the acknowledgement of its entries, all in one Redis round trip."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys
from fngate.config import RunnerSettings
from fngate.errors import DeadlineExceeded
from fngate.wire import Fields, Invocation, Reply
from runner.metrics import CACHE_STORE_FAILURES

log = logging.getLogger(__name__)

# KEYS[1]: the invocation stream; KEYS[2..]: reply streams. ARGV: group, reply maxlen, the number
# of replies n, then n groups of eight (index into KEYS, header, body, cache entry or '',
# its TTL in s, in-flight marker or '', its waiters list, '1' to answer the waiters too), then the
# entry ids to acknowledge and delete. One command per batch, however many replies it carries.
FINISH = """
local n = tonumber(ARGV[3])
local maxlen = ARGV[2]
for i = 0, n - 1 do
  local at = 4 + i * 8
  local h, b = ARGV[at + 1], ARGV[at + 2]
  redis.call('XADD', KEYS[tonumber(ARGV[at])], 'MAXLEN', '~', maxlen, '*', 'h', h, 'b', b)
  if ARGV[at + 3] ~= '' then
    redis.call('HSET', ARGV[at + 3], 'h', h, 'b', b)
    redis.call('EXPIRE', ARGV[at + 3], ARGV[at + 4])
  end
  if ARGV[at + 5] ~= '' then
    if ARGV[at + 7] == '1' then
      for _, waiter in ipairs(redis.call('LRANGE', ARGV[at + 6], 0, -1)) do
        local stream, id = string.match(waiter, '^(%S+) (%S+)$')
        redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'h', h, 'b', b, 'for', id)
      end
    end
    redis.call('DEL', ARGV[at + 5], ARGV[at + 6])
  end
end
local ids = {}
for i = 4 + n * 8, #ARGV do ids[#ids + 1] = ARGV[i] end
if #ids > 0 then
  redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
  redis.call('XDEL', KEYS[1], unpack(ids))
end
return n
"""


class Outbox:
    def __init__(self, redis: aioredis.Redis, stream: str, settings: RunnerSettings) -> None:
        self._stream = stream
        self._reply_maxlen = settings.reply_maxlen
        self._finish = redis.register_script(FINISH)
        separate = settings.cache_url and settings.cache_url != settings.redis_url
        self._cache = aioredis.from_url(settings.cache_url, socket_timeout=1) if separate else None

    async def aclose(self) -> None:
        if self._cache is not None:
            await self._cache.aclose()

    async def send(
        self,
        replies: Sequence[Reply],
        entry_ids: list[bytes],
        invocations: Sequence[Invocation],
        ran_digest: str = "",
    ) -> None:
        """Write every reply, store cacheable answers, answer invocations that waited on these, and
        acknowledge (and delete) the entries, in one round trip. Shielded: once a batch ran, its
        replies go out even if this task is being cancelled."""
        reply_keys: dict[str, int] = {}
        groups: list[bytes | str | int] = []
        separate: list[tuple[str, Fields, int]] = []
        for reply, invocation in zip(replies, invocations, strict=True):
            index = reply_keys.setdefault(invocation.reply_to, len(reply_keys) + 2)
            fields = reply.encode()
            # Only an answer of the very files the gateway keyed on may be cached: during a
            # rollout a runner can still hold the previous model.
            cacheable = reply.error is None and invocation.digest == ran_digest
            entry = invocation.cache_key if cacheable and invocation.cache_key else ""
            if entry and self._cache is not None:
                separate.append((entry, fields, invocation.cache_ttl_s))
                entry = ""
            in_flight = invocation.in_flight_key or ""
            # Identical invocations share a failure, but not a deadline: theirs may be later.
            share = not isinstance(reply.error, DeadlineExceeded)
            groups += [
                index,
                fields[b"h"],
                fields[b"b"],
                entry,
                invocation.cache_ttl_s,
                in_flight,
                keys.waiters(in_flight) if in_flight else "",
                "1" if share else "0",
            ]
        if separate and self._cache is not None:
            # Stored before the replies go out, so that a repeat of the request right after its
            # answer already hits.
            await asyncio.shield(self._store_separately(self._cache, separate))
        await asyncio.shield(
            self._finish(
                keys=[self._stream, *reply_keys],
                args=[keys.RUNNER_GROUP, self._reply_maxlen, len(replies), *groups, *entry_ids],
            )
        )

    async def _store_separately(self, cache: aioredis.Redis, entries: list[tuple[str, Fields, int]]) -> None:
        """Answers for a cache Redis of its own: best effort, a cache that is down costs nothing."""
        try:
            async with cache.pipeline(transaction=False) as pipe:
                for entry, fields, ttl_s in entries:
                    pipe.hset(entry, mapping={"h": fields[b"h"], "b": fields[b"b"]})
                    pipe.expire(entry, ttl_s)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            CACHE_STORE_FAILURES.inc()
            log.debug("%s: could not store %d answers in the cache: %s", self._stream, len(entries), exc)
