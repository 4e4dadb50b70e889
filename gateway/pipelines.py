"""Invoking a pipeline: every step's version resolved at once by the normal routing (pins honoured,
canaries applied), the steps checked against each other, the first steps queued with the plan on
their functions' streams, and the one reply (the last step's, or the first error) awaited."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping

from opentelemetry import trace

from fngate import keys, queue, telemetry
from fngate.errors import FunctionError, Unavailable
from fngate.manifest import FunctionManifest
from fngate.pipeline import Problem, edge_problems
from fngate.plan import Plan, StepContext, first_steps, make_plan, step_invocation
from fngate.repository import FunctionVersion
from fngate.wire import Reply, Tensors
from gateway.cache import request_key
from gateway.catalog import Catalog
from gateway.dispatch import Dispatcher, Step

tracer = trace.get_tracer("fngate.gateway")
PLANNED_MAX = 256
_planned: dict[tuple[str, ...], tuple[list[Problem], Plan | None]] = {}
"""Problems, or the plan, by a pipeline version and its steps' versions: each worked out once."""


async def submit(
    catalog: Catalog,
    dispatcher: Dispatcher,
    function: FunctionVersion,
    inputs: Tensors,
    outputs: tuple[str, ...] | None,
    timeout_ms: int | None,
    use_cache: bool = True,
    admission: queue.Admission | None = None,
) -> Reply:
    """Answer one invocation of a pipeline; raises the FunctionError it failed with (a step's error
    names the step: "step 'score' (mlp v2): ...")."""
    manifest = function.manifest
    resolved, plan = resolve(catalog, function)
    limit_ms = manifest.batching.timeout_ms
    timeout_ms = limit_ms if timeout_ms is None else min(timeout_ms, limit_ms)
    deadline_ms = int(time.time() * 1000) + timeout_ms
    key_hex = request_key(function, inputs, outputs)
    entry = keys.cache_entry(manifest.name, key_hex) if key_hex else ""
    invocation_id = os.urandom(16).hex()
    stream = dispatcher.reply_stream
    with tracer.start_as_current_span(
        f"pipeline {manifest.name}",
        attributes={"fngate.function": manifest.name, "fngate.version": function.version},
    ):
        traceparent = telemetry.inject() if telemetry.tracing_active() else None
        context = StepContext(
            invocation_id, stream, deadline_ms, plan, 0, {}, traceparent, entry, manifest.cache.ttl_s
        )
        calls = []
        for position, (step_context, step_inputs) in enumerate(first_steps(context, inputs)):
            step = step_context.step
            call = queue.enqueue_call(
                keys.invocations(step.function),
                step_invocation(step_context, step_inputs).encode(),
                queue.Waiter(stream, invocation_id, deadline_ms),
                timeout_ms,
                step.max_queue_size,
                step.max_queue_bytes,
                lookup=entry if use_cache and position == 0 else "",
                admission=admission if position == 0 else None,
                step=step_context.encode(),
            )
            calls.append(Step(step.function, call, resolved[step.name].manifest.batching))
        pools = {item.manifest.scaling.pool for item in resolved.values()}
        reply = await dispatcher.submit_steps(invocation_id, calls, sorted(pools), timeout_ms, manifest.name)
    if outputs is not None:
        reply = dataclasses.replace(reply, outputs={name: reply.outputs[name] for name in outputs})
    return reply


def resolve(catalog: Catalog, function: FunctionVersion) -> tuple[dict[str, FunctionVersion], Plan]:
    """Each step's version by step name, drawn now by its function's routing (or pinned), and the
    plan; checked (and planned) once per combination of versions. Raises Unavailable naming the
    step that no longer fits."""
    spec = function.manifest.pipeline
    assert spec is not None
    resolved = {}
    for step in spec.steps:
        try:
            resolved[step.name] = catalog.get(step.function_name, step.pinned)
        except FunctionError as exc:  # same class (status), naming the step
            raise FunctionError.from_code(
                exc.code.value, f"pipeline '{function.name}': step '{step.name}': {exc.message}"
            ) from None
    key = (
        function.name,
        function.version,
        function.digest,
        *(f"{item.name}@{item.version}:{item.digest}" for item in resolved.values()),
    )
    known = _planned.get(key)
    if known is None:
        manifests: Mapping[str, FunctionManifest | None] = {
            name: item.manifest for name, item in resolved.items()
        }
        problems = edge_problems(function.manifest, manifests)
        described = {name: (item.manifest, item.version, item.digest) for name, item in resolved.items()}
        known = (problems, None if problems else make_plan(function.manifest, function.version, described))
        if len(_planned) >= PLANNED_MAX:
            _planned.clear()
        _planned[key] = known
    problems, plan = known
    if plan is None:
        raise Unavailable(f"pipeline '{function.name}': {problems[0][1]}")
    return resolved, plan
