"""The plan of one pipeline invocation, as the gateway resolved it and every step's queue entry
carries it (fngate.queue.STEP): the steps in order, their versions, where each input comes from,
and the tensors later steps still read."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from fngate import keys, queue
from fngate.manifest import FunctionManifest
from fngate.pipeline import Reference, order
from fngate.tensors import Tensors, datatype_of, from_bytes, to_bytes
from fngate.wire import Invocation


@dataclasses.dataclass(frozen=True, slots=True)
class PlanStep:
    name: str
    function: str
    version: str
    digest: str
    inputs: Mapping[str, str]
    """The function's inputs by name: their references."""
    max_queue_size: int
    max_queue_bytes: int
    cache_ttl_s: int = 0
    """The function's cache TTL when its cache is on, else 0: the step's answer is looked up and
    stored under the key a direct call of the function uses."""
    max_async_queue_size: int = 10000
    """The limit of the function's asynchronous level (keys.ASYNC), where an asynchronous
    pipeline's steps wait."""

    def queue_limit(self, level: int) -> int:
        """The most entries its function's stream of `level` may hold."""
        return self.max_queue_size if level == keys.SYNC else self.max_async_queue_size

    @property
    def described(self) -> str:
        """The step as errors name it."""
        return f"step '{self.name}' ({self.function} v{self.version}): function '{self.function}'"


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """Steps in topological order; node len(steps) stands for the pipeline's outputs. Every step
    decodes it again, so its graph is worked out once, when it is made."""

    pipeline: str
    version: str
    steps: tuple[PlanStep, ...]
    outputs: Mapping[str, str]
    _before: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, repr=False, compare=False)
    _after: tuple[tuple[int, ...], ...] = dataclasses.field(init=False, repr=False, compare=False)
    _needed: tuple[frozenset[str], ...] = dataclasses.field(init=False, repr=False, compare=False)
    text: str = dataclasses.field(init=False, repr=False, compare=False)
    """Its JSON, which step contexts carry (and runners decode once: `Plan.decode_text`)."""

    def __post_init__(self) -> None:
        names = {step.name: index for index, step in enumerate(self.steps)}
        before: list[tuple[int, ...]] = []
        for node in range(self.end + 1):
            sources = (names.get(Reference.parse(text).source) for text in self.references(node))
            before.append(tuple(dict.fromkeys(source for source in sources if source is not None)))
        after = [
            tuple(other for other in range(self.end + 1) if node in before[other])
            for node in range(self.end + 1)
        ]
        needed: list[frozenset[str]] = [frozenset()] * (self.end + 1)
        for node in reversed(range(self.end + 1)):  # topological order: what follows is done first
            later = (needed[successor] for successor in after[node])
            needed[node] = frozenset(self.references(node)).union(*later)
        object.__setattr__(self, "_before", tuple(before))
        object.__setattr__(self, "_after", tuple(after))
        object.__setattr__(self, "_needed", tuple(needed))
        object.__setattr__(self, "text", orjson.dumps(self.encode()).decode())

    @property
    def end(self) -> int:
        """The node that stands for the pipeline's outputs."""
        return len(self.steps)

    def references(self, node: int) -> list[str]:
        """What a node reads: a step's inputs, or the pipeline's outputs."""
        return list((self.outputs if node == self.end else self.steps[node].inputs).values())

    def predecessors(self, node: int) -> list[int]:
        return list(self._before[node])

    def successors(self, node: int) -> list[int]:
        return list(self._after[node])

    def first(self) -> list[int]:
        """The steps that read only the request."""
        return [index for index in range(self.end) if not self._before[index]]

    def needed(self, node: int) -> frozenset[str]:
        """References read by `node` or anything after it (what must travel with it)."""
        return self._needed[node]

    def encode(self) -> dict[str, Any]:
        return {
            "name": self.pipeline,
            "ver": self.version,
            "out": dict(self.outputs),
            "steps": [
                [
                    step.name,
                    step.function,
                    step.version,
                    step.digest,
                    dict(step.inputs),
                    step.max_queue_size,
                    step.max_queue_bytes,
                    step.cache_ttl_s,
                    step.max_async_queue_size,
                ]
                for step in self.steps
            ],
        }

    @classmethod
    def decode(cls, doc: Mapping[str, Any]) -> Plan:
        steps = tuple(PlanStep(*item) for item in doc["steps"])
        return cls(doc["name"], doc["ver"], steps, doc["out"])

    @classmethod
    def decode_text(cls, text: str) -> Plan:
        """A plan from its JSON; the same plan comes with every step of every invocation until
        a version changes, so each is worked out once."""
        plan = _decoded.get(text)
        if plan is None:
            if len(_decoded) >= DECODED_MAX:
                _decoded.clear()
            plan = _decoded[text] = cls.decode(orjson.loads(text))
        return plan


DECODED_MAX = 1024
_decoded: dict[str, Plan] = {}


def make_plan(
    manifest: FunctionManifest, version: str, resolved: Mapping[str, tuple[FunctionManifest, str, str]]
) -> Plan:
    """The plan of one invocation: `resolved` gives each step's function manifest, version and digest."""
    spec = manifest.pipeline
    if spec is None:
        raise ValueError(f"function '{manifest.name}' is not a pipeline")
    steps = []
    for index in order(spec):
        step = spec.steps[index]
        function, number, digest = resolved[step.name]
        steps.append(
            PlanStep(
                step.name,
                function.name,
                number,
                digest,
                dict(step.inputs),
                function.batching.max_queue_size,
                function.batching.max_queue_bytes,
                function.cache.ttl_s if function.cache.enabled else 0,
                function.batching.max_async_queue_size,
            )
        )
    return Plan(manifest.name, version, tuple(steps), dict(spec.outputs))


