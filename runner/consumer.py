"""The consume loop of one function: read its stream as a member of the runner group, form
batches by the batching policy, execute them, write replies and acknowledge in one round trip.

Entries are acknowledged (and deleted) only after their reply is written. What other runners left
unacknowledged is claimed by runner.reclaim; metrics and spans of the batches are runner.observe's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from fngate import clients, custom_metrics, keys, queue
from fngate.backoff import backoff_s, stop_if_cancelled
from fngate.config import RunnerSettings
from fngate.errors import DeadlineExceeded, FunctionError, Unavailable
from fngate.fastredis import Script
from fngate.repository import FunctionVersion
from fngate.tensors import Tensors
from fngate.wire import Fields, Invocation, Reply, invocations_of
from runner import statistics
from runner.accounting import Accounting
from runner.backends import Streaming
from runner.batching import Arrivals, BatchCost, Pending, decide
from runner.execution import failed_together, left_by, run_batch, shape_key
from runner.metrics import INVOCATIONS, MEMORY_REFUSALS
from runner.models import LoadedModel, LoadedModels
from runner.observe import BatchObserver, entry_ms
from runner.outbox import Entry, Outbox
from runner.reclaim import Reclaimer

log = logging.getLogger(__name__)


PER_ENTRY_WEIGHT = 0.2
"""The weight of the last entry read in the average of invocations an entry holds."""
LEFT_READ_WAIT_S = 1.0
"""A consumer's first read waits at most this long for the sets of callers that left."""
LEFT_KEPT = 4096
"""Entries of callers that left that a consumer keeps in mind, whether or not it holds them."""


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
        self._streams = keys.levels(function.name, function.manifest.batching.priorities)
        self._pending: list[Entry] = []
        self._running: list[Sequence[Entry]] = []
        self._streaming_batches: list[Sequence[Entry]] = []
        """Decoupled batches whose `execute` returned and whose requests stream on (_compute)."""
        """The batches running: up to the model's instances at once."""
        self._batches: asyncio.TaskGroup | None = None
        self._refusing = False
        """The memory budget leaves no room for the function's model: its invocations are left to others."""
        self._arrived = asyncio.Event()
        self._left_read = asyncio.Event()
        """The streams' sets of callers that left were read (or could not be): reads may begin."""
        self._room = asyncio.Event()
        self._contended = False
        self._arrivals = Arrivals()
        self._cost = BatchCost()
        self._reading_since_ms = int(time.time() * 1000)
        """When this runner began to read the function's stream: an invocation queued before
        waited for a runner to start (its cold start's `start` phase)."""
        self._accounting = Accounting(redis, function.name)
        self._per_entry = 1.0
        """Invocations an entry read here held, on average of late (shared entries hold several):
        what a read's room in invocations is in entries."""
        self._groups: dict[tuple[int, bytes], tuple[int, int]] = {}
        """(level, id) of the grouped entries read here (fngate.queue.ENQUEUE_MANY) -> how many of
        their invocations are not answered yet, and how many they hold: an entry is acknowledged
        with its last answer."""
        self._known: dict[bytes, tuple[int, Hashable, int]] = {}
        """Per pending entry: when it was queued, its batching group and its rows."""
        self._left: dict[tuple[int, bytes], float] = {}
        """(level, entry id) of invocations whose callers left after this runner read them, as the
        gateways said (keys.left_channel), with when: answered unrun at the next step."""
        self._part_sends: list[asyncio.Future[Any]] = []
        """A decoupled model's responses on their way: a batch's replies wait for them, so that no
        caller hears its request's end before one of its responses (on a Redis Cluster a first
        command can wait for the slot map while a later one goes at once)."""
        self._streaming: dict[tuple[int, bytes], tuple[Streaming, int]] = {}
        """(level, entry id) of the invocations of running streaming batches -> their batch's
        Streaming and index in it: a caller that leaves is told to the model (is_cancelled())."""
        # The hot path's own connections: one blocks on reads, one carries replies and claims.
        self._reads = clients.fastredis(settings.redis_url, settings.redis_timeout_s)
        self._writes = clients.fastredis(settings.redis_url, settings.redis_timeout_s)
        self._outboxes = [Outbox(self._writes, stream, settings) for stream in self._streams]
        self._read_levels = Script(self._reads, queue.READ_LEVELS)
        self._lower_levels_empty = False
        """The last read saw nothing below the synchronous level: the next may block at once."""
        self._observer = BatchObserver(function.name)
        self._reclaim = Reclaimer(
            redis, function.name, self._streams, consumer, settings, self._accept, self._send
        )

    def cost(self) -> tuple[float, float] | None:
        """The function's batch cost here (fixed µs a batch, µs a row), once it has run a batch:
        what gateways estimate an invocation's wait from (gateway.dispatch)."""
        return self._cost.fit() if self._cost.observed else None

    @property
    def pending(self) -> int:
        """Invocations read and not yet answered."""
        return len(self._pending)

    @property
    def _instances(self) -> int:
        return self.function.manifest.instances

    @property
    def _read_ahead(self) -> int:
        """At most one batch per instance waits here beside those running; the rest stays for
        other runners."""
        return max(self.function.manifest.batching.max_batch_size, 1) * self._instances

    async def run(self) -> None:
        """Consume until `stopping` is set, then finish what was already read and return."""
        self._reading_since_ms = int(time.time() * 1000)
        try:
            async with asyncio.TaskGroup() as tasks:
                self._batches = tasks
                reader = tasks.create_task(self._read_loop(), name=f"read {self.function.name}")
                stop = tasks.create_task(self._wake_on_stop(), name=f"stop {self.function.name}")
                left = tasks.create_task(self._listen_left(), name=f"left {self.function.name}")
                try:
                    await self._batch_loop()
                finally:
                    reader.cancel()
                    stop.cancel()
                    left.cancel()
        finally:
            await self._accounting.close()
            for outbox in self._outboxes:
                await outbox.aclose()
            await self._reads.aclose()
            await self._writes.aclose()

    async def _read_loop(self) -> None:
        """Read and claim until `stopping`; a Redis outage is waited out with backoff."""
        with contextlib.suppress(TimeoutError):  # what was withdrawn before this runner listened
            async with asyncio.timeout(LEFT_READ_WAIT_S):
                await self._left_read.wait()
        failures = 0
        while not self._stopping.is_set():
            try:
                if self._models.is_stuck(self.function.name):
                    # A batch that cannot be stopped holds it: leave its work to other runners.
                    await asyncio.sleep(self._settings.claim_interval_ms / 1000)
                    continue
                if not self._models.would_fit(self.function):
                    self._refuse()
                    await asyncio.sleep(self._settings.claim_interval_ms / 1000)
                    continue
                self._refusing = False
                if failures or not self._reclaim.last_claim:
                    await self._ensure_group()
                await self._reclaim.due(self._held)
                rooms = queue.rooms(
                    self._read_ahead, [entry.level for entry in self._pending], len(self._streams)
                )
                if rooms[0] <= 0:
                    self._room.clear()
                    async with asyncio.timeout(self._settings.claim_interval_ms / 1000):
                        await self._room.wait()
                    continue
                # Rooms are in invocations; reads count entries, which may each hold several.
                per_entry = self._per_entry
                await self._read_by_priority(
                    [math.ceil(room / per_entry) if room > 0 else room for room in rooms]
                )
                failures = 0
            except TimeoutError:
                continue
            except (RedisError, OSError) as exc:
                stop_if_cancelled(exc)
                # What we had read stays in our pending list at Redis; a later claim recovers it.
                failures += 1
                delay_s = backoff_s(failures, cap_s=1.0)  # back within a second of Redis
                log.warning(
                    "%s: redis unavailable (%s); retrying in %.1f s", self.function.name, exc, delay_s
                )
                await asyncio.sleep(delay_s)

    async def _listen_left(self) -> None:
        """Note the entries the gateways name on the function's channel of callers that left. Said
        once, not stored: what is said while Redis is away is missed, and those invocations run
        (their replies find no one), as they did before anyone was told."""
        failures = 0
        while not self._stopping.is_set():
            pubsub = self._redis.pubsub()
            try:
                await clients.subscribe(pubsub, keys.left_channel(self.function.name))
                await self._read_left_sets()
                failures = 0
                while not self._stopping.is_set():
                    message = await clients.next_message(pubsub, 1.0)
                    if message is not None:
                        self._note_left(message["data"])
            except (RedisError, OSError):
                failures += 1
                await asyncio.sleep(backoff_s(failures, cap_s=1.0))
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _read_left_sets(self) -> None:
        """What was said before this runner listened: the invocations of grouped entries whose
        callers left, which stay named in their stream's set until a runner answers them
        (fngate.queue.WITHDRAW). Read once listening, so that nothing said meanwhile is missed."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for stream in self._streams:
                pipe.smembers(queue.left_set(stream))
            named: list[Any] = await pipe.execute()
        for stream, members in zip(self._streams, named, strict=True):
            for member in members:
                self._note_left(stream.encode() + b" " + member)
        self._left_read.set()

    def _note_left(self, data: bytes) -> None:
        stream, _, entry_id = data.partition(b" ")
        level = next((at for at, name in enumerate(self._streams) if name.encode() == stream), None)
        if level is None or not entry_id:
            return
        running = self._streaming.pop((level, entry_id), None)
        if running is not None:  # a streaming batch runs it: its model is told, its responses dropped
            streaming, index = running
            streaming.cancel(index)
            return
        if len(self._left) >= LEFT_KEPT:  # most were answered already: keep the newer half
            self._left = dict(list(self._left.items())[LEFT_KEPT // 2 :])
        self._left[(level, entry_id)] = time.monotonic()

    async def _answer_left(self) -> None:
        """The pending invocations whose callers left: answered unrun (their replies find no one),
        so that no batch is spent on them."""
        left = [entry for entry in self._pending if (entry.level, entry.id) in self._left]
        if not left:
            return
        for entry in left:
            self._left.pop((entry.level, entry.id), None)
            self._known.pop(entry.id, None)
        gone = {id(entry) for entry in left}
        self._pending = [entry for entry in self._pending if id(entry) not in gone]
        self._room.set()
        INVOCATIONS.labels(self.function.name, "caller_left").inc(len(left))
        log.info("%s: %d invocations whose callers left, not executed", self.function.name, len(left))
        error = Unavailable("its caller left before it ran")
        await self._send(
            left, [Reply(entry.invocation.id, entry.invocation.version, {}, error) for entry in left]
        )
        for entry in left:
            if entry.unit:  # answered: out of its stream's set of those whose callers left
                removed = self._writes.send("SREM", queue.left_set(self._streams[entry.level]), entry.id)
                removed.add_done_callback(_unremoved)

    def _refuse(self) -> None:
        """The models in use here leave too little of the memory budget for this function's: its
        invocations stay in the stream for a runner with room (counted once per stretch)."""
        if not self._refusing:
            self._refusing = True
            MEMORY_REFUSALS.labels(self.function.name, "no-room").inc()
            log.info(
                "%s: no room in the memory budget for its model now; its invocations are left to "
                "other runners",
                self.function.name,
            )

    async def _read_by_priority(self, rooms: list[int]) -> None:
        """Take what waits, highest level first (queue.READ_LEVELS; `rooms`: queue.rooms); with
        nothing waiting, block on the streams of every level that has room at once until something
        arrives. While the lower levels are empty (the usual case), the blocking read alone does
        both in one round trip: it returns at once with what the first level holds. Should
        lower-level entries arrive meanwhile, it may take up to the first level's room of them
        beside the first level's (they still run after them), and the reads go through READ_LEVELS
        again until those levels are empty."""
        found = []
        room = rooms[0]
        if not self._lower_levels_empty:
            found = queue.level_entries(
                await self._read_levels(list(self._streams), [keys.RUNNER_GROUP, self._consumer, *rooms]),
                self._streams,
            )
            # Fewer than its room: the script read every level and each had less than it asked.
            self._lower_levels_empty = len(found) < rooms[-1]
        if not found:
            block = min(self._settings.read_block_ms, self._settings.claim_interval_ms)
            # Levels whose room is taken by what this consumer holds are not read: a lower level's
            # burst waits in Redis while a higher level may still come in.
            open_streams = self._streams[: sum(1 for item in rooms if item > 0)]
            response = await self._reads.execute(
                *("XREADGROUP", "GROUP", keys.RUNNER_GROUP, self._consumer, "COUNT", room, "BLOCK", block),
                *("STREAMS", *open_streams, *(">" for _ in open_streams)),
                timeout_s=block / 1000 + self._settings.redis_timeout_s,
            )
            found = queue.level_entries(response, self._streams)
            # XREADGROUP answers for every stream that holds new entries: none from below level 0
            # means those levels had none.
            self._lower_levels_empty = len(open_streams) == len(self._streams) and all(
                level == 0 for level, _, _ in found
            )
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
            if not self._pending or len(self._running) >= self._instances:
                if self._stopping.is_set() and not self._pending:
                    return
                await self._arrived.wait()  # an arrival, the stop, or a batch done
                continue
            wait_us = await self._step()
            if wait_us is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_us / 1e6):
                        await self._arrived.wait()

    def _held(self, level: int) -> list[bytes]:
        """The ids of the entries at `level` that this consumer has read and not yet answered."""
        running = (entry for batch in (*self._running, *self._streaming_batches) for entry in batch)
        held = {
            entry.entry_id
            for entry in (*self._pending, *running)
            if entry.level == level and (not entry.unit or (level, entry.unit) in self._groups)
        }
        return list(held)

    async def _ensure_group(self) -> None:
        for stream in self._streams:
            try:
                await self._redis.xgroup_create(stream, keys.RUNNER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _accept(
        self,
        entries: Iterable[tuple[bytes, Fields | None]],
        alone: bool = False,
        level: int = 0,
        poisoned: Collection[bytes] = (),
    ) -> None:
        """Take read entries into the pending list (a grouped entry's invocations each as its own);
        `poisoned`: those of a claimed grouped entry that ran max_deliveries times, dead-lettered."""
        stream = self._streams[level]
        broken = []
        dead: list[Entry] = []
        before = len(self._pending)
        for entry_id, fields in entries:
            if not fields:
                continue  # deleted after it was delivered: someone already answered it
            try:
                members = invocations_of(fields)
            except (KeyError, ValueError, TypeError, FunctionError) as exc:
                log.error(
                    "%s: entry %s does not decode (%s); dead-lettered", self.function.name, entry_id, exc
                )
                broken.append((entry_id, fields))
                continue
            self._per_entry += PER_ENTRY_WEIGHT * (len(members) - self._per_entry)
            if queue.HEADERS in fields:  # a gateway's invocations queued together, each its own
                self._groups[(level, entry_id)] = (len(members), len(members))
                for at, (invocation, size) in enumerate(members):
                    member = Entry(entry_id + b"/%d" % at, invocation, size, alone, level, unit=entry_id)
                    (dead if member.id in poisoned else self._pending).append(member)
                continue
            step = fields.get(queue.STEP, b"")  # a pipeline step (runner.pipeline)
            invocation, size = members[0]
            self._pending.append(Entry(entry_id, invocation, size, alone, level, step))
        if broken:
            async with self._redis.pipeline(transaction=False) as pipe:
                for _entry_id, fields in broken:
                    pipe.xadd(keys.dead_letters(self.function.name), {**fields, b"reason": b"undecodable"})
                pipe.xack(stream, keys.RUNNER_GROUP, *[entry_id for entry_id, _ in broken])
                pipe.xdel(stream, *[entry_id for entry_id, _ in broken])
                await pipe.execute()
        if dead:
            await self._reclaim.dead_letter(dead)
        self._arrivals.arrived(len(self._pending) - before, time.monotonic_ns())
        if any(entry.level for entry in self._pending):  # each level waits behind the ones above it
            self._pending.sort(key=lambda entry: entry.level)
        self._arrived.set()

    async def _step(self) -> int | None:
        """Answer expired entries, then run a batch or say how many µs to wait for more."""
        if self._left:
            await self._answer_left()
        manifest = self.function.manifest
        now_ms = int(time.time() * 1000)
        if any(entry.invocation.delay for entry in self._pending):
            # DELAY: past its queue timeout, an invocation goes behind its level's others.
            self._pending.sort(key=lambda entry: (entry.level, is_delayed(entry.invocation, now_ms)))
        step = decide(
            [self._waiting(entry, now_ms) for entry in self._pending],
            now_ms,
            manifest.batching,
            manifest.batched,
            self._contended,
            self._arrivals.burst(time.monotonic_ns(), self._cost.fixed_us),
        )
        taken = set(step.expired) | set(step.batch)
        expired = [self._pending[index] for index in step.expired]
        batch = [self._pending[index] for index in step.batch]
        for entry in (*expired, *batch):
            self._known.pop(entry.id, None)
        if taken:
            self._pending = [entry for index, entry in enumerate(self._pending) if index not in taken]
            self._room.set()
        if expired:
            await self._expire(expired)
        if batch:
            self._contended = len(batch) > 1 or bool(self._pending)
            await self._execute(batch)
        return step.wait_us

    def _waiting(self, entry: Entry, now_ms: int) -> Pending:
        """What the batching policy knows of an entry; what does not change is worked out once."""
        invocation = entry.invocation
        known = self._known.get(entry.id)
        if known is None:
            known = (entry_ms(entry.id), (invocation.version, shape_key(invocation)), invocation.rows)
            self._known[entry.id] = known
        queued_ms, group, rows = known
        # The loading rule: time spent waiting for the model's load does not count.
        deadline_ms = self._models.deadline_ms(
            self.function.name, invocation.version, start_deadline_ms(invocation), queued_ms, now_ms
        )
        return Pending(deadline_ms, queued_ms, group, rows, entry.alone)

    async def _execute(self, batch: Sequence[Entry]) -> None:
        """Run the batch; with several instances, in a task of its own beside the others."""
        streams = self.function.manifest.model.decoupled  # its next batch may start as this one streams
        if (self._instances == 1 and not streams) or self._batches is None:
            await self._run_held(batch)
        else:
            self._batches.create_task(
                self._run_held(batch, done=self._arrived), name=f"batch {self.function.name}"
            )

    async def _run_held(self, batch: Sequence[Entry], done: asyncio.Event | None = None) -> None:
        self._running.append(batch)
        try:
            await self._run(batch)
        finally:
            for batches in (self._running, self._streaming_batches):
                for at, running in enumerate(batches):
                    if running is batch:
                        del batches[at]
                        break
            if done is not None:
                done.set()

    async def _run(self, batch: Sequence[Entry]) -> None:
        invocations = [entry.invocation for entry in batch]
        name = self.function.name
        version = invocations[0].version
        batch_id = os.urandom(8).hex()
        started_ns = time.time_ns()
        ran_digest = ""
        failed = None
        reported: list[custom_metrics.Update] = []
        charged_s = 0.0
        cpu_s: float | None = None
        total_rows = sum(invocation.rows for invocation in invocations)
        alone = [entry for entry in batch if entry.alone]
        if alone:
            await self._reclaim.note_runs(alone)
        parents, span = self._observer.batch_span(invocations)
        with span as batch_span:
            cold = (name, version) not in self._models.loaded
            loading = time.perf_counter()
            try:
                model = await self._observer.load(self._models, self._models.version(name, version))
            except FunctionError as exc:
                replies = [Reply(inv.id, inv.version, {}, exc, batch_id, 0) for inv in invocations]
            else:
                ran_digest = model.function.digest
                try:
                    async with self._models.slots.hold(model.function.manifest.model.rate_limiter.resources):
                        computed = time.perf_counter()
                        replies = await self._compute(model, batch, batch_id)
                finally:
                    await self._models.release(model)
                    reported, cpu_s = left_by(model.backend, batch_id)
                took_s = time.perf_counter() - computed
                if cold or any(entry_ms(entry.id) < self._reading_since_ms for entry in batch):
                    replies = cold_timed(
                        batch, replies, started_ns, self._reading_since_ms, model, computed - loading, took_s
                    )
                self._observer.compute_duration.observe(took_s)
                charged_s = took_s
                self._cost.observe(total_rows, took_s * 1e6)
                failed = failed_together(replies)
            rows = total_rows if self.function.manifest.batched else 1
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
        if failed is not None and not self._models.is_stuck(name):
            self._split(batch, failed)
            return
        self._observer.observe(batch, replies, started_ns, rows)
        if batch_span is not None:
            self._observer.trace(batch, replies, parents, batch_span, started_ns, rows)
        await self._accounting.record_metrics(version, reported)  # before the replies, as Triton's
        await self._send(
            batch,
            replies,
            ran_digest,
            statistics.of_batch(self.function, version, batch, replies, started_ns),
        )
        self._accounting.record(version, invocations, charged_s, self.function.manifest.batched, cpu_s)

    async def _compute(self, model: LoadedModel, batch: Sequence[Entry], batch_id: str) -> list[Reply]:
        """The batch's replies. A decoupled model's requests that stream on once its `execute`
        returned are waited for here, the model's instance free for the next batch meanwhile (as on
        Triton): the batch's replies end its requests once each has ended."""
        invocations = [entry.invocation for entry in batch]
        parts = self._parts(model, batch)
        try:
            replies = await run_batch(self._models, model, invocations, batch_id, parts)
            if parts is None or parts.continuing is None:
                return replies
            self._free(batch)
            failed = await asyncio.wrap_future(parts.continuing)
            return [
                Reply(reply.id, reply.version, {}, failed[at], batch_id) if at in failed else reply
                for at, reply in enumerate(replies)
            ]
        finally:
            if parts is not None:
                self._streamed(batch, parts)

    def _free(self, batch: Sequence[Entry]) -> None:
        """A streaming batch whose `execute` returned: its instance takes the next batch; its
        entries stay held (claimed) until its requests end."""
        for at, running in enumerate(self._running):
            if running is batch:
                del self._running[at]
                self._streaming_batches.append(batch)
                self._arrived.set()
                return

    def _parts(self, model: LoadedModel, batch: Sequence[Entry]) -> Streaming | None:
        """Where a decoupled model's responses go as they come (from the batch's thread): each to
        its invocation's reply stream, on this loop, before the batch's own replies; none of an
        invocation whose caller left (its model is told: is_cancelled())."""
        if not model.function.manifest.model.decoupled:
            return None
        loop = asyncio.get_running_loop()
        invocations = [entry.invocation for entry in batch]

        def sink(index: int, outputs: Tensors, error: FunctionError | None) -> None:
            loop.call_soon_threadsafe(self._send_part, invocations[index], outputs, error)

        parts = Streaming(sink)
        for index, entry in enumerate(batch):
            self._streaming[(entry.level, entry.id)] = (parts, index)
        return parts

    def _streamed(self, batch: Sequence[Entry], parts: Streaming) -> None:
        for entry in batch:
            self._streaming.pop((entry.level, entry.id), None)
        parts.close()

    def _send_part(self, invocation: Invocation, outputs: Tensors, error: FunctionError | None) -> None:
        fields = Reply(invocation.id, invocation.version, outputs, error, part=True).encode()
        maxlen = self._settings.reply_maxlen
        sent = self._writes.send(
            *("XADD", invocation.reply_to, "NOMKSTREAM", "MAXLEN", "~", maxlen, "*"),
            *("h", fields[queue.HEADER], "b", fields[queue.BODY]),
        )
        sent.add_done_callback(self._part_sent)
        self._part_sends.append(sent)

    def _part_sent(self, future: asyncio.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.warning("%s: a streamed response was lost: %s", self.function.name, future.exception())

    def _split(self, batch: Sequence[Entry], error: FunctionError) -> None:
        """A batch failed as a whole (its process died or hung, its backend raised): which of its
        invocations caused it is unknown, so each runs again in a batch of its own, first; the
        culprit alone gets its error, and the others their answers."""
        log.warning(
            "%s: a batch of %d invocations failed as a whole (%s); each runs again alone",
            self.function.name,
            len(batch),
            error.message,
        )
        self._pending[:0] = [dataclasses.replace(entry, alone=True) for entry in batch]
        self._arrived.set()

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
        if self._part_sends:
            sending, self._part_sends = self._part_sends, []
            await asyncio.gather(*sending, return_exceptions=True)  # each failure is logged
        grouped = any(entry.unit for entry in entries)
        try:
            levels = sorted({entry.level for entry in entries})
            if len(levels) == 1:  # the usual batch: one level, one round trip, no task
                acks = self._acks(entries) if grouped else None
                await self._outboxes[levels[0]].send(entries, replies, ran_digest, stats, acks)
            else:  # one FINISH per level's stream, written together; the statistics counted once
                at_level = [[entry for entry in entries if entry.level == level] for level in levels]
                await asyncio.gather(
                    *(
                        self._outboxes[level].send(
                            mine,
                            _at_level(level, entries, replies),
                            ran_digest,
                            stats if level == levels[0] else None,
                            self._acks(mine) if grouped else None,
                        )
                        for level, mine in zip(levels, at_level, strict=True)
                    )
                )
        except (RedisError, OSError) as exc:
            # A grouped entry with an answer lost is no longer held here: claimed again whole.
            for entry in entries:
                if entry.unit:
                    self._groups.pop((entry.level, entry.unit), None)
            log.warning(
                "%s: could not write %d replies (%s); they are retried once Redis is back",
                self.function.name,
                len(replies),
                exc,
            )
            return
        alone = [entry for entry in entries if entry.alone]
        if alone:
            await self._reclaim.forget_runs(alone)

    def _acks(self, entries: Sequence[Entry]) -> tuple[list[bytes], int]:
        """The entries these answers complete (one level's), and the invocations they hold beyond one
        each: an entry of its own at once, a grouped entry with the last of its invocations read
        here (one whose answer was lost is acknowledged by the runner that claims it again)."""
        ids: list[bytes] = []
        extra = 0
        for entry in entries:
            if not entry.unit:
                ids.append(entry.id)
                continue
            key = (entry.level, entry.unit)
            group = self._groups.get(key)
            if group is None:
                continue
            left, size = group
            if left > 1:
                self._groups[key] = (left - 1, size)
                continue
            del self._groups[key]
            ids.append(entry.unit)
            extra += size - 1
        return ids, extra


def _unremoved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:  # it expires
        log.debug("an invocation stays named among callers that left: %s", future.exception())


def start_deadline_ms(invocation: Invocation) -> int:
    """When the invocation must have started: its deadline, or its queue timeout when that refuses
    (REJECT) and comes first."""
    queued = invocation.queue_deadline_ms
    if queued and not invocation.delay:
        return min(queued, invocation.deadline_ms)
    return invocation.deadline_ms


def is_delayed(invocation: Invocation, now_ms: int) -> bool:
    """Past a queue timeout whose action is DELAY: served after its level's other invocations."""
    return invocation.delay and 0 < invocation.queue_deadline_ms <= now_ms


def _at_level(level: int, entries: Sequence[Entry], replies: Sequence[Reply]) -> list[Reply]:
    return [reply for entry, reply in zip(entries, replies, strict=True) if entry.level == level]


def cold_timed(
    batch: Sequence[Entry],
    replies: Sequence[Reply],
    started_ns: int,
    reading_since_ms: int,
    model: LoadedModel,
    waited_s: float,
    took_s: float,
) -> list[Reply]:
    """The batch's replies with what each of its invocations waited for (fngate.wire.COLD_PHASES),
    for the gateway's Server-Timing: a runner to start, the queue, the model's files and their load
    (when this batch waited for a load: `waited_s`, split by what the load measured), the batch."""
    started_ms = started_ns / 1e6
    load_ms = waited_s * 1000
    fetch_ms = min(load_ms, model.download_s * 1000) if load_ms > 1 else 0.0
    timed = []
    for entry, reply in zip(batch, replies, strict=True):
        enqueued_ms = entry_ms(entry.id)
        start_ms = max(0.0, reading_since_ms - enqueued_ms)
        phases = {
            "start": start_ms,
            "queue": max(0.0, started_ms - enqueued_ms - start_ms),
            "fetch": fetch_ms,
            "load": max(0.0, load_ms - fetch_ms),
            "exec": took_s * 1000,
        }
        timed.append(dataclasses.replace(reply, timing={name: round(ms, 3) for name, ms in phases.items()}))
    return timed
