"""The consume loop of one function: read its stream as a member of the runner group, form
batches by the batching policy, execute them, write replies and acknowledge in one round trip.

Entries are acknowledged (and deleted) only after their reply is written. Entries another runner
left unacknowledged for claim_idle_ms are claimed; one delivered more than max_deliveries times
is answered with an error and moved to the dead-letter stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from redis.exceptions import RedisError, ResponseError

from fngate import keys, queue, telemetry
from fngate.backoff import backoff_s
from fngate.config import RunnerSettings
from fngate.errors import DeadlineExceeded, FunctionError, ModelFailed
from fngate.pipelined import PipelinedRedis, Script
from fngate.repository import FunctionVersion
from fngate.wire import Fields, Invocation, Reply
from runner import statistics
from runner.batching import Waiting, next_step
from runner.execution import run_batch, shape_key
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
from runner.models import LoadedModel, LoadedModels
from runner.outbox import Entry, Outbox

log = logging.getLogger(__name__)
tracer = trace.get_tracer("fngate.runner")


class FunctionConsumer:
    """Two tasks: a reader that keeps one blocking XREADGROUP outstanding (Redis wakes it the moment
    an invocation arrives) and reads ahead up to one batch, and a batcher that times its batch
    window on the runner's own clock. A short Redis BLOCK is never used to wait: Redis checks
    blocked clients' timeouts on its `hz` tick, so a 2 ms BLOCK can last 100 ms."""

    def __init__(
        self,
        redis: aioredis.Redis,
        function: FunctionVersion,
        models: LoadedModels,
        settings: RunnerSettings,
        consumer: str,
        stopping: asyncio.Event,
    ) -> None:
        self.function = function
        self._redis = redis
        self._models = models
        self._settings = settings
        self._consumer = consumer
        self._stopping = stopping
        self._streams = keys.levels(function.name)
        self._pending: list[Entry] = []
        self._running: Sequence[Entry] = ()
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._contended = False
        self._last_claim = 0.0
        # The hot path's own connections: one blocks on reads, one carries replies and claims.
        self._reads = PipelinedRedis(settings.redis_url, settings.redis_timeout_s)
        self._writes = PipelinedRedis(settings.redis_url, settings.redis_timeout_s)
        self._outboxes = [Outbox(self._writes, stream, settings) for stream in self._streams]
        self._read_levels = Script(self._reads, queue.READ_LEVELS)
        self._lower_levels_empty = False
        """The last read saw nothing below the synchronous level: the next may block at once."""
        # The metrics every batch touches, looked up once.
        name = function.name
        self._compute_duration = COMPUTE_DURATION.labels(name)
        self._batch_size = BATCH_SIZE.labels(name)
        self._queue_duration = QUEUE_DURATION.labels(name)
        self._successes = INVOCATIONS.labels(name, "success")
        self._traced = telemetry.tracing_active()

    @property
    def pending(self) -> int:
        """Invocations read and not yet answered."""
        return len(self._pending)

    @property
    def _read_ahead(self) -> int:
        """At most one batch waits here beside the one running; the rest stays for other runners."""
        return max(self.function.manifest.batching.max_batch_size, 1)

    async def run(self) -> None:
        """Consume until `stopping` is set, then finish what was already read and return."""
        try:
            async with asyncio.TaskGroup() as tasks:
                reader = tasks.create_task(self._read_loop(), name=f"read {self.function.name}")
                stop = tasks.create_task(self._wake_on_stop(), name=f"stop {self.function.name}")
                try:
                    await self._batch_loop()
                finally:
                    reader.cancel()
                    stop.cancel()
        finally:
            for outbox in self._outboxes:
                await outbox.aclose()
            await self._reads.aclose()
            await self._writes.aclose()

    async def _read_loop(self) -> None:
        """Read and claim until `stopping`; a Redis outage is waited out with backoff."""
        failures = 0
        while not self._stopping.is_set():
            try:
                if self._models.is_stuck(self.function.name):
                    # A batch that cannot be stopped holds it: leave its work to other runners.
                    await asyncio.sleep(self._settings.claim_interval_ms / 1000)
                    continue
                if failures or not self._last_claim:
                    await self._ensure_group()
                await self._claim_due()
                room = self._read_ahead - len(self._pending)
                if room <= 0:
                    self._room.clear()
                    async with asyncio.timeout(self._settings.claim_interval_ms / 1000):
                        await self._room.wait()
                    continue
                await self._read_by_priority(room)
                failures = 0
            except TimeoutError:
                continue
            except (RedisError, OSError) as exc:
                # What we had read stays in our pending list at Redis; a later claim recovers it.
                failures += 1
                delay_s = backoff_s(failures, cap_s=1.0)  # back within a second of Redis
                log.warning(
                    "%s: redis unavailable (%s); retrying in %.1f s", self.function.name, exc, delay_s
                )
                await asyncio.sleep(delay_s)

    async def _read_by_priority(self, room: int) -> None:
        """Take what waits, synchronous invocations first (queue.READ_LEVELS); with nothing waiting,
        block on every level's stream at once until something arrives. While the lower levels are
        empty (the usual case), the blocking read alone does both in one round trip: it returns at
        once with what the synchronous level holds. Should lower-level entries arrive meanwhile, it
        may take up to `room` of them beside the synchronous ones (they still run after them), and
        the reads go through READ_LEVELS again until those levels are empty."""
        found = []
        if not self._lower_levels_empty:
            found = queue.level_entries(
                await self._read_levels(list(self._streams), [keys.RUNNER_GROUP, self._consumer, room]),
                self._streams,
            )
            # Fewer than its room: the script read every level and each had less than it asked.
            self._lower_levels_empty = len(found) < room
        if not found:
            block = min(self._settings.read_block_ms, self._settings.claim_interval_ms)
            response = await self._reads.execute(
                *("XREADGROUP", "GROUP", keys.RUNNER_GROUP, self._consumer, "COUNT", room, "BLOCK", block),
                *("STREAMS", *self._streams, *(">" for _ in self._streams)),
                timeout_s=block / 1000 + self._settings.redis_timeout_s,
            )
            found = queue.level_entries(response, self._streams)
            # XREADGROUP answers for every stream that holds new entries: none from below level 0
            # means those levels had none.
            self._lower_levels_empty = all(level == 0 for level, _, _ in found)
        for level in range(len(self._streams)):
            await self._accept(
                ((entry_id, fields) for at, entry_id, fields in found if at == level), level=level
            )

    async def _wake_on_stop(self) -> None:
        """The batcher waits on one event: arrivals, and the stop (one waiter, not one per wait)."""
        await self._stopping.wait()
        self._arrived.set()

    async def _batch_loop(self) -> None:
        while True:
            self._arrived.clear()
            if not self._pending:
                if self._stopping.is_set():
                    return
                await self._arrived.wait()
                continue
            wait_us = await self._step()
            if wait_us is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_us / 1e6):
                        await self._arrived.wait()

    async def _ensure_group(self) -> None:
        for stream in self._streams:
            try:
                await self._redis.xgroup_create(stream, keys.RUNNER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _accept(
        self, entries: Iterable[tuple[bytes, Fields | None]], alone: bool = False, level: int = 0
    ) -> None:
        stream = self._streams[level]
        broken = []
        for entry_id, fields in entries:
            if not fields:
                continue  # deleted after it was delivered: someone already answered it
            try:
                invocation = Invocation.decode(fields)
            except (KeyError, ValueError, TypeError, FunctionError) as exc:
                log.error(
                    "%s: entry %s does not decode (%s); dead-lettered", self.function.name, entry_id, exc
                )
                broken.append((entry_id, fields))
                continue
            step = fields.get(queue.STEP, b"")  # a pipeline step (runner.pipeline)
            self._pending.append(Entry(entry_id, invocation, queue.entry_bytes(fields), alone, level, step))
        if broken:
            async with self._redis.pipeline(transaction=False) as pipe:
                for _entry_id, fields in broken:
                    pipe.xadd(keys.dead_letters(self.function.name), {**fields, b"reason": b"undecodable"})
                pipe.xack(stream, keys.RUNNER_GROUP, *[entry_id for entry_id, _ in broken])
                pipe.xdel(stream, *[entry_id for entry_id, _ in broken])
                await pipe.execute()
        if any(entry.level for entry in self._pending):  # each level waits behind the ones above it
            self._pending.sort(key=lambda entry: entry.level)
        self._arrived.set()

    async def _step(self) -> int | None:
        """Answer expired entries, then run a batch or say how many µs to wait for more."""
        manifest = self.function.manifest
        now_ms = int(time.time() * 1000)
        step = next_step(
            [
                Waiting(
                    # The loading rule: time spent waiting for the model's load does not count.
                    self._models.deadline_ms(
                        manifest.name,
                        entry.invocation.version,
                        entry.invocation.deadline_ms,
                        _entry_ms(entry.id),
                        now_ms,
                    ),
                    _entry_ms(entry.id),
                    (entry.invocation.version, shape_key(entry.invocation)),
                    entry.invocation.rows,
                    entry.alone,
                )
                for entry in self._pending
            ],
            now_ms,
            manifest.batching,
            manifest.batched,
            self._contended,
        )
        taken = set(step.expired) | set(step.batch)
        expired = [self._pending[index] for index in step.expired]
        batch = [self._pending[index] for index in step.batch]
        if taken:
            self._pending = [entry for index, entry in enumerate(self._pending) if index not in taken]
            self._room.set()
        if expired:
            await self._expire(expired)
        if batch:
            self._contended = len(batch) > 1 or bool(self._pending)
            await self._execute(batch)
        return step.wait_us

    async def _execute(self, batch: Sequence[Entry]) -> None:
        self._running = batch
        try:
            await self._run(batch)
        finally:
            self._running = ()

    async def _run(self, batch: Sequence[Entry]) -> None:
        invocations = [entry.invocation for entry in batch]
        name = self.function.name
        version = invocations[0].version
        batch_id = os.urandom(8).hex()
        started_ns = time.time_ns()
        ran_digest = ""
        parents: list[Context | None] = []
        span: contextlib.AbstractContextManager[Span | None] = contextlib.nullcontext()  # none unless traced
        if self._traced:
            parents = [telemetry.extract(invocation.traceparent) for invocation in invocations]
            links = [Link(trace.get_current_span(parent).get_span_context()) for parent in parents if parent]
            span = tracer.start_as_current_span(f"batch {name}", links=links)
        with span as batch_span:
            try:
                model = await self._load(self._models.version(name, version))
            except FunctionError as exc:
                replies = [Reply(inv.id, inv.version, {}, exc, batch_id, 0) for inv in invocations]
            else:
                ran_digest = model.function.digest
                computed = time.perf_counter()
                try:
                    replies = await run_batch(self._models, model, invocations, batch_id)
                finally:
                    await self._models.release(model)
                self._compute_duration.observe(time.perf_counter() - computed)
            rows = sum(invocation.rows for invocation in invocations) if self.function.manifest.batched else 1
            if batch_span is not None:
                batch_span.set_attributes(
                    {
                        "fngate.function": name,
                        "fngate.version": version,
                        "fngate.batch_id": batch_id,
                        "fngate.batch_size": rows,
                        "fngate.invocations": len(invocations),
                    }
                )
        self._observe(batch, replies, started_ns, rows)
        if batch_span is not None:
            self._trace(batch, replies, parents, batch_span, started_ns, rows)
        await self._send(
            batch,
            replies,
            ran_digest,
            statistics.of_batch(self.function, version, batch, replies, started_ns),
        )

    async def _load(self, function: FunctionVersion) -> LoadedModel:
        """The model, loaded now if this batch is its first (a cold start, with a span of its own);
        held until `models.release`."""
        name = function.name
        if (name, function.version) in self._models.loaded:
            return await self._models.acquire(function)
        COLD_STARTS.labels(name).inc()
        started = time.perf_counter()
        with tracer.start_as_current_span(f"load {name}", attributes={"fngate.cold_start": True}):
            try:
                model = await self._models.acquire(function)
            except FunctionError:
                MODEL_LOADS.labels(name, "failed").inc()
                raise
        MODEL_LOADS.labels(name, "loaded").inc()
        MODEL_LOAD_DURATION.labels(name).observe(time.perf_counter() - started)
        MODELS_LOADED.set(len(self._models.loaded))
        return model

    def _observe(self, batch: Sequence[Entry], replies: Sequence[Reply], started_ns: int, rows: int) -> None:
        """Metrics for the batch and its invocations (spans cost even as no-ops: see _trace)."""
        name, version = self.function.name, batch[0].invocation.version  # the version this batch ran
        EXECUTION_COUNT.labels(name, version).inc()
        INFERENCE_COUNT.labels(name, version).inc(rows)
        self._batch_size.observe(rows)
        started_ms = started_ns / 1e6
        succeeded = 0
        for entry, reply in zip(batch, replies, strict=True):
            self._queue_duration.observe(max(0.0, started_ms - _entry_ms(entry.id)) / 1000)
            if reply.error is None:
                succeeded += 1
            else:
                INVOCATIONS.labels(name, reply.error.code.value).inc()
        if succeeded:
            self._successes.inc(succeeded)

    def _trace(
        self,
        batch: Sequence[Entry],
        replies: Sequence[Reply],
        parents: Sequence[Context | None],
        batch_span: Span,
        started_ns: int,
        rows: int,
    ) -> None:
        """Each invocation's share of the batch as spans in its own trace: its wait in the queue and
        its execution, linked to the batch span."""
        if not batch_span.get_span_context().trace_flags.sampled:
            return
        name = self.function.name
        ended_ns = time.time_ns()
        batch_link = [Link(batch_span.get_span_context())]
        for entry, reply, parent in zip(batch, replies, parents, strict=True):
            if parent is None:
                continue
            invocation = entry.invocation
            queued_ns = _entry_ms(entry.id) * 1_000_000
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
        error = DeadlineExceeded("the deadline passed while queued")
        replies = [Reply(entry.invocation.id, entry.invocation.version, {}, error) for entry in entries]
        await self._send(entries, replies)

    async def _send(
        self,
        entries: Sequence[Entry],
        replies: Sequence[Reply],
        ran_digest: str = "",
        stats: queue.Statistics | None = None,
    ) -> None:
        """The batch's replies and acknowledgements (Outbox.send). When Redis fails here, the entries
        stay unacknowledged in our pending list: claimed and answered again once it is back (at
        least once), never lost, and the runner goes on."""
        try:
            levels = sorted({entry.level for entry in entries})
            if len(levels) == 1:  # the usual batch: one level, one round trip, no task
                await self._outboxes[levels[0]].send(entries, replies, ran_digest, stats)
            else:  # one FINISH per level's stream, written together; the statistics counted once
                await asyncio.gather(
                    *(
                        self._outboxes[level].send(
                            [entry for entry in entries if entry.level == level],
                            _at_level(level, entries, replies),
                            ran_digest,
                            stats if level == levels[0] else None,
                        )
                        for level in levels
                    )
                )
        except (RedisError, OSError) as exc:
            log.warning(
                "%s: could not write %d replies (%s); they are retried once Redis is back",
                self.function.name,
                len(replies),
                exc,
            )

    async def _claim_due(self) -> None:
        """Take over what runners that died left unacknowledged, at every level; each runs alone
        (Entry.alone)."""
        now = time.monotonic()
        if now - self._last_claim < self._settings.claim_interval_ms / 1000:
            return
        self._last_claim = now
        for level in range(len(self._streams)):
            await self._claim_level(level)

    async def _claim_level(self, level: int) -> None:
        stream = self._streams[level]
        held: list[bytes | str | int | memoryview] = [
            entry.id for entry in (*self._pending, *self._running) if entry.level == level
        ]
        if held:
            # Reset the idle time of what we hold (JUSTID: no delivery is counted), so that neither
            # we nor another runner claim an invocation that is only waiting or running long here.
            await self._redis.xclaim(stream, keys.RUNNER_GROUP, self._consumer, 0, held, justid=True)
        _next, claimed, _deleted = await self._redis.xautoclaim(
            stream, keys.RUNNER_GROUP, self._consumer, self._settings.claim_idle_ms, "0-0", count=100
        )
        claimed = [(entry_id, fields) for entry_id, fields in claimed if fields]
        if not claimed:
            return
        log.warning(
            "%s: claimed %d invocations another runner left unacknowledged", self.function.name, len(claimed)
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
            ((entry_id, fields) for entry_id, fields in claimed if entry_id not in poisoned_ids),
            alone=True,
            level=level,
        )

    async def _dead_letter(self, entries: Sequence[tuple[bytes, Fields]], level: int) -> None:
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


def _at_level(level: int, entries: Sequence[Entry], replies: Sequence[Reply]) -> list[Reply]:
    return [reply for entry, reply in zip(entries, replies, strict=True) if entry.level == level]


def _entry_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])
