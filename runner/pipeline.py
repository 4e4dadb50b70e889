"""A finished pipeline step: queue the steps that follow it on their functions' streams (with the
step's outputs and the tensors later steps read), meet the other predecessors at a join, or answer
the gateway for the whole pipeline: its outputs after the last step, or the first step's error."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from prometheus_client import Counter

from fngate import keys, queue, telemetry
from fngate.errors import FunctionError, Overloaded
from fngate.pipeline import (
    StepContext,
    carried_for,
    decode_tensors,
    encode_tensors,
    outputs_of,
    step_inputs,
)
from fngate.pipelined import PipelinedRedis, Script
from fngate.wire import Invocation, Reply

Available = Mapping[str, np.ndarray[Any, Any]]
tracer = trace.get_tracer("fngate.runner")
PIPELINE_STEPS = Counter(
    "fngate_pipeline_steps", "Pipeline steps a runner finished, by outcome", ["pipeline", "step", "outcome"]
)


class Steps:
    """The forwarding of one runner's finished steps, on the outbox's connection."""

    def __init__(self, redis: PipelinedRedis) -> None:
        self._forward = Script(redis, queue.FORWARD)
        self._join = Script(redis, queue.JOIN)

    async def finish(self, finished: Sequence[tuple[bytes, bytes, Reply]]) -> list[queue.Outgoing]:
        """Queue what follows each (entry id, step context, reply), before its entry is
        acknowledged (at least once: a runner that dies here leaves the entry to be claimed and run
        again, and the gateway answers the first final reply only). Returns the pipelines' replies
        to send."""
        contexts = [StepContext.decode(raw) for _entry_id, raw, _reply in finished]
        for (entry_id, _raw, reply), context in zip(finished, contexts, strict=True):
            _trace(context, reply, int(entry_id.split(b"-", 1)[0]))
        done = await asyncio.gather(
            *(self._finish_one(context, item[2]) for context, item in zip(contexts, finished, strict=True))
        )
        return [item for item in done if item is not None]

    async def _finish_one(self, context: StepContext, reply: Reply) -> queue.Outgoing | None:
        plan, step = context.plan, context.step
        PIPELINE_STEPS.labels(
            plan.pipeline, step.name, reply.error.code.value if reply.error else "success"
        ).inc()
        if reply.error is not None:
            return _answer(
                context, Reply(context.invocation_id, plan.version, {}, named(context, reply.error))
            )
        available = {**context.carried, **outputs_of(step.name, reply.outputs)}
        entries: list[tuple[int, queue.Forward]] = []
        final: Reply | None = None
        for successor in plan.successors(context.node):
            ready = await self._meet(context, successor, available)
            if ready is None:
                continue  # another predecessor still runs; the last one to finish goes on
            if successor == plan.end:
                outputs = step_inputs(plan, successor, ready)
                final = Reply(
                    context.invocation_id, plan.version, outputs, None, reply.batch_id, reply.batch_size
                )
            else:
                entries.append((successor, _entry(context, successor, ready)))
        if entries:
            refused = queue.parse_forward(
                await self._forward(*_call(queue.forward_call([e for _, e in entries])))
            )
            if refused is not None:
                index, limit = refused
                target = plan.steps[entries[index][0]]
                error = Overloaded(
                    f"step '{target.name}' ({target.function} v{target.version}): function "
                    f"'{target.function}' has too many invocations queued ({limit}); retry later"
                )
                return _answer(context, Reply(context.invocation_id, plan.version, {}, error))
        return _answer(context, final, cached=True) if final is not None else None

    async def _meet(self, context: StepContext, node: int, available: Available) -> Available | None:
        """What `node` reads once every predecessor has finished (at once when this is its only
        one); None while others are still to come."""
        plan = context.plan
        sources = plan.predecessors(node)
        if len(sources) == 1:
            return available
        wanted = plan.needed(node)
        contribution = encode_tensors(
            {}, {name: array for name, array in available.items() if name in wanted}
        )
        ttl_ms = context.deadline_ms - int(time.time() * 1000)
        call = queue.join_call(
            context.invocation_id, node, context.step.name, contribution, len(sources), ttl_ms
        )
        parts = queue.parse_join(await self._join(*_call(call)))
        if parts is None:
            return None
        merged: dict[str, np.ndarray[Any, Any]] = {}
        for part in parts.values():
            merged.update(decode_tensors(part)[1])
        return merged


def _trace(context: StepContext, reply: Reply, queued_ms: int) -> None:
    """The step's span in its pipeline's trace, from its queueing to now (the queue and execute
    spans of its function sit beside it, under the same parent)."""
    parent = telemetry.extract(context.traceparent)
    if parent is None:
        return
    step = context.step
    span = tracer.start_span(
        f"step {step.name}",
        context=parent,
        start_time=queued_ms * 1_000_000,
        attributes={
            "fngate.pipeline": context.plan.pipeline,
            "fngate.step": step.name,
            "fngate.function": step.function,
            "fngate.version": step.version,
            "fngate.batch_id": reply.batch_id,
        },
    )
    if reply.error is not None:
        span.set_status(Status(StatusCode.ERROR, reply.error.message))
    span.end()


def named(context: StepContext, error: FunctionError) -> FunctionError:
    """The step's error, its class kept, its message naming the step: "step 'score' (mlp v2): ..."."""
    step = context.step
    return FunctionError.from_code(
        error.code.value, f"step '{step.name}' ({step.function} v{step.version}): {error.message}"
    )


def _entry(context: StepContext, node: int, available: Available) -> queue.Forward:
    step = context.plan.steps[node]
    invocation = Invocation(
        id=context.invocation_id,  # any reply a step gets outside its pipeline still answers the pipeline
        function=step.function,
        version=step.version,
        reply_to=context.reply_to,
        deadline_ms=context.deadline_ms,
        inputs=step_inputs(context.plan, node, available),
        traceparent=context.traceparent,
        digest=step.digest,
    )
    following = dataclasses.replace(context, node=node, carried=carried_for(context.plan, node, available))
    return queue.Forward(
        keys.invocations(step.function),
        invocation.encode(),
        following.encode(),
        step.max_queue_size,
        step.max_queue_bytes,
    )


def _answer(context: StepContext, reply: Reply, cached: bool = False) -> queue.Outgoing:
    """The pipeline's reply to its gateway; a success is stored in the response cache when asked."""
    return queue.Outgoing(
        reply.encode(),
        context.reply_to,
        context.cache_key if cached else "",
        context.cache_ttl_s,
    )


def _call(call: queue.ScriptCall) -> tuple[list[str], list[Any]]:
    return call.keys, list(call.args)
