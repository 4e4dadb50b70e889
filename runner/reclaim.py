"""What other runners left behind, for one function's consumer: entries a runner read and never
acknowledged (it died, or hangs) are claimed once idle for claim_idle_ms and run alone; one
delivered more than max_deliveries times is answered with an error and moved to the dead-letter
stream instead."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis

from fngate import keys, queue
from fngate.config import RunnerSettings
from fngate.errors import ModelFailed
from fngate.wire import Fields, Invocation, Reply
from runner.outbox import Entry

log = logging.getLogger(__name__)

Accept = Callable[[Iterable[tuple[bytes, Fields | None]], bool, int], Awaitable[None]]
"""FunctionConsumer._accept(entries, alone, level)."""
Send = Callable[[Sequence[Entry], Sequence[Reply]], Awaitable[None]]
"""FunctionConsumer._send(entries, replies)."""


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
        counts: Any = await self._redis.xpending_range(
            stream, keys.RUNNER_GROUP, claimed[0][0], claimed[-1][0], len(claimed) + 64, self._consumer
        )
        deliveries = {item["message_id"]: item["times_delivered"] for item in counts}
        poisoned = [
            (entry_id, fields)
            for entry_id, fields in claimed
            if deliveries.get(entry_id, 1) > self._settings.max_deliveries
        ]
        if poisoned:
            await self._dead_letter(poisoned, level)
        poisoned_ids = {entry_id for entry_id, _ in poisoned}
        await self._accept(
            ((entry_id, fields) for entry_id, fields in claimed if entry_id not in poisoned_ids), True, level
        )

    async def _dead_letter(self, entries: Sequence[tuple[bytes, Fields]], level: int) -> None:
        limit = self._settings.max_deliveries
        log.error(
            "%s: %d invocations were delivered more than %d times; dead-lettered",
            self._function,
            len(entries),
            limit,
        )
        async with self._redis.pipeline(transaction=False) as pipe:
            for _entry_id, fields in entries:
                pipe.xadd(keys.dead_letters(self._function), {**fields, b"reason": b"max_deliveries"})
            await pipe.execute()
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
        error = ModelFailed(f"the invocation was delivered {limit} times and no runner finished it")
        replies = [Reply(entry.invocation.id, entry.invocation.version, {}, error) for entry in dead]
        await self._send(dead, replies)
