"""The response cache: cache_key() and request_key() (pure), and lookups in a cache Redis of its
own that fail open.

When the cache shares the queue's Redis, the lookup is part of the enqueue script instead (one
round trip); see gateway.dispatch.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate.cache_key import cache_key
from fngate.repository import FunctionVersion
from fngate.tensors import Tensors
from fngate.wire import Fields
from gateway.metrics import CACHE_FAILURES

# cache_key lives in fngate: runners use it too.
__all__ = ["CacheHealth", "SeparateCache", "cache_key", "request_key"]
log = logging.getLogger(__name__)
COMPLAIN_EVERY_S = 30.0


def request_key(function: FunctionVersion, inputs: Tensors, outputs: tuple[str, ...] | None) -> str:
    """The cache key of a request to this version ('' while its cache is off): synchronous,
    asynchronous and pipeline invocations key alike."""
    manifest = function.manifest
    if not manifest.cache.enabled:
        return ""
    return cache_key(manifest.name, function.version, function.digest, inputs, outputs)


class CacheHealth:
    """Counts cache failures (fngate_cache_failures_total) and logs them at most once per interval:
    a cache that is down must not flood the log, nor fail a single request."""

    def __init__(self) -> None:
        self.failures = 0
        self._last_complaint = 0.0

    def failed(self, exc: Exception) -> None:
        self.failures += 1
        CACHE_FAILURES.inc()
        now = time.monotonic()
        if now - self._last_complaint >= COMPLAIN_EVERY_S:
            self._last_complaint = now
            log.warning(
                "response cache unavailable (%s); serving from runners (%d failures)", exc, self.failures
            )


class SeparateCache:
    """Lookups in a cache Redis that is not the queue's."""

    def __init__(self, redis: aioredis.Redis, health: CacheHealth) -> None:
        self._redis = redis
        self._health = health

    async def get(self, key: str) -> Fields | None:
        try:
            header, body = await self._redis.hmget(key, ["h", "b"])
        except (RedisError, OSError) as exc:
            self._health.failed(exc)
            return None
        if header is None:
            return None
        return {b"h": header, b"b": body or b""}

    async def aclose(self) -> None:
        await self._redis.aclose()
