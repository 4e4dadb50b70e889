"""A batch's way out: its replies, its answers for the response cache, the invocations that waited
on identical ones, and the acknowledgement of its entries, all in one Redis round trip."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import clients, delivery, keys, queue
from fngate.config import RunnerSettings
from fngate.errors import DeadlineExceeded
from fngate.fastredis import FastRedis, Script
from fngate.wire import Fields, Invocation, Reply
from runner.metrics import CACHE_STORE_FAILURES
from runner.pipeline import Finished, Steps

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """An invocation read from the stream and not yet answered."""

    id: bytes
    invocation: Invocation
    size: int
    """What it counts against max_queue_bytes (fngate.queue.entry_bytes)."""
    alone: bool = False
    """Redelivered, or split out of a batch that failed: runs in a batch of its own
    (runner.batching.Pending)."""
    level: int = 0
    """The priority level whose stream it came from (fngate.keys.levels)."""
    step: bytes = b""
    """A pipeline step's context (fngate.queue.STEP); b"" for an invocation of its own."""
    unit: bytes = b""
    """The id of the grouped entry it is one of (then `id` is `<unit>/<index>`); b"" when it has
    its entry to itself, whose id is `id`."""

    @property
    def entry_id(self) -> bytes:
        """Its entry on the stream."""
        return self.unit or self.id


class Outbox:
    def __init__(self, redis: FastRedis, stream: str, settings: RunnerSettings) -> None:
        self._stream = stream
        self._reply_maxlen = settings.reply_maxlen
        self._finish = Script(redis, queue.FINISH)
        self._across_slots = delivery.scripts(redis) if redis.cluster else None
        """A Redis Cluster's FINISH, in steps (fngate.delivery)."""
        separate = settings.cache_url and settings.cache_url != settings.redis_url
        self._cache = clients.connect(settings.cache_url, socket_timeout=1) if separate else None
        self._steps = Steps(redis, caching=self._cache is None)  # pipeline steps (runner.pipeline)

    async def aclose(self) -> None:
        if self._cache is not None:
            await self._cache.aclose()

    async def send(
        self,
        entries: Sequence[Entry],
        replies: Sequence[Reply],
        ran_digest: str = "",
        statistics: queue.Statistics | None = None,
        acks: tuple[Sequence[bytes], int] | None = None,
    ) -> None:
        """Write every reply, store cacheable answers, answer invocations that waited on these, and
        acknowledge (and delete) the entries, in one round trip. Shielded: once a batch ran, its
        replies go out even if this task is being cancelled. `acks`: the entry ids to acknowledge
        and the invocations they hold beyond one each (grouped entries), when not the entries'
        own ids."""
        outgoing: list[queue.Outgoing] = []
        separate: list[tuple[str, Fields, int]] = []
        steps = [
            Finished(entry.id, entry.step, entry.invocation, reply)
            for entry, reply in zip(entries, replies, strict=True)
            if entry.step
        ]
        if steps:  # the next steps are queued before these entries are acknowledged
            outgoing += await asyncio.shield(self._steps.finish(steps, ran_digest))
        for entry, reply in zip(entries, replies, strict=True):
            if entry.step:
                continue
            invocation = entry.invocation
            fields = reply.encode()
            # Only an answer of the very files the gateway keyed on may be cached: during a
            # rollout a runner can still hold the previous model.
            cacheable = reply.error is None and invocation.digest == ran_digest
            cache_entry = invocation.cache_key if cacheable and invocation.cache_key else ""
            if cache_entry and self._cache is not None:
                separate.append((cache_entry, fields, invocation.cache_ttl_s))
                cache_entry = ""
            # Identical invocations share a failure, but not a deadline: theirs may be later, so one
            # of them runs in place of an invocation that expired. An asynchronous invocation's one
            # waiter is its callback, which is told of the failure like of any other answer.
            promote = isinstance(reply.error, DeadlineExceeded) and not invocation.result_ttl_s
            outgoing.append(
                queue.Outgoing(
                    fields,
                    invocation.reply_to,
                    cache_entry,
                    invocation.cache_ttl_s,
                    invocation.in_flight_key or "",
                    "promote" if promote else "share",
                    invocation.encode() if promote and invocation.in_flight_key else None,
                    invocation.result_ttl_s * 1000,
                )
            )
        if separate and self._cache is not None:
            # Stored before the replies go out, so that a repeat of the request right after its
            # answer already hits.
            await asyncio.shield(self._store_separately(self._cache, separate))
        ids, extra = acks if acks is not None else ([entry.id for entry in entries], 0)
        size = sum(entry.size for entry in entries)
        if self._across_slots is not None:
            await asyncio.shield(
                delivery.finish(
                    self._across_slots,
                    self._stream,
                    keys.RUNNER_GROUP,
                    outgoing,
                    ids,
                    size,
                    self._reply_maxlen,
                    statistics,
                    extra,
                )
            )
            return
        call = queue.finish_call(
            self._stream, keys.RUNNER_GROUP, outgoing, ids, size, self._reply_maxlen, statistics, extra=extra
        )
        await asyncio.shield(self._finish(call.keys, call.args))

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
