"""The response cache: cache_key() (pure), and lookups in a cache Redis of its own that fail open.

When the cache shares the queue's Redis, the lookup is part of the enqueue script instead (one
round trip); see gateway.dispatch.
"""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate.tensors import datatype_of, to_bytes
from fngate.wire import Fields, Tensors
from gateway.metrics import CACHE_FAILURES

log = logging.getLogger(__name__)
COMPLAIN_EVERY_S = 30.0


def cache_key(
    function: str, version: str, digest: str, inputs: Tensors, outputs: tuple[str, ...] | None
) -> str:
    """BLAKE2b-256 over everything that decides the answer: function, version, the version's
    artifact digest, each input (sorted by name) with its datatype, shape and bytes, and the
    requested outputs. Fields are length-prefixed, so no two different requests share a preimage."""
    digest_of = hashlib.blake2b(digest_size=32, person=b"fngate-cache-v1")

    def part(data: bytes) -> None:
        digest_of.update(len(data).to_bytes(8, "little"))
        digest_of.update(data)

    for text in (function, version, digest):
        part(text.encode())
    for name in sorted(inputs):
        array = inputs[name]
        part(name.encode())
        part(datatype_of(array).encode())
        part(np.asarray(array.shape, dtype="<i8").tobytes())
        part(to_bytes(array))
    part(b"\x00".join(name.encode() for name in sorted(outputs)) if outputs is not None else b"\xff*")
    return digest_of.hexdigest()


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
