"""Append an invocation to its function's stream and await its reply before the deadline; answer
from the response cache, or wait on an identical invocation already in flight, when it can.

The enqueue scripts of all invocations that arrive in one event-loop turn go to Redis in one write
(fngate.pipelined): under load one round trip carries many invocations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from redis.exceptions import RedisError

from fngate import keys, queue, telemetry
from fngate.backoff import Health
from fngate.errors import DeadlineExceeded, Overloaded, Unavailable
from fngate.pipelined import PipelinedRedis, Script
from fngate.repository import FunctionVersion
from fngate.wire import Invocation, Reply, Tensors
from gateway.activation import Activator
from gateway.cache import SeparateCache, request_key
from gateway.replies import ReplyRouter

tracer = trace.get_tracer("fngate.gateway")
REDIS = {"db.system.name": "redis"}


class Refused(Exception):
    """The caller's limits refused the invocation (in the enqueue's own round trip)."""

    def __init__(self, outcome: queue.Limited) -> None:
        super().__init__(outcome.limit)
        self.outcome = outcome


class Dispatcher:
    def __init__(
        self,
        redis: PipelinedRedis,
        replies: ReplyRouter,
        cache: SeparateCache | None = None,
        activator: Activator | None = None,
        health: Health | None = None,
    ) -> None:
        self._replies = replies
        self._health = health
        self._activator = activator
        self._enqueue = Script(redis, queue.ENQUEUE)
        self._separate_cache = cache
        self._tracing = telemetry.tracing_active()

    async def submit(
        self,
        function: FunctionVersion,
        inputs: Tensors,
        outputs: tuple[str, ...] | None,
        timeout_ms: int | None,
        use_cache: bool = True,
        admission: queue.Admission | None = None,
    ) -> Reply:
        """Answer one invocation; raises the FunctionError it failed with.

        With the function's cache on, a cached answer is returned at once and an identical
        invocation in flight is waited on; use_cache=False skips both but still stores the answer."""
        manifest = function.manifest
        self._check_available()
        limit_ms = manifest.batching.timeout_ms
        timeout_ms = limit_ms if timeout_ms is None else min(timeout_ms, limit_ms)
        entry = in_flight = ""
        key_hex = request_key(function, inputs, outputs)
        if key_hex:
            entry = keys.cache_entry(manifest.name, key_hex)
            in_flight = keys.in_flight(manifest.name, key_hex) if use_cache else ""
        invocation = Invocation(
            id=os.urandom(16).hex(),
            function=manifest.name,
            version=function.version,
            reply_to=self._replies.stream,
            deadline_ms=int(time.time() * 1000) + timeout_ms,
            inputs=inputs,
            outputs=outputs,
            traceparent=telemetry.inject() if self._tracing else None,
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
        call = queue.enqueue_call(
            keys.invocations(manifest.name),
            invocation.encode(),
            queue.Waiter(self._replies.stream, invocation.id, invocation.deadline_ms),
            timeout_ms,
            manifest.batching.max_queue_size,
            manifest.batching.max_queue_bytes,
            lookup=entry if use_cache and self._separate_cache is None else "",
            in_flight=in_flight,
            admission=admission,
        )
        future = self._replies.expect(invocation.id)
        queued = False
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                cached = _settle(await self._submit(call, manifest.name), manifest.name, manifest.batching)
                if cached is not None:
                    return cached
                queued = True
                if self._activator is not None:
                    self._activator.wake(pool)
                reply = await future
        except TimeoutError:
            # The loading rule: past the deadline, a queued invocation waits on while its model loads.
            # The timeout cancelled `future`: expect again before anything else is awaited.
            renewed = self._replies.expect(invocation.id)
            since_ms = invocation.deadline_ms - timeout_ms
            if not (
                queued
                and self._activator is not None
                and await self._activator.on_the_way(function, since_ms)
            ):
                raise DeadlineExceeded(
                    f"function '{manifest.name}' did not answer within {timeout_ms} ms"
                ) from None
            reply = await self._activator.await_load(function, renewed, since_ms, timeout_ms)
        finally:
            self._replies.forget(invocation.id)
        if reply.error is not None:
            raise reply.error
        return reply

    # Pipelines (gateway.pipelines): the first steps' entries for one invocation, one reply.

    @property
    def reply_stream(self) -> str:
        return self._replies.stream

    async def submit_steps(
        self, invocation_id: str, calls: Sequence[Step], pools: Iterable[str], timeout_ms: int, name: str
    ) -> Reply:
        """Queue a pipeline's first steps (the first call may look up the cache and check the
        caller's limits), wake the pools of all its steps, and await the reply that answers
        `invocation_id`; raises as `submit` does."""
        self._check_available()
        activator, woken = self._activator, tuple(pools)
        if activator is not None:
            for pool in woken:
                activator.check(pool)
        future = self._replies.expect(invocation_id)
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                first, *rest = calls
                outcomes = [await self._submit(first.call, first.function)]
                if not isinstance(outcomes[0], queue.Hit | queue.Limited):
                    outcomes += await asyncio.gather(
                        *(self._submit(step.call, step.function) for step in rest)
                    )
                for step, outcome in zip(calls, outcomes, strict=False):
                    cached = _settle(outcome, step.function, step.batching)
                    if cached is not None:
                        return cached
                if activator is not None:
                    for pool in woken:
                        activator.wake(pool)
                reply = await future
        except TimeoutError:
            raise DeadlineExceeded(f"pipeline '{name}' did not answer within {timeout_ms} ms") from None
        finally:
            self._replies.forget(invocation_id)
        if reply.error is not None:
            raise reply.error
        return reply

    def _check_available(self) -> None:
        """Redis known down (the reply, activator or catalog loop saw it): answer now, not at a
        timeout."""
        if not self._replies.healthy or (self._health is not None and not self._health.available):
            raise Unavailable("the queue is unavailable: Redis cannot be reached")

    async def _submit(self, call: queue.ScriptCall, name: str) -> queue.EnqueueOutcome:
        try:
            if not self._tracing:
                return queue.parse_enqueue(await self._enqueue(call.keys, call.args))
            with tracer.start_as_current_span(f"enqueue {name}", kind=SpanKind.PRODUCER, attributes=REDIS):
                return queue.parse_enqueue(await self._enqueue(call.keys, call.args))
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One pipeline step's ENQUEUE, for Dispatcher.submit_steps."""

    function: str
    call: queue.ScriptCall
    batching: Any
    """The function's BatchingSpec, for the message when its queue is full."""


def _settle(outcome: queue.EnqueueOutcome, name: str, batching: Any) -> Reply | None:
    """What an enqueue's outcome means for its invocation: the cached reply of a hit, None once
    queued (or waiting on an identical one); a full queue or a caller over its limits raises."""
    if isinstance(outcome, queue.Hit):
        return dataclasses.replace(Reply.decode(outcome.fields), cached=True)
    if isinstance(outcome, queue.Full):
        raise Overloaded(_full_message(name, outcome, batching))
    if isinstance(outcome, queue.Limited):
        raise Refused(outcome)
    return None


def _full_message(name: str, outcome: queue.Full, batching: Any) -> str:
    if outcome.limit == "bytes":
        return (
            f"function '{name}' has {batching.max_queue_bytes} bytes of invocations queued "
            "(max_queue_bytes); retry later"
        )
    return f"function '{name}' has {batching.max_queue_size} invocations queued (max_queue_size); retry later"