@dataclasses.dataclass(frozen=True, slots=True)
class StepContext:
    """What a step's queue entry carries beside its own inputs (fngate.queue.STEP)."""

    invocation_id: str
    """The pipeline invocation's id: the final reply answers it."""
    reply_to: str
    deadline_ms: int
    plan: Plan
    node: int
    """This step's index in plan.steps."""
    carried: Tensors
    """Request inputs and earlier outputs that later steps read, by reference."""
    traceparent: str | None = None
    cache_key: str = ""
    """Where the pipeline's answer is cached ('' for nowhere), for cache_ttl_s."""
    cache_ttl_s: int = 0
    level: int = keys.SYNC
    """The priority level its steps wait at: keys.ASYNC for an asynchronous invocation."""
    result_ttl_s: int = 0
    """How long the reply stream is kept once answered (an asynchronous result); 0 leaves it be."""
    callback: str = ""
    """The in-flight marker whose waiter is the callbacks stream (fngate.queue.callback_marker),
    '' for an invocation without a callback URL."""

    @property
    def step(self) -> PlanStep:
        return self.plan.steps[self.node]

    def encode(self) -> bytes:
        header = {
            "id": self.invocation_id,
            "reply": self.reply_to,
            "by": self.deadline_ms,
            "plan": self.plan.text,
            "node": self.node,
            "tp": self.traceparent,
            "ck": self.cache_key,
            "cttl": self.cache_ttl_s,
            "lv": self.level,
            "rttl": self.result_ttl_s,
            "cb": self.callback,
        }
        return encode_tensors(header, self.carried)

    @classmethod
    def decode(cls, raw: bytes) -> StepContext:
        header, carried = decode_tensors(raw)
        return cls(
            header["id"],
            header["reply"],
            header["by"],
            Plan.decode_text(header["plan"]),
            header["node"],
            carried,
            header.get("tp"),
            header.get("ck", ""),
            header.get("cttl", 0),
            header.get("lv", keys.SYNC),
            header.get("rttl", 0),
            header.get("cb", ""),
        )


def encode_tensors(header: dict[str, Any], tensors: Mapping[str, np.ndarray[Any, Any]]) -> bytes:
    """A JSON header (with the tensors listed under "t"), a newline, the tensors' bytes."""
    specs, buffers = [], []
    for name, array in tensors.items():
        raw = to_bytes(array)
        specs.append([name, datatype_of(array), list(array.shape), len(raw)])
        buffers.append(raw)
    return orjson.dumps({**header, "t": specs}) + b"\n" + b"".join(buffers)


def decode_tensors(raw: bytes) -> tuple[dict[str, Any], Tensors]:
    head, _, body = raw.partition(b"\n")
    header = orjson.loads(head)
    view = memoryview(body)
    tensors: Tensors = {}
    offset = 0
    for name, datatype, shape, size in header.pop("t"):
        tensors[name] = from_bytes(datatype, shape, view[offset : offset + size], name)
        offset += size
    return header, tensors


def step_inputs(plan: Plan, node: int, available: Mapping[str, np.ndarray[Any, Any]]) -> Tensors:
    """A node's inputs (or, for plan.end, the pipeline's outputs) from the tensors available."""
    bindings = plan.outputs if node == plan.end else plan.steps[node].inputs
    return {name: available[text] for name, text in bindings.items()}


def carried_for(plan: Plan, node: int, available: Mapping[str, np.ndarray[Any, Any]]) -> Tensors:
    """What travels with `node`'s entry: the available tensors that steps after it read."""
    later: set[str] = set()
    for successor in plan.successors(node):
        later |= plan.needed(successor)
    return {text: array for text, array in available.items() if text in later}


def outputs_of(step: str, outputs: Mapping[str, np.ndarray[Any, Any]]) -> Tensors:
    """A finished step's outputs under their references."""
    return {f"{step}.{name}": array for name, array in outputs.items()}


def first_steps(
    context: StepContext, inputs: Mapping[str, np.ndarray[Any, Any]]
) -> list[tuple[StepContext, Tensors]]:
    """The steps that read only the request (`inputs`), each as its context (`context` with the
    step's node and the tensors its successors read) and its own inputs."""
    plan = context.plan
    available = {f"request.{name}": array for name, array in inputs.items()}
    return [
        (
            dataclasses.replace(context, node=node, carried=carried_for(plan, node, available)),
            step_inputs(plan, node, available),
        )
        for node in plan.first()
    ]


def step_invocation(context: StepContext, inputs: Tensors) -> Invocation:
    """The invocation of the step `context` is at, with its inputs. It carries the pipeline's id
    and reply stream: any reply a step gets outside its pipeline still answers the pipeline."""
    step = context.step
    return Invocation(
        id=context.invocation_id,
        function=step.function,
        version=step.version,
        reply_to=context.reply_to,
        deadline_ms=context.deadline_ms,
        inputs=inputs,
        traceparent=context.traceparent,
        digest=step.digest,
    )


def step_entry(context: StepContext, inputs: Tensors) -> queue.Forward:
    """The queue entry of the step `context` is at: on its function's stream of the pipeline's
    priority level (an asynchronous pipeline's steps wait behind synchronous invocations)."""
    step = context.step
    return queue.Forward(
        keys.invocations(step.function, context.level),
        step_invocation(context, inputs).encode(),
        context.encode(),
        step.queue_limit(context.level),
        step.max_queue_bytes,
    )
