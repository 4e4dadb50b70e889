"""A finished pipeline step: queue the steps that follow it on their functions' streams (with the
step's outputs and the tensors later steps read), meet the other predecessors at a join, or answer
the gateway for the whole pipeline: its outputs after the last step, or the first step's error."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from prometheus_client import Counter

from fngate import delivery, keys, queue, telemetry
from fngate.cache_key import cache_key
from fngate.errors import FunctionError, Internal, Overloaded
from fngate.fastredis import FastRedis, Script
from fngate.plan import (
    StepContext,
    carried_for,
    decode_tensors,
    encode_tensors,
    outputs_of,
    step_entry,
    step_inputs,
)
from fngate.tensors import Tensors
from fngate.wire import Invocation, Reply

log = logging.getLogger(__name__)
Available = Mapping[str, np.ndarray[Any, Any]]
tracer = trace.get_tracer("fngate.runner")
PIPELINE_STEPS = Counter(
    "fngate_pipeline_steps", "Pipeline steps a runner finished, by outcome", ["pipeline", "step", "outcome"]
)


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    """A pipeline step's entry and its reply."""

    entry_id: bytes
    step: bytes
    """Its context (fngate.queue.STEP)."""
    invocation: Invocation
    reply: Reply


class Steps:
    """The forwarding of one runner's finished steps, on the outbox's connection."""

    def __init__(self, redis: FastRedis, caching: bool = True) -> None:
        self._redis = redis
        self._caching = caching
        """Steps whose function has its cache on are looked up and stored (in the queue's Redis)."""
        self._forward = Script(redis, queue.FORWARD)
        self._join = Script(redis, queue.JOIN)
        self._across_slots = delivery.scripts(redis) if redis.cluster else None
        """A Redis Cluster's FORWARD, slot by slot (fngate.delivery)."""

    async def finish(self, finished: Sequence[Finished], ran_digest: str = "") -> list[queue.Outgoing]:
        """Queue what follows each finished step, before its entry is acknowledged (at least once:
        a runner that dies here leaves the entry to be claimed and run again, and the gateway
        answers the first final reply only). Returns the pipelines' replies to send."""
        decoded = [(item, _context(item)) for item in finished]
        broken = [item for item, context in decoded if context is None]
        pairs = [(item, context) for item, context in decoded if context is not None]
        for item, context in pairs:
            _trace(context, item.reply, int(item.entry_id.split(b"-", 1)[0]))
        stores = [
            self._store(context, item)
            for item, context in pairs
            if self._caching
            and context.step.cache_ttl_s
            and item.reply.error is None
            # only answers of the files the gateway resolved (during a rollout a runner may differ)
            and item.invocation.digest == ran_digest
        ]
        done = await asyncio.gather(
            *stores,
            *(self._finish_one(context, item.reply) for item, context in pairs),
        )
        answers = [outgoing for replies in done[len(stores) :] for outgoing in replies or ()]
        for item in broken:  # its pipeline cannot go on: its gateway hears so at once
            error = Internal(
                f"function '{item.invocation.function}': a pipeline step's context does not decode"
            )
            reply = Reply(item.invocation.id, item.invocation.version, {}, error)
            answers.append(queue.Outgoing(reply.encode(), item.invocation.reply_to))
        return answers

    async def _finish_one(self, context: StepContext, reply: Reply) -> list[queue.Outgoing]:
        plan, step = context.plan, context.step
        PIPELINE_STEPS.labels(
            plan.pipeline, step.name, reply.error.code.value if reply.error else "success"
        ).inc()
        if reply.error is not None:
            return [
                _answer(context, Reply(context.invocation_id, plan.version, {}, named(context, reply.error)))
            ]
        available = {**context.carried, **outputs_of(step.name, reply.outputs)}
        entries: list[tuple[int, queue.Forward]] = []
        answers: list[queue.Outgoing] = []
        for successor in plan.successors(context.node):
            ready = await self._meet(context, successor, available)
            if ready is None:
                continue  # another predecessor still runs; the last one to finish goes on
            inputs = step_inputs(plan, successor, ready)
            if successor == plan.end:
                final = Reply(
                    context.invocation_id, plan.version, inputs, None, reply.batch_id, reply.batch_size
                )
                answers.append(_answer(context, final, cached=True))
                continue
            following = dataclasses.replace(
                context, node=successor, carried=carried_for(plan, successor, ready)
            )
            cached = await self._lookup(following, inputs)
            if cached is not None:  # answered from the cache: the step is done already
                answers += await self._finish_one(following, cached)
            else:
                entries.append((successor, step_entry(following, inputs)))
        if entries:
            refused = await self._queue([entry for _, entry in entries])
            if refused is not None:
                index, limit = refused
                target = plan.steps[entries[index][0]]
                error = Overloaded(queue.full_message(target.described, limit, context.level != keys.SYNC))
                answers.append(_answer(context, Reply(context.invocation_id, plan.version, {}, error)))
        return answers

    async def _queue(self, entries: list[queue.Forward]) -> tuple[int, str] | None:
        """FORWARD: None once queued, else (index of the entry refused, 'count' or 'bytes')."""
        if self._across_slots is not None:
            return await delivery.forward(self._across_slots, entries)
        return queue.parse_forward(await self._forward(*_call(queue.forward_call(entries))))

    async def _lookup(self, context: StepContext, inputs: Tensors) -> Reply | None:
        """The cached answer of a step whose function has its cache on, as a direct call with the
        same inputs would find it."""
        step = context.step
        if not (self._caching and step.cache_ttl_s):
            return None
        found: Any = await self._redis.execute("HMGET", _cache_entry(context, inputs), "h", "b")
        if not found or found[0] is None:
            return None
        return Reply.decode({queue.HEADER: found[0], queue.BODY: found[1] or b""})

    async def _store(self, context: StepContext, item: Finished) -> None:
        """A step's answer under the key a direct call of its function uses."""
        entry = _cache_entry(context, item.invocation.inputs)
        fields = dataclasses.replace(item.reply, id=item.invocation.id).encode()
        await asyncio.gather(
            self._redis.execute("HSET", entry, "h", fields[queue.HEADER], "b", fields[queue.BODY]),
            self._redis.execute("EXPIRE", entry, context.step.cache_ttl_s),
        )

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


def _context(item: Finished) -> StepContext | None:
    try:
        return StepContext.decode(item.step)
    except (KeyError, ValueError, TypeError, IndexError, FunctionError) as exc:
        log.error(
            "%s: entry %s has a step context that does not decode (%s)",
            item.invocation.function,
            item.entry_id,
            exc,
        )
        return None


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


def _cache_entry(context: StepContext, inputs: Tensors) -> str:
    step = context.step
    return keys.cache_entry(step.function, cache_key(step.function, step.version, step.digest, inputs, None))


def _answer(context: StepContext, reply: Reply, cached: bool = False) -> queue.Outgoing:
    """The pipeline's reply to its gateway, or to its result stream when asynchronous (kept
    result_ttl_s from now, and shared with the callbacks stream when it has a callback); a success
    is stored in the response cache when asked."""
    return queue.Outgoing(
        reply.encode(),
        context.reply_to,
        context.cache_key if cached else "",
        context.cache_ttl_s,
        context.callback,
        reply_ttl_ms=context.result_ttl_s * 1000,
    )


def _call(call: queue.ScriptCall) -> tuple[list[str], list[Any]]:
    return call.keys, list(call.args)
