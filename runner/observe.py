"""What one function's consumer reports of its batches: Prometheus metrics for every batch and
invocation, spans only while tracing is on (even no-op spans cost more than a tiny model's batch),
and the cold start of a model loaded for a batch."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from fngate import telemetry
from fngate.errors import FunctionError
from fngate.repository import FunctionVersion
from fngate.wire import Invocation, Reply
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
from runner.outbox import Entry

tracer = trace.get_tracer("fngate.runner")


def entry_ms(entry_id: bytes) -> int:
    """When a stream entry was added (its id's first part)."""
    return int(entry_id.split(b"-", 1)[0])


class BatchObserver:
    def __init__(self, function: str) -> None:
        self._name = function
        # The metrics every batch touches, looked up once.
        self.compute_duration = COMPUTE_DURATION.labels(function)
        self._batch_size = BATCH_SIZE.labels(function)
        self._queue_duration = QUEUE_DURATION.labels(function)
        self._successes = INVOCATIONS.labels(function, "success")
        self.traced = telemetry.tracing_active()

    def batch_span(
        self, invocations: Sequence[Invocation]
    ) -> tuple[list[Context | None], contextlib.AbstractContextManager[Span | None]]:
        """The invocations' trace contexts and the batch's span, linked to them: none unless traced."""
        if not self.traced:
            return [], contextlib.nullcontext()
        parents = [telemetry.extract(invocation.traceparent) for invocation in invocations]
        links = [Link(trace.get_current_span(parent).get_span_context()) for parent in parents if parent]
        return parents, tracer.start_as_current_span(f"batch {self._name}", links=links)

    async def load(self, models: LoadedModels, function: FunctionVersion) -> LoadedModel:
        """The model, loaded now if this batch is its first (a cold start, with a span of its own);
        held until `models.release`."""
        name = function.name
        if (name, function.version) in models.loaded:
            return await models.acquire(function)
        COLD_STARTS.labels(name).inc()
        started = time.perf_counter()
        with tracer.start_as_current_span(f"load {name}", attributes={"fngate.cold_start": True}):
            try:
                model = await models.acquire(function)
            except FunctionError:
                MODEL_LOADS.labels(name, "failed").inc()
                raise
        MODEL_LOADS.labels(name, "loaded").inc()
        MODEL_LOAD_DURATION.labels(name).observe(time.perf_counter() - started)
        MODELS_LOADED.set(len(models.loaded))
        return model

    def observe(self, batch: Sequence[Entry], replies: Sequence[Reply], started_ns: int, rows: int) -> None:
        """Metrics for the batch and its invocations."""
        name, version = self._name, batch[0].invocation.version  # the version this batch ran
        EXECUTION_COUNT.labels(name, version).inc()
        INFERENCE_COUNT.labels(name, version).inc(rows)
        self._batch_size.observe(rows)
        started_ms = started_ns / 1e6
        succeeded = 0
        for entry, reply in zip(batch, replies, strict=True):
            self._queue_duration.observe(max(0.0, started_ms - entry_ms(entry.id)) / 1000)
            if reply.error is None:
                succeeded += 1
            else:
                INVOCATIONS.labels(name, reply.error.code.value).inc()
        if succeeded:
            self._successes.inc(succeeded)

    def trace(
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
        name = self._name
        ended_ns = time.time_ns()
        batch_link = [Link(batch_span.get_span_context())]
        for entry, reply, parent in zip(batch, replies, parents, strict=True):
            if parent is None:
                continue
            invocation = entry.invocation
            queued_ns = entry_ms(entry.id) * 1_000_000
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
