"""The one submission path: a Call's entries (gateway.submission) sent in one script call, its
outcome settled by one table, its pools woken once, and (synchronous) its reply awaited.

A synchronous call's answer is a future: the enqueue's outcome and the reply settle it from done
callbacks, and its deadline is a timer, so that a front end pays one await per invocation (or
none: it may add a done callback). The enqueue scripts of all invocations that arrive in one
event-loop turn go to Redis in one write (fngate.fastredis).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from redis.exceptions import NoScriptError, RedisError

from fngate import keys, queue, sequences, statistics, telemetry
from fngate.backoff import Health
from fngate.errors import DeadlineExceeded, FunctionError, Internal, InvalidArgument, Overloaded, Unavailable
from fngate.fastredis import FastRedis, Script
from fngate.manifest import BatchingSpec
from fngate.plan import Plan
from fngate.repository import FunctionVersion
from fngate.wire import Reply
from gateway import metrics, pipelines, submission
from gateway.activation import Activator
from gateway.cache import SeparateCache
from gateway.call import Call
from gateway.catalog import Catalog
from gateway.invocations import Accepted, AsyncInvocation, IdempotencyKeyReused
from gateway.limits import Limiter, refusal
from gateway.replies import ReplyRouter
from gateway.slots import SlotSteps
from gateway.submission import Entries

log = logging.getLogger(__name__)
tracer = trace.get_tracer("fngate.gateway")
REDIS = {"db.system.name": "redis"}


def settle(outcome: queue.EnqueueOutcome | queue.SubmitOutcome, entries: Entries, call: Call) -> Reply | None:
    """The outcome table, the same for every front end: the cached reply of a hit; None once
    queued (or waiting on an identical invocation, or done at once from the cache for an
    asynchronous call); a full queue raises Overloaded naming the entry refused, a caller over its
    limits RateLimited."""
    if isinstance(outcome, queue.Hit):
        return dataclasses.replace(Reply.decode(outcome.fields), cached=True)
    if isinstance(outcome, queue.Full):
        raise Overloaded(
            queue.full_message(entries.names[outcome.index], outcome.limit, call.later is not None)
        )
    if isinstance(outcome, queue.Limited):  # the key's limits, or its result quota ('quota')
        name = call.function.manifest.name
        raise refusal(call.principal, name, outcome.limit, outcome.retry_after_ms)
    if isinstance(outcome, queue.Pressure):
        raise Overloaded(outcome.describe())
    if isinstance(outcome, queue.Unstarted):
        assert call.sequence is not None
        raise sequences.not_started(call.function.manifest, call.sequence)
    if isinstance(outcome, queue.TooManySequences):
        raise Overloaded(
            f"function '{call.function.manifest.name}' has {outcome.max_live} sequences live "
            "(sequence.max_live): a new sequence may start once one ends or idles out; retry later"
        )
    return None


class Dispatcher:
    def __init__(
        self,
        redis: FastRedis,
        replies: ReplyRouter,
        catalog: Catalog,
        limiter: Limiter | None = None,
        cache: SeparateCache | None = None,
        activator: Activator | None = None,
        health: Health | None = None,
        result_quota_bytes: int = 0,
        result_memory_share: float = 0.0,
        deadline_admission: bool = True,
        group_invocations: bool = True,
    ) -> None:
        self._replies = replies
        self._group = group_invocations
        self._deadline_admission = deadline_admission
        self._depths: dict[str, tuple[int, float]] = {}
        """Per stream: its entries as this gateway's last enqueue on it found them, and when
        (time.monotonic()): what an invocation's wait is estimated from (no round trip of its own)."""
        self._result_quota_bytes = result_quota_bytes
        self._result_memory_share = result_memory_share
        self._catalog = catalog
        self._limiter = limiter
        self._health = health
        self._activator = activator
        self._redis = redis
        self._enqueue = Script(redis, queue.ENQUEUE)
        self._enqueue_many = Script(redis, queue.ENQUEUE_MANY)
        self._withdraw = Script(redis, queue.WITHDRAW)
        self._submit_async = Script(redis, queue.SUBMIT_ASYNC)
        self._slots = SlotSteps(redis) if redis.cluster else None
        """A Redis Cluster's: what the scripts would do across slots, in steps (gateway.slots)."""
        self._sequence_steps: dict[tuple[str, int | str], asyncio.Future[Reply]] = {}
        """The last step of each sequence sent through this gateway, until it is answered."""
        self._turn: list[_Flight] = []
        """The invocations of this event-loop turn, enqueued together at its end."""
        self.separate_cache = cache
        self._tracing = telemetry.tracing_active()
        self._loading: set[asyncio.Task[None]] = set()
        """Invocations past their deadline under the loading rule, and lookups in a separate cache."""

    @property
    def reply_stream(self) -> str:
        return self._replies.stream

    def invoke(self, call: Call) -> asyncio.Future[Reply]:
        """A synchronous call's answer: resolves with its Reply, or fails with the FunctionError it
        ended with (refused, its deadline passed, or the function answered an error). With the
        function's cache on, a cached answer comes at once and an identical invocation in flight is
        waited on; call.use_cache=False skips both but still stores the answer."""
        answer: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        try:
            self._check_available()
            if call.on_part is None:
                _check_one_answer(call)
            plan, steps = self._plan(call)
            admission = self._admission(call)
            split = self._slots is not None
            # On a cluster a pipeline's cached answer is on its own slot, looked up first.
            lookup_in_queue = (self.separate_cache is None or plan is not None) and not (split and plan)
            entries = submission.synchronous(
                call,
                self._replies.stream,
                _now_ms(),
                None if split else admission,
                lookup_in_queue,
                plan,
                steps,
                split,
            )
            self._check_pools(entries)
            if self._deadline_admission:
                self._check_deadline(call, plan, entries.script.keys[0], keys.SYNC, entries.timeout_ms)
        except FunctionError as exc:
            call.admission = None  # nothing was sent: no place was taken
            if call.span is not None:
                call.span.end()
            metrics.failed(call.function.name, exc.code.value)
            answer.set_exception(exc)
            return answer
        flight = _Flight(self, call, entries, answer, plan is not None)
        if not lookup_in_queue and entries.cache_entry and call.use_cache:
            cache = self._slots if plan is not None else self.separate_cache
            self._background(flight.look_up(cache))  # type: ignore[arg-type]
        elif call.sequence is not None:
            self._in_turn(flight, call.sequence.id)
        else:
            flight.send()
        return answer

    def _in_turn(self, flight: _Flight, sequence_id: int | str) -> None:
        """A sequence's step is queued once the step sent before it on this gateway is answered:
        a client that sends a sequence's steps without waiting (a gRPC stream, as Triton's stream
        client does) has them run one after the other, each with the state the last one left
        (written before this step's ENQUEUE, on the same connection)."""
        key = (flight.call.function.manifest.name, sequence_id)
        previous = self._sequence_steps.get(key)
        self._sequence_steps[key] = flight.answer

        def forget(answer: asyncio.Future[Reply]) -> None:
            if self._sequence_steps.get(key) is answer:
                del self._sequence_steps[key]

        flight.answer.add_done_callback(forget)
        if previous is None or previous.done():
            flight.send()
            return

        def send(_: asyncio.Future[Reply]) -> None:
            if not flight.answer.done():  # its deadline may have passed meanwhile
                flight.send()

        previous.add_done_callback(send)

    async def submit(self, call: Call) -> Accepted:
        """Queue an asynchronous call at level keys.ASYNC; raises what a synchronous one would be
        refused with, and IdempotencyKeyReused for an Idempotency-Key sent before with another
        request. A cached answer is its result at once: nothing is queued."""
        later = call.later
        assert later is not None
        try:
            self._check_available()
            _check_one_answer(call)
            sequences.checked(call.function.manifest, call.sequence, asynchronous=True)
            plan, steps = self._plan(call)
            if self._deadline_admission:
                await self._check_async_deadline(call, plan)
            admission = self._admission(call)
            manifest = call.function.manifest
            invocation_id = submission.new_async_id(call, plan)
            deadline_ms = _now_ms() + submission.timeout_of(call)
            record = AsyncInvocation(
                invocation_id,
                manifest.name,
                call.function.version,
                later.dialect,
                call.principal.key_id,
                deadline_ms,
                call.request_id,
                later.binary_outputs,
                later.callback_url,
                call.outputs if plan is not None else None,
            )
            if self._slots is not None:  # a Redis Cluster: the script's work in per-slot steps
                entries, outcome = await self._slots.submit(
                    call, record.encode(), invocation_id, deadline_ms, plan, steps, self.separate_cache,
                    self._check_pools, self._quota(call),
                )  # fmt: skip
            else:
                entries, outcome = await self._submit_one(call, record, deadline_ms, admission, plan, steps)
            if entries.cache_entry and call.use_cache:
                _count_lookup(manifest.name, outcome)
            if isinstance(outcome, queue.Queued) and outcome.depth:
                self.record_depth(entries.script.keys[0], outcome.depth)
            accepted = self._accepted(outcome, entries, call)
        except FunctionError as exc:
            metrics.failed(call.function.name, exc.code.value)
            raise
        finally:  # the 202 is its answer: it holds no place in the key's limits after it
            released = self._release(call)
            if released is not None:
                await asyncio.wait([released])
            if call.span is not None:
                call.span.end()
        return accepted

    async def _submit_one(
        self,
        call: Call,
        record: AsyncInvocation,
        deadline_ms: int,
        admission: queue.Admission | None,
        plan: Plan | None,
        steps: dict[str, FunctionVersion] | None,
    ) -> tuple[Entries, queue.SubmitOutcome]:
        """SUBMIT_ASYNC: the whole submission in one script call."""
        assert call.later is not None
        entry, _ = submission.cache_keys(call)
        lookup_in_queue = self.separate_cache is None or plan is not None
        cached = None
        if entry and call.use_cache and not lookup_in_queue:
            cached = await self.separate_cache.get(entry)  # type: ignore[union-attr]
        entries = submission.asynchronous(
            call,
            record.encode(),
            record.id,
            deadline_ms,
            admission,
            call.later.idempotency_key,
            cached,
            lookup_in_queue,
            plan,
            steps,
            self._quota(call),
        )
        self._check_pools(entries)
        try:
            raw = await self._submit_async(entries.script.keys, entries.script.args)
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        return entries, queue.parse_submit_async(raw)

    def _accepted(self, outcome: queue.SubmitOutcome, entries: Entries, call: Call) -> Accepted:
        if isinstance(outcome, queue.Done):
            return Accepted(entries.id, done=True)
        if isinstance(outcome, queue.Again):
            return Accepted(outcome.invocation_id, again=True)
        if isinstance(outcome, queue.Conflict):
            key = call.later.idempotency_key if call.later else ""
            raise IdempotencyKeyReused(
                f"Idempotency-Key '{key}' was used for another request (invocation"
                f" '{outcome.invocation_id}'): a new request needs a new key"
            )
        settle(outcome, entries, call)
        self.wake(entries)
        return Accepted(entries.id)

    def _quota(self, call: Call) -> queue.ResultQuota | None:
        """The result bytes the caller's key may hold (with auth off, every caller is one key)."""
        if not self._result_quota_bytes and not self._result_memory_share:
            return None
        return queue.ResultQuota(
            keys.result_quota(call.principal.key_id), self._result_quota_bytes, self._result_memory_share
        )

    def wake(self, entries: Entries) -> None:
        """Queued: wake each of its pools that has no runner."""
        if self._activator is not None:
            for pool in entries.pools:
                self._activator.wake(pool, entries.queued_ms)

    def _plan(self, call: Call) -> tuple[Plan | None, dict[str, FunctionVersion] | None]:
        """A pipeline's plan and resolved steps (None for a function). Traced, its steps' spans
        are children of a span of the pipeline's own, which ends with the call."""
        if call.function.manifest.pipeline is None:
            return None, None
        steps, plan = pipelines.resolve(self._catalog, call.function)
        if self._tracing:
            span = tracer.start_span(
                f"pipeline {call.function.name}",
                context=telemetry.extract(call.traceparent),
                attributes={"fngate.function": call.function.name, "fngate.version": call.function.version},
            )
            call.traceparent = telemetry.inject(trace.set_span_in_context(span))
            call.span = span
        return plan, steps

    def _admission(self, call: Call) -> queue.Admission | None:
        """The call's place in its key's limits, checked by the script that queues it."""
        limiter = self._limiter
        if limiter is None or not call.principal.limited:
            return None
        call.admission = limiter.admission(call.principal, call.function.manifest.name)
        return call.admission

    def _release(self, call: Call) -> asyncio.Future[Any] | None:
        """Out of the key's limits (in flight, queued); the future of Redis's answer, which the
        caller's answer waits for: a next invocation of the caller's, sent once it has its answer
        through any gateway, finds its place free."""
        admission, call.admission = call.admission, None
        if admission is None or self._limiter is None:
            return None
        return self._limiter.release(call.principal, call.function.manifest.name, admission)

    def _check_available(self) -> None:
        """Redis known down (the reply, activator or catalog loop saw it): answer now, not at a
        timeout."""
        if not self._replies.healthy or (self._health is not None and not self._health.available):
            raise Unavailable("the queue is unavailable: Redis cannot be reached")

    def _check_deadline(
        self, call: Call, plan: Plan | None, stream: str, level: int, timeout_ms: int
    ) -> None:
        """Refuse at once what cannot be answered by its deadline (_check_function_wait): a function
        queued on `stream`, or a pipeline, when one of its first steps (queued at `level`) cannot be
        answered by the pipeline's deadline; the later steps' waits are not counted (errs towards
        admitting)."""
        manifest = call.function.manifest
        if plan is None:
            what = f"function '{manifest.name}'"
            self._check_function_wait(manifest.name, manifest.batching, stream, timeout_ms, what)
            return
        for index in plan.first():
            step = plan.steps[index]
            function = self._catalog.functions.get(step.function)
            if function is None:
                continue
            what = f"step '{step.name}' of pipeline '{manifest.name}' (function '{step.function}')"
            step_stream = keys.invocations(step.function, level)
            self._check_function_wait(
                step.function, function.manifest.batching, step_stream, timeout_ms, what
            )

    async def _check_async_deadline(self, call: Call, plan: Plan | None) -> None:
        """An asynchronous call, refused at once as a synchronous one is: by its deadline (its
        timeout, or the function's async_timeout_s), behind what waits at level keys.ASYNC and at
        every synchronous level, which runners read first. A repeat of a submission that was
        accepted (its Idempotency-Key known) is never refused: it answers the invocation it made."""
        stream = keys.invocations(call.function.manifest.name, keys.ASYNC)
        try:
            self._check_deadline(call, plan, stream, keys.ASYNC, submission.timeout_of(call))
        except Unavailable:
            later = call.later
            if later is not None and later.idempotency_key:
                known = keys.idempotency(call.principal.key_id, later.idempotency_key)
                try:
                    if await self._redis.execute("EXISTS", known):
                        return
                except (RedisError, OSError) as exc:
                    raise Unavailable(f"the queue is unavailable: {exc}") from exc
            raise

    def _check_function_wait(
        self, function: str, batching: BatchingSpec, stream: str, timeout_ms: int, what: str
    ) -> None:
        """Refuse at once what cannot be answered by its deadline: the invocations ahead of it on
        `stream` and on the streams of the function's higher priority levels, which runners read
        first (each as this gateway last saw it, less what its runners have run since), at the
        batch cost its runners measured, shared among them. Full batches are assumed, and each
        level is drained by all the work done since: an estimate that errs refuses too little,
        never too much."""
        cost = self._catalog.cost(function)
        if cost is None:
            return
        max_batch, now = batching.max_batch_size, time.monotonic()
        ahead, seen_any = 0.0, False
        for level in streams_ahead(function, batching.priorities, stream):
            seen = self._depths.get(level)
            if seen is not None:
                seen_any = True
                ahead += remaining(seen[0], now - seen[1], cost, max_batch)
        if not seen_any:
            return
        wait_ms = wait_behind_ms(ahead, cost, max_batch)
        if wait_ms > timeout_ms:
            raise Unavailable(
                f"{what} would answer in about {wait_ms:.0f} ms (invocations queued ahead of it, at "
                f"the batch cost its {cost[2]} runner(s) measured), past this call's deadline of "
                f"{timeout_ms} ms; retry later"
            )

    def record_depth(self, stream: str, depth: int) -> None:
        self._depths[stream] = (depth, time.monotonic())

    def _check_pools(self, entries: Entries) -> None:
        if self._activator is not None:
            for pool in entries.pools:
                self._activator.check(pool)

    def _enqueue_soon(self, flight: _Flight) -> None:
        if not self._turn:
            asyncio.get_running_loop().call_soon(self._enqueue_turn)
        self._turn.append(flight)

    def _enqueue_turn(self) -> None:
        """One script call for the turn's invocations: ENQUEUE for one, ENQUEUE_MANY for more (in
        Redis a script call costs about as much as the invocation it decides); on a Redis Cluster
        one per slot."""
        flights, self._turn = self._turn, []
        if self._slots is None:
            self._enqueue_together(flights)
            return
        by_slot: dict[int, list[_Flight]] = {}
        for flight in flights:
            by_slot.setdefault(keys.slot(flight.entries.script.keys[0]), []).append(flight)
        for together in by_slot.values():
            self._enqueue_together(together)

    def _enqueue_together(self, flights: list[_Flight], pack: bool = True) -> None:
        """The turn's invocations of one Redis (or slot) in one script call. Those that need no
        decision of their own go packed, one entry built here for each stream's (ENQUEUE_MANY's
        packed items); `pack` False: each decided on its own (what did not fit packed, again)."""
        if len(flights) == 1:
            (flight,) = flights
            script = flight.entries.script
            self._enqueue.send(script.keys, script.args).add_done_callback(flight.enqueued)
            return
        scripts = [flight.entries.script for flight in flights]
        turn = queue.turn_call(scripts, [flight.shares() for flight in flights] if self._group else (), pack)
        self._enqueue_many.send(turn.call.keys, turn.call.args).add_done_callback(
            lambda future: self._enqueued_many(flights, turn, future)
        )

    def _enqueued_many(
        self, flights: list[_Flight], turn: queue.TurnCall, future: asyncio.Future[Any]
    ) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if isinstance(error, NoScriptError):  # a new or restarted Redis: load the script
            self._background(self._enqueue_many_loading(flights, turn))
        elif error is not None:
            for flight in flights:
                flight.enqueue_failed(error)
        else:
            self._settle_turn(flights, turn, future.result())

    async def _enqueue_many_loading(self, flights: list[_Flight], turn: queue.TurnCall) -> None:
        try:
            outcomes = await self._enqueue_many(turn.call.keys, turn.call.args)
        except Exception as exc:
            for flight in flights:
                flight.enqueue_failed(exc)
            return
        self._settle_turn(flights, turn, outcomes)

    def _settle_turn(self, flights: list[_Flight], turn: queue.TurnCall, raw: Any) -> None:
        outcomes, again = queue.turn_outcomes(turn, raw)
        for flight, outcome in zip(flights, outcomes, strict=True):
            if outcome is not None:
                flight.outcome(outcome)
        if again:  # a packed entry past its stream's room: each decided on its own, in order
            self._enqueue_together([flights[at] for at in again], pack=False)

    def _count_pipeline(self, call: Call, failed: bool) -> None:
        """A pipeline's (an ensemble's) own statistics, to which no batch adds (its steps' batches
        add to their functions'): each answered call as one request, from its arrival here to its
        answer, in the hash runners add to. (A call answered from the cache counts too.)"""
        key = keys.statistics(call.function.name, call.function.version)
        took_ns = int((time.perf_counter() - call.started) * 1e9) if call.started else 0
        kind = "fail" if failed else "success"
        sends = [("HINCRBY", key, f"{kind}_count", 1), ("HINCRBY", key, f"{kind}_ns", took_ns)]
        if not failed:
            sends += [
                ("HINCRBY", key, "inference_count", 1),
                ("HINCRBY", key, "execution_count", 1),
                ("HSET", key, statistics.LAST_INFERENCE, _now_ms()),
            ]
        for command in sends:
            self._redis.send(*command).add_done_callback(_uncounted)

    async def withdraw(self, flight: _Flight) -> None:
        """A queued synchronous invocation whose caller left (or a stream's past its deadline): its
        entry taken back, or where a runner read it already, that runner told to answer it unrun
        (unless identical invocations wait on it), so that no runner spends a batch on it; a
        streaming batch that runs it is told (is_cancelled())."""
        script = flight.entries.script
        name = flight.call.function.manifest.name
        channel = keys.left_channel(name)
        call = queue.withdraw_call(
            script.keys[0],
            flight.entry_id,
            script.keys[3],
            keys.RUNNER_GROUP,
            channel,
            self._slots is not None,
        )
        try:
            outcome = (await self._withdraw(call.keys, call.args)).decode()
        except (RedisError, OSError) as exc:  # it runs, and its reply finds no one
            log.debug("could not withdraw %s: %s", flight.entries.id, exc)
            outcome = "failed"
        metrics.WITHDRAWN.labels(name, outcome).inc()

    def _idle_from_now(self, call: Call, state: bytes) -> None:
        """A sequence's step has its answer (or ended otherwise): its sequence lives its idle
        timeout from now, as Triton counts it (idle: no step queued or running), holding the
        implicit state the step left (`state`; b"": as it was). Written before the answer goes out,
        so the caller's next step finds it done; a sequence ended or expired meanwhile stays so."""
        spec, step = call.function.manifest.sequence, call.sequence
        if spec is None or step is None:
            return
        key, idle_ms = keys.sequence(call.function.manifest.name, step.id), sequences.idle_ms(spec)
        command = ("SET", key, state, "PX", idle_ms, "XX") if state else ("PEXPIRE", key, idle_ms)
        self._redis.send(*command).add_done_callback(_idle_unset)

    def _background(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._loading.add(task)
        task.add_done_callback(self._loading.discard)


class _Flight:
    """One synchronous invocation between its enqueue and its answer."""

    __slots__ = (
        "_span",
        "answer",
        "call",
        "dispatcher",
        "entries",
        "entry_id",
        "pipeline",
        "queued",
        "state",
        "timer",
    )

    def __init__(
        self,
        dispatcher: Dispatcher,
        call: Call,
        entries: Entries,
        answer: asyncio.Future[Reply],
        pipeline: bool,
    ) -> None:
        self.dispatcher = dispatcher
        self.call = call
        self.entries = entries
        self.answer = answer
        self.pipeline = pipeline
        self.queued = False
        self.entry_id = b""
        """Its entry on its function's stream, once queued (not when it waits on an identical one)."""
        self.state = b""
        """A sequence's step: the implicit state its answer left (fngate.sequences)."""
        self._span: Span | None = None
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(entries.timeout_ms / 1000, self._deadline)
        dispatcher._replies.expect(entries.id, self._replied)
        answer.add_done_callback(self._done)

    def shares(self) -> int:
        """How many invocations its stream entry may hold (ENQUEUE_MANY), 0 for one of its own: a
        function's synchronous invocation of its own (no pipeline's step, no sequence's step, no
        stream of responses) shares one with those of its turn, up to a batch of them."""
        call = self.call
        if self.pipeline or call.sequence is not None or call.on_part is not None:
            return 0
        most = call.function.manifest.batching.max_batch_size
        return most if most > 1 else 0

    def send(self) -> None:
        dispatcher = self.dispatcher
        if dispatcher._tracing:
            name = self.call.function.manifest.name
            self._span = tracer.start_span(
                f"enqueue {name}",
                context=telemetry.extract(self.call.traceparent),
                kind=SpanKind.PRODUCER,
                attributes=REDIS,
            )
        if dispatcher._slots is not None and self.call.admission is not None:
            dispatcher._background(self._admit_first(dispatcher._slots))  # a cluster: on its own slot
        else:
            dispatcher._enqueue_soon(self)

    async def _admit_first(self, slots: SlotSteps) -> None:
        try:
            await slots.admit(self.call)
        except FunctionError as exc:
            if self._span is not None:
                self._span.end()
            self._fail(exc)
            return
        if not self.answer.done():
            self.dispatcher._enqueue_soon(self)

    async def _forward_rest(self, slots: SlotSteps) -> None:
        """A cluster's: a pipeline's other first steps, once its first is queued."""
        try:
            await slots.forward(self.entries)
        except FunctionError as exc:
            self._fail(exc)

    async def look_up(self, cache: SeparateCache | SlotSteps) -> None:
        """The answer from a cache Redis of the cache's own, else the enqueue."""
        with tracer.start_as_current_span(
            "cache lookup",
            context=telemetry.extract(self.call.traceparent),
            kind=SpanKind.CLIENT,
            attributes=REDIS,
        ) as span:
            hit = await cache.get(self.entries.cache_entry)
            span.set_attribute("fngate.cache_hit", hit is not None)
        if self.answer.done():
            return
        if hit is not None:
            self._succeed(dataclasses.replace(Reply.decode(hit), cached=True))
        else:
            self.send()

    def enqueued(self, future: asyncio.Future[Any]) -> None:
        """The ENQUEUE of this invocation alone."""
        if future.cancelled():
            return
        error = future.exception()
        if isinstance(error, NoScriptError):  # a new or restarted Redis: load the script
            self.dispatcher._background(self._enqueue_loading())
        elif error is not None:
            self.enqueue_failed(error)
        else:
            self.outcome(future.result())

    async def _enqueue_loading(self) -> None:
        script = self.entries.script
        try:
            raw = await self.dispatcher._enqueue(script.keys, script.args)
        except Exception as exc:
            self.enqueue_failed(exc)
            return
        self.outcome(raw)

    def enqueue_failed(self, error: BaseException) -> None:
        if self._span is not None:
            self._span.end()
        if isinstance(error, RedisError | OSError):
            self._fail(Unavailable(f"the queue is unavailable: {error}"))
        else:
            log.error("the enqueue of %s failed unexpectedly", self.entries.id, exc_info=error)
            self._fail(Internal("the enqueue failed unexpectedly"))

    def outcome(self, raw: Any) -> None:
        if self._span is not None:
            self._span.end()
        outcome = queue.parse_enqueue(raw)
        if isinstance(outcome, queue.Queued):
            self.entry_id = outcome.entry_id
            self.dispatcher.record_depth(self.entries.script.keys[0], outcome.depth)
        if self.answer.done():  # the deadline passed first, or the caller left while it was sent
            if self.answer.cancelled() and self.entry_id and not self.pipeline:
                self.dispatcher._background(self.dispatcher.withdraw(self))
            return
        try:
            cached = settle(outcome, self.entries, self.call)
        except FunctionError as exc:
            self._fail(exc)
            return
        if cached is not None:
            self._succeed(cached)
            return
        self.queued = True
        self.dispatcher.wake(self.entries)
        if self.entries.rest and self.dispatcher._slots is not None:
            self.dispatcher._background(self._forward_rest(self.dispatcher._slots))

    def _replied(self, reply: Reply) -> None:
        if reply.part:  # a decoupled model's response, on its way
            if self.call.on_part is not None and not self.answer.done():
                self.call.on_part(reply)
            return
        if reply.error is not None:
            self._fail(reply.error)
        else:
            self.state = reply.state
            self._succeed(reply)

    def _deadline(self) -> None:
        if self.answer.done():
            return
        if self.queued and self.dispatcher._activator is not None:
            # The loading rule: past the deadline, a queued invocation waits on while its model loads.
            self.dispatcher._background(self._loading_rule(self.dispatcher._activator))
            return
        self._fail(self._too_late())

    async def _loading_rule(self, activator: Activator) -> None:
        function, entries = self.call.function, self.entries
        since_ms = entries.queued_ms
        try:
            if not await activator.on_the_way(function, since_ms):
                raise self._too_late()
            await activator.await_load(function, self.answer, since_ms, entries.timeout_ms)
        except FunctionError as exc:
            self._fail(exc)

    def _too_late(self) -> DeadlineExceeded:
        kind = "pipeline" if self.pipeline else "function"
        name = self.call.function.manifest.name
        return DeadlineExceeded(f"{kind} '{name}' did not answer within {self.entries.timeout_ms} ms")

    def _succeed(self, reply: Reply) -> None:
        if self.answer.done():
            return
        outputs = self.call.outputs
        if self.pipeline and outputs is not None:
            reply = dataclasses.replace(reply, outputs={name: reply.outputs[name] for name in outputs})
        self._settle(reply, None)

    def _fail(self, error: FunctionError) -> None:
        if not self.answer.done():
            self._settle(None, error)

    def _settle(self, reply: Reply | None, error: FunctionError | None) -> None:
        """The answer, once the call is out of its key's limits."""
        self.timer.cancel()
        released = self.dispatcher._release(self.call)
        if released is None:
            self._answer(reply, error)
        else:
            released.add_done_callback(lambda _: self._answer(reply, error))

    def _answer(self, reply: Reply | None, error: FunctionError | None) -> None:
        if self.answer.done():
            return
        if error is not None:
            self.answer.set_exception(error)
        else:
            self.answer.set_result(reply)  # type: ignore[arg-type]

    def _done(self, answer: asyncio.Future[Reply]) -> None:
        """Whatever ended it (an answer, a refusal, the deadline, a caller that went away)."""
        self.timer.cancel()
        dispatcher, call = self.dispatcher, self.call
        dispatcher._replies.forget(self.entries.id)
        dispatcher._release(call)  # a caller that went away: its place is freed all the same
        if call.span is not None:
            call.span.end()
        name = call.function.manifest.name
        if call.sequence is not None and not call.sequence.end:
            dispatcher._idle_from_now(call, self.state)
        if answer.cancelled():  # the caller left (a reset RPC, a closed connection)
            if self.entry_id and not self.pipeline:
                dispatcher._background(dispatcher.withdraw(self))
            return
        error = answer.exception()
        if call.on_part is not None and isinstance(error, DeadlineExceeded) and self.entry_id:
            dispatcher._background(dispatcher.withdraw(self))  # a stream past its deadline: its model stops
        if self.pipeline:
            dispatcher._count_pipeline(call, error is not None)
        if error is None:
            reply = answer.result()
            metrics.answered(name, reply.version, call.started)
            if call.function.manifest.cache.enabled:
                metrics.looked_up(name, reply.cached)
        else:
            metrics.failed(name, error.code.value if isinstance(error, FunctionError) else "internal")
            metrics.took(name, call.started)


def _check_one_answer(call: Call) -> None:
    """A decoupled model answers a request with any number of responses: only a stream carries them."""
    spec = call.function.manifest.model_spec
    if spec is not None and spec.decoupled:
        raise InvalidArgument(
            f"model '{call.function.manifest.model_name}' is decoupled (any number of responses a "
            "request): call it over gRPC ModelStreamInfer, which streams its responses; this route "
            "answers once"
        )


def _count_lookup(function: str, outcome: queue.SubmitOutcome) -> None:
    """A cache hit or miss, as a synchronous invocation's; a submission refused before the lookup
    counts neither."""
    if isinstance(outcome, queue.Done):
        metrics.looked_up(function, True)
    elif not isinstance(outcome, queue.Again | queue.Conflict | queue.Limited | queue.Pressure):
        metrics.looked_up(function, False)


@functools.lru_cache(maxsize=4096)
def streams_ahead(function: str, priorities: int, stream: str) -> tuple[str, ...]:
    """The streams whose invocations a runner takes before one on `stream`: the function's levels
    from the highest priority down to `stream`'s, the asynchronous level after every synchronous one
    (`stream` alone when it is none of them)."""
    levels = keys.levels(function, priorities)
    return levels[: levels.index(stream) + 1] if stream in levels else (stream,)


def remaining(depth: float, since_s: float, cost: tuple[float, float, int], max_batch: int) -> float:
    """What is left of `depth` invocations after `since_s` of work: batches of `max_batch` at `cost`
    (fixed µs a batch, µs a row, runners sharing them)."""
    fixed_us, row_us, runners = cost
    per_invocation_us = row_us + fixed_us / max(1, max_batch)
    if per_invocation_us <= 0:
        return 0.0
    return max(0.0, depth - since_s * 1e6 / per_invocation_us * max(1, runners))


def wait_behind_ms(ahead: float, cost: tuple[float, float, int], max_batch: int) -> float:
    """How long a new invocation (one row) waits for its answer behind `ahead` others, its own batch
    included."""
    fixed_us, row_us, runners = cost
    if row_us + fixed_us <= 0:
        return 0.0
    batch = max(1, max_batch)
    return (math.ceil((ahead + 1) / batch) * fixed_us + (ahead + 1) * row_us) / max(1, runners) / 1000


def estimated_wait_ms(depth: int, since_s: float, cost: tuple[float, float, int], max_batch: int) -> float:
    """How long a new invocation waits behind `depth` others on one stream, less what `since_s` of
    work has run of them."""
    return wait_behind_ms(remaining(depth, since_s, cost, max_batch), cost, max_batch)


def _uncounted(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.debug("a pipeline's statistics were not counted: %s", future.exception())


def _idle_unset(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.debug("a sequence's idle timeout was not set: %s", future.exception())


def _now_ms() -> int:
    return int(time.time() * 1000)
