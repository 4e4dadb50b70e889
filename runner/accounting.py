"""What a function's batches leave to record once they are answered: its model's custom metrics
(fngate.custom_metrics) and its batch time charged to the API keys of its invocations, split by
rows: wall time, and CPU time where the batch's backend measures it (a function in a process of
its own: the kernel's CPU clock of that process over the batch). Recorded off the batch's path: a
consumer hands each batch's share over and goes on, and one task adds what gathered to Redis in
one round trip, at most EVERY_S later (at once when a charged key has a compute budget, which
holds it to it: its bucket is marked `over` until the minute ends, and admission refuses it
meanwhile). A Redis outage loses what gathered then, logged."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import apikeys, custom_metrics, keys
from fngate.wire import Invocation

log = logging.getLogger(__name__)

EVERY_S = 1.0
"""How long what a batch left waits to go to Redis with the others' (a key with a budget: none)."""
BUDGETS_READ_S = 2.0
"""How often the keys' compute budgets are read (a new or changed one holds after this)."""


def charged(invocations: Sequence[Invocation], seconds: float, batched: bool) -> dict[str, float]:
    """`seconds` of a batch split over its invocations by rows (one each when not batched), summed
    by key; the shares of invocations without a key are left out."""
    rows = [invocation.rows if batched else 1 for invocation in invocations]
    total = sum(rows) or 1
    charges: dict[str, float] = {}
    for invocation, count in zip(invocations, rows, strict=True):
        if invocation.key_id:
            charges[invocation.key_id] = charges.get(invocation.key_id, 0.0) + seconds * count / total
    return charges


class Accounting:
    """One function's, in one runner."""

    def __init__(self, redis: aioredis.Redis, function: str) -> None:
        self._redis = redis
        self._function = function
        self._charges: dict[str, float] = {}
        self._cpu: dict[str, float] = {}
        """Key -> the CPU seconds charged to it, where the function's backend measures them."""
        self._bounds: dict[str, custom_metrics.Bounded] = {}
        """Per version: the custom metric families and series its model made here (capped)."""
        self._budgets: dict[str, float] = {}
        self._budgets_read = float("-inf")
        self._urgent = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def record_metrics(self, version: str, reported: Sequence[custom_metrics.Update]) -> None:
        """A batch's custom metric updates, written before its replies leave: Triton counts them
        inside `execute`, and a client that reads the metrics once answered finds them (Triton's
        custom_metrics example does). A Redis that does not answer loses them, logged."""
        if not reported:
            return
        updates = [update for update in reported if self._admitted(version, update)]
        if not updates:
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for command in custom_metrics.commands(keys.custom_metrics(self._function, version), updates):
                    pipe.execute_command(*command)
                await pipe.execute()
        except RedisError as exc:
            log.warning(
                "%s: %d custom metric updates were not recorded: %s", self._function, len(updates), exc
            )

    def record(
        self,
        version: str,
        invocations: Sequence[Invocation],
        seconds: float,
        batched: bool,
        cpu_s: float | None = None,
    ) -> None:
        """A batch's share, from its consumer once the batch is answered; returns at once."""
        if cpu_s:
            for key_id, share in charged(invocations, cpu_s, batched).items():
                self._cpu[key_id] = self._cpu.get(key_id, 0.0) + share
        if seconds and any(invocation.key_id for invocation in invocations):
            stale = time.monotonic() - self._budgets_read > BUDGETS_READ_S
            for key_id, share in charged(invocations, seconds, batched).items():
                self._charges[key_id] = self._charges.get(key_id, 0.0) + share
                if stale or key_id in self._budgets:
                    self._urgent.set()
        if (self._charges or self._cpu) and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(
                self._soon(), name=f"account {self._function}"
            )

    async def close(self) -> None:
        """Record what gathered, now."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._flush()

    def _admitted(self, version: str, update: custom_metrics.Update) -> bool:
        bounds = self._bounds.setdefault(version, custom_metrics.Bounded())
        refused = bounds.admit(update)
        if refused is not None and refused not in bounds.said:
            bounds.said.add(refused)
            log.warning("%s version %s: custom metrics dropped: %s", self._function, version, refused)
        return refused is None

    async def _soon(self) -> None:
        while self._charges or self._cpu:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), EVERY_S)
            self._urgent.clear()
            await self._flush()

    async def _flush(self) -> None:
        charges, self._charges = self._charges, {}
        cpu, self._cpu = self._cpu, {}
        if not (charges or cpu):
            return
        try:
            if charges and time.monotonic() - self._budgets_read > BUDGETS_READ_S:
                await self._read_budgets()
            minute = int(time.time() // 60)
            async with self._redis.pipeline(transaction=False) as pipe:
                for key_id, share in charges.items():
                    pipe.hincrbyfloat(keys.key_usage(key_id), self._function, share)
                    pipe.hincrbyfloat(keys.key_usage_minute(key_id, minute), self._function, share)
                    pipe.hincrbyfloat(keys.key_usage_minute(key_id, minute), apikeys.ALL_FUNCTIONS, share)
                    pipe.expire(keys.key_usage_minute(key_id, minute), keys.USAGE_KEPT_S)
                for key_id, share in cpu.items():  # after the charges: _hold_to_budgets counts on it
                    pipe.hincrbyfloat(keys.key_cpu(key_id), self._function, share)
                    pipe.hincrbyfloat(keys.key_cpu_minute(key_id, minute), self._function, share)
                    pipe.expire(keys.key_cpu_minute(key_id, minute), keys.USAGE_KEPT_S)
                added = await pipe.execute()
            await self._hold_to_budgets(charges, added, (minute + 1) * 60_000)
        except RedisError as exc:
            log.warning(
                "%s: %d keys' batch time was not recorded: %s", self._function, len(charges | cpu), exc
            )

    async def _hold_to_budgets(self, charges: dict[str, float], added: list[Any], ends_ms: int) -> None:
        """A key whose minute (the third answer of its four commands) passed its budget is refused
        until the minute ends."""
        for index, key_id in enumerate(charges):
            budget = self._budgets.get(key_id, 0.0)
            if budget and float(added[index * 4 + 2]) >= budget:
                await self._redis.hset(keys.key_rate(key_id), "over", ends_ms)
                await self._redis.pexpireat(keys.key_rate(key_id), ends_ms + 1000)

    async def _read_budgets(self) -> None:
        """The keys' compute budgets (apikeys.KeyRecord.compute_s_per_min), kept through an outage."""
        self._budgets_read = time.monotonic()
        raw: Any = await self._redis.hgetall(keys.api_keys())
        budgets = {}
        for value in raw.values():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = apikeys.KeyRecord.decode(value)
                if record.compute_s_per_min > 0:
                    budgets[record.id] = record.compute_s_per_min
        self._budgets = budgets
