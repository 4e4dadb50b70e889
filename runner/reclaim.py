"""What other runners left behind, for one function's consumer: entries a runner read and never
acknowledged (it died, or hangs) are claimed once idle for claim_idle_ms and run alone; one that
has run max_deliveries times without its runner finishing it is answered with an error and moved to
the dead-letter stream instead.

What counts is runs, not deliveries: every run of an entry alone is noted in its stream's runs hash
(fngate.queue.entry_runs) before it starts, and its first delivery counts as one run (it ran in a
batch, or waited behind one, when its runner died). An entry claimed again because its runner died
running another one (it only waited there) has not run more: batch mates of a poison invocation
are never dead-lettered for it."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys, queue
from fngate.config import RunnerSettings
from fngate.errors import ModelFailed
from fngate.wire import Fields, Invocation, Reply
from runner.outbox import Entry

log = logging.getLogger(__name__)

Accept = Callable[[Iterable[tuple[bytes, Fields | None]], bool, int, Collection[bytes]], Awaitable[None]]
"""FunctionConsumer._accept(entries, alone, level, poisoned)."""
Send = Callable[[Sequence[Entry], Sequence[Reply]], Awaitable[None]]
"""FunctionConsumer._send(entries, replies)."""
RUNS_TTL_MS = 8 * 86400 * 1000
"""A runs hash outlives the longest deadline an entry can have (async_timeout_s at most 7 days)."""


def member_ids(entry_id: bytes, fields: Fields) -> list[bytes]:
    """The ids runs are counted under: an entry's own, or each of a grouped entry's invocations'
    (`<id>/<index>`); none for a grouped entry that does not decode (dead-lettered as read)."""
    if queue.HEADERS not in fields:
        return [entry_id]
    try:
        count = len(orjson.loads(fields[queue.HEADERS]))
    except (orjson.JSONDecodeError, TypeError):
        return []
    return [entry_id + b"/%d" % at for at in range(count)]


class Reclaimer:
    def __init__(
        self,
        redis: aioredis.Redis,
        function: str,
        streams: Sequence[str],
        consumer: str,
        settings: RunnerSettings,
        accept: Accept,
        send: Send,
    ) -> None:
        self._redis = redis
        self._function = function
        self._streams = streams
        self._consumer = consumer
        self._settings = settings
        self._accept = accept
        self._send = send
        self.last_claim = 0.0
        """When claims last ran (monotonic); 0: never yet."""

    async def due(self, held: Callable[[int], list[bytes]]) -> None:
        """Every claim_interval_ms, take over at every level what runners that died left
        unacknowledged (Entry.alone). `held(level)`: the ids this consumer holds at that level."""
        now = time.monotonic()
        if now - self.last_claim < self._settings.claim_interval_ms / 1000:
            return
        self.last_claim = now
        for level in range(len(self._streams)):
            await self._claim_level(level, held(level))

    async def _claim_level(self, level: int, held: list[bytes]) -> None:
        stream = self._streams[level]
        if held:
            # Reset the idle time of what we hold (JUSTID: no delivery is counted), so that neither
            # we nor another runner claim an invocation that is only waiting or running long here.
            ids: list[bytes | str | int | memoryview] = list(held)
            await self._redis.xclaim(stream, keys.RUNNER_GROUP, self._consumer, 0, ids, justid=True)
        _next, claimed, _deleted = await self._redis.xautoclaim(
            stream, keys.RUNNER_GROUP, self._consumer, self._settings.claim_idle_ms, "0-0", count=100
        )
        claimed = [(entry_id, fields) for entry_id, fields in claimed if fields]
        if not claimed:
            return
        log.warning(
            "%s: claimed %d invocations another runner left unacknowledged", self._function, len(claimed)
        )
        # Runs are counted per invocation: a grouped entry's each (`<id>/<index>`) for itself.
        members = [member for entry_id, fields in claimed for member in member_ids(entry_id, fields)]
        counts: Any = await self._redis.hmget(queue.entry_runs(stream), members) if members else []
        over = {
            member
            for member, alone_runs in zip(members, counts, strict=True)
            if 1 + int(alone_runs or 0) >= self._settings.max_deliveries
        }
        poisoned = [(entry_id, fields) for entry_id, fields in claimed if entry_id in over]
        if poisoned:
            await self._dead_letter(poisoned, level)
        await self._accept(
            ((entry_id, fields) for entry_id, fields in claimed if entry_id not in over), True, level, over
        )

    async def note_runs(self, entries: Sequence[Entry]) -> None:
        """Count a run of each of these entries, which run alone now (before they start: a run that
        takes its runner down counts)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for entry in entries:
                    runs = queue.entry_runs(self._streams[entry.level])
                    pipe.hincrby(runs, entry.id.decode(), 1)
                    pipe.pexpire(runs, RUNS_TTL_MS)
                await pipe.execute()
        except (RedisError, OSError) as exc:  # not counted: at worst one more run before a dead letter
            log.warning("%s: could not count %d runs (%s)", self._function, len(entries), exc)

    async def forget_runs(self, entries: Sequence[Entry]) -> None:
        """These entries are answered: their runs no longer matter."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for entry in entries:
                    pipe.hdel(queue.entry_runs(self._streams[entry.level]), entry.id.decode())
                await pipe.execute()
        except (RedisError, OSError):  # the hash expires
            pass

    async def _dead_letter(self, entries: Sequence[tuple[bytes, Fields]], level: int) -> None:
        dead = [
            Entry(
                entry_id,
                Invocation.decode(fields),
                queue.entry_bytes(fields),
                level=level,
                step=fields.get(queue.STEP, b""),
            )
            for entry_id, fields in entries
        ]
        await self.dead_letter(dead, [fields for _, fields in entries])

    async def dead_letter(self, dead: Sequence[Entry], fields: Sequence[Fields] | None = None) -> None:
        """Answer these invocations, which ran max_deliveries times, with an error, and move them to
        the dead-letter stream (as their entries' `fields`, or each invocation encoded)."""
        limit = self._settings.max_deliveries
        log.error(
            "%s: %d invocations ran %d times and no runner finished them; dead-lettered",
            self._function,
            len(dead),
            limit,
        )
        moved = fields if fields is not None else [entry.invocation.encode() for entry in dead]
        async with self._redis.pipeline(transaction=False) as pipe:
            for item in moved:
                pipe.xadd(keys.dead_letters(self._function), {**item, b"reason": b"max_deliveries"})
            await pipe.execute()
        error = ModelFailed(
            f"the invocation ran {limit} times and no runner finished it (max_deliveries); dead-lettered"
        )
        replies = [Reply(entry.invocation.id, entry.invocation.version, {}, error) for entry in dead]
        await self._send(dead, replies)
        await self.forget_runs(dead)
