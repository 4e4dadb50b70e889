"""Append an invocation to its function's stream and await its reply before the deadline."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys
from fngate.errors import DeadlineExceeded, Overloaded, Unavailable
from fngate.repository import FunctionVersion
from fngate.wire import Invocation, Reply, Tensors
from gateway.replies import ReplyRouter

# One round trip: refuse when the queue is full, else append. Entries leave the stream when a
# runner acknowledges them, so XLEN counts what is queued or in flight.
ENQUEUE = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return false end
return redis.call('XADD', KEYS[1], '*', 'h', ARGV[2], 'b', ARGV[3])
"""


class Dispatcher:
    def __init__(self, redis: aioredis.Redis, replies: ReplyRouter) -> None:
        self._replies = replies
        self._enqueue = redis.register_script(ENQUEUE)

    async def submit(
        self,
        function: FunctionVersion,
        inputs: Tensors,
        outputs: tuple[str, ...] | None,
        timeout_ms: int | None,
        traceparent: str | None = None,
    ) -> Reply:
        """Queue one invocation and wait for its reply; raises the FunctionError it failed with."""
        manifest = function.manifest
        limit_ms = manifest.batching.timeout_ms
        timeout_ms = limit_ms if timeout_ms is None else min(timeout_ms, limit_ms)
        invocation = Invocation(
            id=uuid.uuid4().hex,
            function=manifest.name,
            version=function.version,
            reply_to=self._replies.stream,
            deadline_ms=int(time.time() * 1000) + timeout_ms,
            inputs=inputs,
            outputs=outputs,
            traceparent=traceparent,
        )
        fields = invocation.encode()
        future = self._replies.expect(invocation.id)
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                try:
                    added = await self._enqueue(
                        keys=[keys.invocations(manifest.name)],
                        args=[manifest.batching.max_queue_size, fields[b"h"], fields[b"b"]],
                    )
                except RedisError as exc:
                    raise Unavailable(f"the queue is unavailable: {exc}") from exc
                if added is None:
                    raise Overloaded(
                        f"function '{manifest.name}' has {manifest.batching.max_queue_size} invocations "
                        "queued (max_queue_size); retry later"
                    )
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
