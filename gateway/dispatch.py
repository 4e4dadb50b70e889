"""Append an invocation to its function's stream and await its reply before the deadline; answer
from the response cache, or wait on an identical invocation already in flight, when it can."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import redis.asyncio as aioredis
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from redis.exceptions import RedisError

from fngate import keys, telemetry
from fngate.errors import DeadlineExceeded, Overloaded, Unavailable
from fngate.repository import FunctionVersion
from fngate.wire import Invocation, Reply, Tensors
from gateway.activation import Activator
from gateway.cache import SeparateCache, cache_key
from gateway.replies import ReplyRouter

# One round trip for the whole decision. KEYS: the stream, the cache entry ('' to skip the
# lookup), the in-flight marker and its waiters list ('' for no coalescing). ARGV: max queue size,
# header, body, this invocation as a waiter ("reply_stream id"), marker TTL in ms.
# Entries leave the stream when a runner acknowledges them, so XLEN counts queued or in flight.
ENQUEUE = """
if KEYS[2] ~= '' then
  local hit = redis.call('HMGET', KEYS[2], 'h', 'b')
  if hit[1] then return {'hit', hit[1], hit[2]} end
end
if KEYS[3] ~= '' then
  if not redis.call('SET', KEYS[3], '1', 'NX', 'PX', ARGV[5]) then
    redis.call('RPUSH', KEYS[4], ARGV[4])
    redis.call('PEXPIRE', KEYS[4], ARGV[5])
    return {'wait'}
  end
end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  if KEYS[3] ~= '' then redis.call('DEL', KEYS[3]) end
  return {'full'}
end
redis.call('XADD', KEYS[1], '*', 'h', ARGV[2], 'b', ARGV[3])
return {'queued'}
"""


tracer = trace.get_tracer("fngate.gateway")
REDIS = {"db.system.name": "redis"}


class Dispatcher:
    def __init__(
        self,
        redis: aioredis.Redis,
        replies: ReplyRouter,
        cache: SeparateCache | None = None,
        activator: Activator | None = None,
    ) -> None:
        self._replies = replies
        self._activator = activator
        self._enqueue = redis.register_script(ENQUEUE)
        self._separate_cache = cache

    async def submit(
        self,
        function: FunctionVersion,
        inputs: Tensors,
        outputs: tuple[str, ...] | None,
        timeout_ms: int | None,
        use_cache: bool = True,
    ) -> Reply:
        """Answer one invocation; raises the FunctionError it failed with.

        With the function's cache on, a cached answer is returned at once and an identical
        invocation in flight is waited on; use_cache=False skips both but still stores the answer."""
        manifest = function.manifest
        limit_ms = manifest.batching.timeout_ms
        timeout_ms = limit_ms if timeout_ms is None else min(timeout_ms, limit_ms)
        entry = in_flight = ""
        if manifest.cache.enabled:
            key_hex = cache_key(manifest.name, function.version, function.digest, inputs, outputs)
            entry = keys.cache_entry(manifest.name, key_hex)
            in_flight = keys.in_flight(manifest.name, key_hex) if use_cache else ""
        invocation = Invocation(
            id=uuid.uuid4().hex,
            function=manifest.name,
            version=function.version,
            reply_to=self._replies.stream,
            deadline_ms=int(time.time() * 1000) + timeout_ms,
            inputs=inputs,
            outputs=outputs,
            traceparent=telemetry.inject(),
            digest=function.digest,
            cache_key=entry or None,
            cache_ttl_s=manifest.cache.ttl_s,
            in_flight_key=in_flight or None,
        )
        if entry and use_cache and self._separate_cache is not None:
            with tracer.start_as_current_span("cache lookup", kind=SpanKind.CLIENT, attributes=REDIS) as span:
                hit = await self._separate_cache.get(entry)
                span.set_attribute("fngate.cache_hit", hit is not None)
            if hit is not None:
                return dataclasses.replace(Reply.decode(hit), cached=True)
        pool = manifest.scaling.pool
        if self._activator is not None:
            self._activator.check(pool)
        lookup = entry if use_cache and self._separate_cache is None else ""
        fields = invocation.encode()
        future = self._replies.expect(invocation.id)
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                try:
                    with tracer.start_as_current_span(
                        f"enqueue {manifest.name}", kind=SpanKind.PRODUCER, attributes=REDIS
                    ) as span:
                        outcome = await self._enqueue(
                            keys=[
                                keys.invocations(manifest.name),
                                lookup,
                                in_flight,
                                keys.waiters(in_flight) if in_flight else "",
                            ],
                            args=[
                                manifest.batching.max_queue_size,
                                fields[b"h"],
                                fields[b"b"],
                                f"{self._replies.stream} {invocation.id}",
                                timeout_ms,
                            ],
                        )
                except RedisError as exc:
                    raise Unavailable(f"the queue is unavailable: {exc}") from exc
                if outcome[0] == b"hit":
                    return dataclasses.replace(
                        Reply.decode({b"h": outcome[1], b"b": outcome[2]}), cached=True
                    )
                if outcome[0] == b"full":
                    raise Overloaded(
                        f"function '{manifest.name}' has {manifest.batching.max_queue_size} invocations "
                        "queued (max_queue_size); retry later"
                    )
                if self._activator is not None:
                    await self._activator.wake(pool)
                reply = await future
        except TimeoutError:
            raise DeadlineExceeded(
                f"function '{manifest.name}' did not answer within {timeout_ms} ms"
            ) from None
        finally:
            self._replies.forget(invocation.id)
        if reply.error is not None:
            raise reply.error
        return reply
