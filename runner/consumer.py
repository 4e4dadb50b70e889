"""The consume loop of one function: read its stream as a member of the runner group, form
batches by the batching policy, execute them, write replies and acknowledge in one round trip.

Entries are acknowledged (and deleted) only after their reply is written. Entries another runner
left unacknowledged for claim_idle_ms are claimed; one delivered more than max_deliveries times
is answered with an error and moved to the dead-letter stream.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fngate import keys, telemetry
from fngate.config import RunnerSettings
from fngate.errors import DeadlineExceeded, FunctionError, ModelFailed
from fngate.repository import FunctionVersion
from fngate.wire import Fields, Invocation, Reply
from runner import statistics
from runner.batching import Run, plan
from runner.execution import execute, shape_key
from runner.metrics import (
    BATCH_SIZE,
    COLD_STARTS,
    COMPUTE_DURATION,
    EXECUTION_COUNT,
    INFERENCE_COUNT,
    INVOCATIONS,
    MODEL_LOAD_DURATION,
    MODEL_LOADS,
    MODELS_LOADED,
    QUEUE_DURATION,
)
from runner.outbox import Outbox
from runner.pool import LoadedModel, ModelPool

log = logging.getLogger(__name__)
tracer = trace.get_tracer("fngate.runner")

Entry = tuple[bytes, Invocation]


class FunctionConsumer:
    def __init__(
        self,
        redis: aioredis.Redis,
        function: FunctionVersion,
        pool: ModelPool,
        settings: RunnerSettings,
        consumer: str,
        stopping: asyncio.Event,
    ) -> None:
        self.function = function
        self._redis = redis
        self._pool = pool
        self._settings = settings
        self._consumer = consumer
        self._stopping = stopping
        self._stream = keys.invocations(function.name)
        self._pending: collections.deque[Entry] = collections.deque()
        self._contended = False
        self._last_claim = 0.0
        self._outbox = Outbox(redis, self._stream, settings)

    @property
    def pending(self) -> int:
        """Invocations read and not yet answered."""
        return len(self._pending)

    async def run(self) -> None:
        """Consume until `stopping` is set, then finish what was already read and return."""
        try:
            await self._consume()
        finally:
            await self._outbox.aclose()

    async def _consume(self) -> None:
        await self._ensure_group()
        wait_ms: int | None = None
        while not (self._stopping.is_set() and not self._pending):
            try:
                if not self._stopping.is_set():
                    await self._claim_due()
                    await self._read(wait_ms)
                wait_ms = await self._step()
            except (RedisConnectionError, RedisTimeoutError) as exc:
                # What we had read stays in our pending list at Redis; a later claim recovers it.
                log.warning("%s: redis unavailable (%s); retrying in 1 s", self.function.name, exc)
                self._pending.clear()
                await asyncio.sleep(1)

    async def _ensure_group(self) -> None:
        try:
            await self._redis.xgroup_create(self._stream, keys.RUNNER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _read(self, wait_ms: int | None) -> None:
        if self._pending:
            block = wait_ms  # None: take what is queued now, without blocking
        else:
            block = min(self._settings.read_block_ms, self._settings.claim_interval_ms)
        room = max(self.function.manifest.batching.max_batch_size, 1) * 2
        response: Any = await self._redis.xreadgroup(
            keys.RUNNER_GROUP, self._consumer, {self._stream: ">"}, count=room, block=block
        )
        for _stream, entries in response or ():
            await self._accept(entries)

    async def _accept(self, entries: Iterable[tuple[bytes, Fields | None]]) -> None:
        broken = []
        for entry_id, fields in entries:
            if not fields:
                continue  # deleted after it was delivered: someone already answered it
            try:
                self._pending.append((entry_id, Invocation.decode(fields)))
            except (KeyError, ValueError, TypeError, FunctionError) as exc:
                log.error(
                    "%s: entry %s does not decode (%s); dead-lettered", self.function.name, entry_id, exc
                )
                broken.append((entry_id, fields))
        if broken:
            async with self._redis.pipeline(transaction=False) as pipe:
                for _entry_id, fields in broken:
                    pipe.xadd(keys.dead_letters(self.function.name), {**fields, b"reason": b"undecodable"})
                pipe.xack(self._stream, keys.RUNNER_GROUP, *[entry_id for entry_id, _ in broken])
                pipe.xdel(self._stream, *[entry_id for entry_id, _ in broken])
                await pipe.execute()

    async def _step(self) -> int | None:
        """Drop expired entries, then run a batch or say how many ms to wait for more."""
        if not self._pending:
            return None
        now_ms = int(time.time() * 1000)
        expired = [entry for entry in self._pending if entry[1].deadline_ms <= now_ms]
        if expired:
            self._pending = collections.deque(
                entry for entry in self._pending if entry[1].deadline_ms > now_ms
            )
            await self._expire(expired)
            if not self._pending:
                return None
        manifest = self.function.manifest
        # A batch runs on one version's model: invocations name theirs (pinned, or by traffic split).
        first = self._pending[0][1]
        first_key = (first.version, shape_key(first))
        candidates = [
            entry for entry in self._pending if (entry[1].version, shape_key(entry[1])) == first_key
        ]
        rows = [entry[1].rows if manifest.batched else 1 for entry in candidates]
        oldest_age_us = max(0, now_ms - _entry_ms(candidates[0][0])) * 1000
        decision = plan(rows, oldest_age_us, manifest.batching, self._contended or len(self._pending) > 1)
        if not isinstance(decision, Run):
            return max(1, math.ceil(decision.us / 1000))
        batch = candidates[: decision.count]
        taken = {entry_id for entry_id, _ in batch}
        self._pending = collections.deque(entry for entry in self._pending if entry[0] not in taken)
        self._contended = len(batch) > 1 or bool(self._pending)
        await self._execute(batch)
        return None

    async def _execute(self, batch: Sequence[Entry]) -> None:
        invocations = [invocation for _, invocation in batch]
        name = self.function.name
        version = invocations[0].version
        batch_id = uuid.uuid4().hex[:16]
        parents = [telemetry.extract(invocation.traceparent) for invocation in invocations]
        links = [Link(trace.get_current_span(parent).get_span_context()) for parent in parents if parent]
        started_ns = time.time_ns()
        ran_digest = ""
        with tracer.start_as_current_span(f"batch {name}", links=links) as batch_span:
            try:
                model = await self._load(self._pool.version(name, version))
            except FunctionError as exc:
                replies = [Reply(inv.id, inv.version, {}, exc, batch_id, 0) for inv in invocations]
            else:
                ran_digest = model.function.digest
                computed = time.perf_counter()
                manifest = model.function.manifest
                try:
                    replies = await asyncio.to_thread(execute, model.backend, manifest, invocations, batch_id)
                finally:
                    await self._pool.release(model)
                COMPUTE_DURATION.labels(name).observe(time.perf_counter() - computed)
            rows = sum(invocation.rows for invocation in invocations) if self.function.manifest.batched else 1
            batch_span.set_attributes(
                {
                    "fngate.function": name,
                    "fngate.version": version,
                    "fngate.batch_id": batch_id,
                    "fngate.batch_size": rows,
                    "fngate.invocations": len(invocations),
                }
            )
        self._observe(batch, replies, parents, batch_span, started_ns, rows)
        await self._outbox.send(replies, [entry_id for entry_id, _ in batch], invocations, ran_digest)
        await statistics.record(self._redis, self.function, version, batch, replies, started_ns)

    async def _load(self, function: FunctionVersion) -> LoadedModel:
        """The model, loaded now if this batch is its first (a cold start, with a span of its own);
        held until `pool.release`."""
        name = function.name
        if (name, function.version) in self._pool.loaded:
            return await self._pool.acquire(function)
        COLD_STARTS.labels(name).inc()
        started = time.perf_counter()
        with tracer.start_as_current_span(f"load {name}", attributes={"fngate.cold_start": True}):
            try:
                model = await self._pool.acquire(function)
            except FunctionError:
                MODEL_LOADS.labels(name, "failed").inc()
                raise
        MODEL_LOADS.labels(name, "loaded").inc()
        MODEL_LOAD_DURATION.labels(name).observe(time.perf_counter() - started)
        MODELS_LOADED.set(len(self._pool.loaded))
        return model

    def _observe(
        self,
        batch: Sequence[Entry],
        replies: Sequence[Reply],
        parents: Sequence[Context | None],
        batch_span: Span,
        started_ns: int,
        rows: int,
    ) -> None:
        """Metrics for the batch, and each invocation's share of it as spans in its own trace."""
        name, version = self.function.name, self.function.version
        EXECUTION_COUNT.labels(name, version).inc()
        INFERENCE_COUNT.labels(name, version).inc(rows)
        BATCH_SIZE.labels(name).observe(rows)
        ended_ns = time.time_ns()
        batch_link = [Link(batch_span.get_span_context())]
        for (entry_id, invocation), reply, parent in zip(batch, replies, parents, strict=True):
            queued_ns = _entry_ms(entry_id) * 1_000_000
            QUEUE_DURATION.labels(name).observe(max(0, started_ns - queued_ns) / 1e9)
            INVOCATIONS.labels(name, reply.error.code.value if reply.error else "success").inc()
            if parent is None or not batch_span.get_span_context().trace_flags.sampled:
                continue
            tracer.start_span(
                f"queue {name}", context=parent, start_time=queued_ns, kind=SpanKind.CONSUMER
            ).end(end_time=started_ns)
            span = tracer.start_span(
                f"execute {name}",
                context=parent,
                start_time=started_ns,
                links=batch_link,
                attributes={
                    "fngate.function": name,
                    "fngate.version": invocation.version,
                    "fngate.batch_id": reply.batch_id,
                    "fngate.batch_size": rows,
                    "fngate.rows": invocation.rows,
                },
            )
            if reply.error is not None:
                span.set_status(Status(StatusCode.ERROR, reply.error.message))
            span.end(end_time=ended_ns)

    async def _expire(self, entries: Sequence[Entry]) -> None:
        INVOCATIONS.labels(self.function.name, DeadlineExceeded.code.value).inc(len(entries))
        log.info("%s: %d invocations past their deadline, not executed", self.function.name, len(entries))
        invocations = [invocation for _, invocation in entries]
        replies = [
            Reply(inv.id, inv.version, {}, DeadlineExceeded("the deadline passed while queued"))
            for inv in invocations
        ]
        await self._outbox.send(replies, [entry_id for entry_id, _ in entries], invocations)

    async def _claim_due(self) -> None:
        now = time.monotonic()
        if now - self._last_claim < self._settings.claim_interval_ms / 1000:
            return
        self._last_claim = now
        _next, claimed, _deleted = await self._redis.xautoclaim(
            self._stream, keys.RUNNER_GROUP, self._consumer, self._settings.claim_idle_ms, "0-0", count=100
        )
        claimed = [(entry_id, fields) for entry_id, fields in claimed if fields]
        if not claimed:
            return
        log.warning(
            "%s: claimed %d invocations another runner left unacknowledged", self.function.name, len(claimed)
        )
        counts: Any = await self._redis.xpending_range(
            self._stream, keys.RUNNER_GROUP, claimed[0][0], claimed[-1][0], len(claimed) + 64, self._consumer
        )
        deliveries = {item["message_id"]: item["times_delivered"] for item in counts}
        poisoned = [
            (entry_id, fields)
            for entry_id, fields in claimed
            if deliveries.get(entry_id, 1) > self._settings.max_deliveries
        ]
        if poisoned:
            await self._dead_letter(poisoned)
        poisoned_ids = {entry_id for entry_id, _ in poisoned}
        await self._accept((entry_id, fields) for entry_id, fields in claimed if entry_id not in poisoned_ids)

    async def _dead_letter(self, entries: Sequence[tuple[bytes, Fields]]) -> None:
        limit = self._settings.max_deliveries
        log.error(
            "%s: %d invocations were delivered more than %d times; dead-lettered",
            self.function.name,
            len(entries),
            limit,
        )
        async with self._redis.pipeline(transaction=False) as pipe:
            for _entry_id, fields in entries:
                pipe.xadd(keys.dead_letters(self.function.name), {**fields, b"reason": b"max_deliveries"})
            await pipe.execute()
        invocations = [Invocation.decode(fields) for _, fields in entries]
        error = ModelFailed(f"the invocation was delivered {limit} times and no runner finished it")
        replies = [Reply(invocation.id, invocation.version, {}, error) for invocation in invocations]
        await self._outbox.send(replies, [entry_id for entry_id, _ in entries], invocations)


def _entry_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])
