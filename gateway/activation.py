"""Scale from zero: know which runner pools have a live runner, and wake a pool that has none the
moment work arrives for it, instead of waiting for a scaler's poll.

The invocation itself waits in the queue; under the loading rule (docs/cold-start.md) a version that
no live runner has ready adds its load_timeout_s to the wait. A pool whose runner could not start
fails fast with 503 and Retry-After."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys
from fngate.backoff import Backoff, Health
from fngate.errors import Unavailable
from fngate.registry import READY, ModelState
from fngate.repository import FunctionVersion

log = logging.getLogger(__name__)
REFRESH_TIMEOUT_S = 1.0
"""A refresh that takes longer counts as a failure: a Redis that is paused answers nothing at all."""


class Activator:
    def __init__(self, redis: aioredis.Redis, refresh_s: float = 0.25, health: Health | None = None) -> None:
        self._redis = redis
        self._refresh_s = refresh_s
        self.health = health or Health("redis")
        self._live_pools: set[str] = set()
        self._ready: set[tuple[str, str]] = set()
        self._failures: dict[str, str] = {}
        self._woken: dict[str, float] = {}

    def check(self, pool: str) -> None:
        """Before an invocation is queued: a pool with no runner whose last start failed is 503."""
        failure = self._failures.get(pool)
        if failure and pool not in self._live_pools:
            self._woken.pop(pool, None)
            raise Unavailable(f"no runner could start for pool '{pool}' ({failure}); retrying the start")

    def load_wait_ms(self, function: FunctionVersion) -> int:
        """How long an invocation of `function` may wait for its model on top of its own deadline:
        nothing when a live runner has the version ready, else its load_timeout_s."""
        if (function.name, function.version) in self._ready:
            return 0
        return int(function.manifest.model.load_timeout_s * 1000)

    async def wake(self, pool: str) -> None:
        """After an invocation is queued: wake the pool if nothing serves it."""
        if pool in self._live_pools:
            return
        now = time.monotonic()
        if now - self._woken.get(pool, float("-inf")) < self._refresh_s:
            return  # asked already; the scaler starts one runner however many ask
        self._woken[pool] = now
        try:
            await self._redis.publish(keys.wake_channel(), pool)
        except RedisError as exc:
            log.warning("could not wake pool %s: %s", pool, exc)

    async def run(self) -> None:
        """Refresh the live pools and start failures every refresh_s, until cancelled. While Redis
        fails or does not answer, retry with backoff and report it in `health`; keep the last view."""
        backoff = Backoff()
        while True:
            try:
                async with asyncio.timeout(REFRESH_TIMEOUT_S):
                    await self.refresh()
            except (RedisError, OSError) as exc:  # OSError covers TimeoutError
                self.health.failed("activator", exc)
                await asyncio.sleep(backoff.failed())
                continue
            backoff.succeeded()
            self.health.succeeded()
            await asyncio.sleep(self._refresh_s)

    async def refresh(self) -> None:
        runners: Any = await self._redis.zrangebyscore(keys.runners(), int(time.time() * 1000), "+inf")
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in runners:
                pipe.hgetall(keys.runner_models(name.decode()))
            pipe.hgetall(keys.start_failures())
            results: list[Any] = await pipe.execute()
        self._live_pools = {fields[b"_pool"].decode() for fields in results[:-1] if fields.get(b"_pool")}
        self._ready = {
            tuple(field.decode().rsplit("/", 1))
            for fields in results[:-1]
            for field, raw in fields.items()
            if not field.startswith(b"_") and b"/" in field and ModelState.decode(raw).state == READY
        }
        self._failures = {pool.decode(): reason.decode() for pool, reason in results[-1].items()}
