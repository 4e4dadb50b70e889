"""Pure: a Call -> the queue entries that carry it, as data. Synchronous or asynchronous, a
function or a pipeline: one script call queues all of a call's first entries or none (the caller's
limits and the response cache checked first, in the same round trip), and `Entries` says what the
core needs to settle its outcome (gateway.dispatch)."""

from __future__ import annotations

import dataclasses
import os

from fngate import keys, queue, sequences
from fngate.plan import Plan, StepContext, first_steps, step_entry, step_invocation
from fngate.repository import FunctionVersion
from fngate.wire import Invocation
from gateway.cache import request_key
from gateway.call import Call

PENDING_MARGIN_S = 5
"""A pending asynchronous invocation's result outlives its deadline by result_ttl_s and this much:
a reply that comes late (a batch that ran over the deadline) still finds it. Once done, the runner
keeps it result_ttl_s from then (fngate.queue.FINISH)."""


def new_id() -> str:
    """An invocation's id: 128 random bits, as 32 hexadecimal digits."""
    return os.urandom(16).hex()


def new_async_id(call: Call, plan: Plan | None) -> str:
    """An asynchronous invocation's id: its result lives in the slot of the stream its (first)
    entry is queued on, so that one script queues it and creates its result (keys.result_id)."""
    function = call.function.manifest.name if plan is None else plan.steps[plan.first()[0]].function
    return keys.result_id(keys.invocations(function, keys.ASYNC))


def pending_ttl_ms(call: Call) -> int:
    """How long an asynchronous call's result (and its Idempotency-Key) live while it is pending."""
    return timeout_of(call) + (call.function.manifest.batching.result_ttl_s + PENDING_MARGIN_S) * 1000


@dataclasses.dataclass(frozen=True, slots=True)
class Entries:
    """What one call queues, and what settling its outcome needs."""

    id: str
    script: queue.ScriptCall
    """ENQUEUE's (synchronous) or SUBMIT_ASYNC's (asynchronous) keys and arguments."""
    deadline_ms: int
    timeout_ms: int
    names: tuple[str, ...]
    """Each entry as a refusal names it ("function 'x'", or a pipeline step), in the script's
    order: a refusal's outcome names its index."""
    pools: tuple[str, ...]
    """The runner pools to wake once queued (every step's, for a pipeline)."""
    cache_entry: str = ""
    """The response cache entry of the call ('' while the function's cache is off)."""
    rest: tuple[queue.Forward, ...] = ()
    """On a Redis Cluster (`split`): a pipeline's other first steps, queued once the script queued
    its first (they are on other functions' slots)."""

    @property
    def queued_ms(self) -> int:
        """When the call was queued (wall clock, ms): its deadline less its timeout."""
        return self.deadline_ms - self.timeout_ms


def timeout_of(call: Call) -> int:
    """The call's timeout in ms: what the caller asked for, capped by the function's (for an
    asynchronous call, its async_timeout_s)."""
    batching = call.function.manifest.batching
    limit_ms = batching.async_timeout_s * 1000 if call.later is not None else batching.timeout_ms
    return limit_ms if call.timeout_ms is None else min(call.timeout_ms, limit_ms)


def cache_keys(call: Call) -> tuple[str, str]:
    """The call's response cache entry, and the in-flight marker that identical calls wait on
    (both '' while the function's cache is off)."""
    key_hex = request_key(call.function, call.inputs, call.outputs)
    if not key_hex:
        return "", ""
    name = call.function.manifest.name
    return keys.cache_entry(name, key_hex), keys.in_flight(name, key_hex)


def synchronous(
    call: Call,
    reply_to: str,
    now_ms: int,
    admission: queue.Admission | None,
    lookup_in_queue: bool,
    plan: Plan | None = None,
    steps: dict[str, FunctionVersion] | None = None,
    split: bool = False,
) -> Entries:
    """A synchronous call's ENQUEUE: the function's own entry, or a pipeline's first steps (`plan`,
    with each step's resolved version in `steps`). `lookup_in_queue`: the response cache shares the
    queue's Redis, or this is a pipeline (whose answer its last step caches there), so the script
    answers from it; else the dispatcher looked it up already. `split` (a Redis Cluster): the
    script holds only what is in its first entry's slot; a pipeline's other first steps are
    Entries.rest."""
    manifest = call.function.manifest
    invocation_id = new_id()
    timeout_ms = timeout_of(call)
    deadline_ms = now_ms + timeout_ms
    entry, marker = cache_keys(call)
    waiter = queue.Waiter(reply_to, invocation_id, deadline_ms)
    lookup = entry if call.use_cache and lookup_in_queue else ""
    if plan is None:
        in_flight = marker if call.use_cache else ""
        placement = queue.place(manifest.name, manifest.batching, call.priority, call.queue_timeout_us)
        rows = int(next(iter(call.inputs.values())).shape[0]) if manifest.batched else 1
        step = sequences.checked(manifest, call.sequence, rows=rows)
        gate = None
        if step is not None and manifest.sequence is not None:
            # Live while the step waits and runs, then idle_ms from its answer (Dispatcher)
            live_ms = timeout_ms + sequences.idle_ms(manifest.sequence)
            gate = queue.SequenceGate(
                keys.sequence(manifest.name, step.id),
                step.flags,
                live_ms,
                keys.live_sequences(manifest.name),
                manifest.sequence.max_live,
            )
        invocation = Invocation(
            id=invocation_id,
            function=manifest.name,
            version=call.function.version,
            reply_to=reply_to,
            deadline_ms=deadline_ms,
            inputs=call.inputs,
            outputs=call.outputs,
            traceparent=call.traceparent,
            digest=call.function.digest,
            cache_key=entry or None,
            cache_ttl_s=manifest.cache.ttl_s,
            in_flight_key=in_flight or None,
            queue_deadline_ms=now_ms + placement.queue_timeout_ms if placement.queue_timeout_ms else 0,
            delay=placement.delay,
            key_id=call.principal.key_id,
            sequence=step,
        )
        script = queue.enqueue_call(
            placement.stream,
            invocation.encode(),
            waiter,
            timeout_ms,
            placement.max_queue_size,
            manifest.batching.max_queue_bytes,
            lookup=lookup,
            in_flight=in_flight,
            admission=admission,
            sequence=gate,
        )
        names: tuple[str, ...] = (f"function '{manifest.name}'",)
        return Entries(invocation_id, script, deadline_ms, timeout_ms, names, (manifest.scaling.pool,), entry)
    assert steps is not None
    context = StepContext(
        invocation_id, reply_to, deadline_ms, plan, 0, {}, call.traceparent, entry, manifest.cache.ttl_s
    )
    firsts = first_steps(context, call.inputs)
    (head_context, head_inputs), others = firsts[0], firsts[1:]
    head = head_context.step
    rest = [step_entry(step_context, inputs) for step_context, inputs in others]
    script = queue.enqueue_call(
        keys.invocations(head.function),
        step_invocation(head_context, head_inputs).encode(),
        waiter,
        timeout_ms,
        head.max_queue_size,
        head.max_queue_bytes,
        lookup=lookup,
        admission=admission,
        step=head_context.encode(),
        more=() if split else rest,
    )
    names = tuple(step_context.step.described for step_context, _ in firsts)
    later = tuple(rest) if split else ()
    return Entries(invocation_id, script, deadline_ms, timeout_ms, names, _pools(steps), entry, later)


def asynchronous(
    call: Call,
    record: bytes,
    invocation_id: str,
    deadline_ms: int,
    admission: queue.Admission | None,
    idempotency: str,
    cached: dict[bytes, bytes] | None,
    lookup_in_queue: bool,
    plan: Plan | None = None,
    steps: dict[str, FunctionVersion] | None = None,
    quota: queue.ResultQuota | None = None,
    split: bool = False,
) -> Entries:
    """An asynchronous call's SUBMIT_ASYNC, at level keys.ASYNC and replying to its result stream:
    the function's own entry or a pipeline's first steps (whose successors the runners queue at that
    level too). `record`: the gateway's record of it (gateway.invocations.AsyncInvocation); `idempotency`:
    its Idempotency-Key ('' for none); `cached`: a reply the dispatcher found in a cache Redis of its
    own; `lookup_in_queue` as for `synchronous`; `quota`: the result bytes its key may hold.
    `split` (a Redis Cluster) as for `synchronous`; and a callback of a `cached` reply is the
    caller's to send (the callbacks stream is elsewhere), the quota the caller's to check (it is
    in the key's slot) and the storer's to charge, and the first steps of other slots the caller's
    to queue and record (gateway.slots)."""
    later = call.later
    assert later is not None
    manifest = call.function.manifest
    batching = manifest.batching
    timeout_ms = timeout_of(call)
    result = keys.result(invocation_id)
    # Answered from the cache and stored there for others, never waited on; a pipeline's answer is
    # cached by its last step, in the queue's Redis (runner.pipeline).
    entry, _ = cache_keys(call)
    marker = queue.callback_marker(result) if later.callback_url else ""
    if plan is None:
        invocation = Invocation(
            id=invocation_id,
            function=manifest.name,
            version=call.function.version,
            reply_to=result,
            deadline_ms=deadline_ms,
            inputs=call.inputs,
            outputs=call.outputs,
            traceparent=call.traceparent,
            digest=call.function.digest,
            cache_key=entry or None,
            cache_ttl_s=manifest.cache.ttl_s,
            in_flight_key=marker or None,
            result_ttl_s=batching.result_ttl_s,
            key_id=call.principal.key_id,
        )
        stream = keys.invocations(manifest.name, keys.ASYNC)
        entries = [
            queue.Forward(
                stream, invocation.encode(), b"", batching.max_async_queue_size, batching.max_queue_bytes
            )
        ]
        names: tuple[str, ...] = (f"function '{manifest.name}'",)
        pools: tuple[str, ...] = (manifest.scaling.pool,)
    else:
        assert steps is not None
        context = StepContext(
            invocation_id,
            result,
            deadline_ms,
            plan,
            0,
            {},
            call.traceparent,
            entry,
            manifest.cache.ttl_s,
            keys.ASYNC,
            batching.result_ttl_s,
            marker,
        )
        firsts = first_steps(context, call.inputs)
        entries = [step_entry(step_context, inputs) for step_context, inputs in firsts]
        names = tuple(step_context.step.described for step_context, _ in firsts)
        pools = _pools(steps)
    first, *more = entries
    script = queue.submit_async_call(
        first.stream,
        first.fields,
        result,
        record,
        pending_ttl_ms(call),
        invocation_id,
        first.max_queue_size,
        first.max_queue_bytes,
        keys.idempotency(call.principal.key_id, idempotency) if idempotency else "",
        keys.callbacks() if later.callback_url and not (split and cached) else "",
        admission,
        later.request_digest if idempotency else "",
        batching.result_ttl_s * 1000,
        entry if call.use_cache and lookup_in_queue else "",
        cached,
        first.step,
        () if split else more,
        None if split else quota,
        quota_elsewhere=quota.key if split and quota else "",
        others=len(more) if split else 0,
    )
    rest = tuple(more) if split else ()
    return Entries(invocation_id, script, deadline_ms, timeout_ms, names, pools, entry, rest)


def _pools(steps: dict[str, FunctionVersion]) -> tuple[str, ...]:
    return tuple(sorted({item.manifest.scaling.pool for item in steps.values()}))
