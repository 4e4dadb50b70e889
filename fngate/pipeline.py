"""A pipeline's graph: its references, their order, the checks made along every edge, and the plan
an invocation carries on the queue from step to step (with the tensors later steps still need)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from fngate.manifest import REQUEST, STEP_REFERENCE, FunctionManifest, PipelineSpec, TensorSpec
from fngate.repository import FunctionRecord
from fngate.tensors import datatype_of, from_bytes, to_bytes

Tensors = dict[str, np.ndarray[Any, Any]]
Problem = tuple[str, str]
"""(where in the manifest, what is wrong), as fngate.manifest.ManifestError lists them."""


@dataclasses.dataclass(frozen=True, slots=True)
class Reference:
    source: str
    """'request' or a step's name."""
    tensor: str

    @classmethod
    def parse(cls, text: str) -> Reference:
        found = STEP_REFERENCE.match(text)
        if found is None:
            raise ValueError(f"{text!r} is not `request.<input>` or `<step>.<output>`")
        return cls(found.group(1), found.group(3))

    def __str__(self) -> str:
        return f"{self.source}.{self.tensor}"


def step_sources(spec: PipelineSpec, step: int) -> list[str]:
    """The steps a step reads from, in the order its inputs name them, each once."""
    found: list[str] = []
    for text in spec.steps[step].inputs.values():
        source = Reference.parse(text).source
        if source != REQUEST and source not in found:
            found.append(source)
    return found


def graph_problems(manifest: FunctionManifest) -> list[Problem]:
    """What is wrong with a pipeline's graph on its own (no other function needed): references to
    unknown steps or request inputs, outputs that differ from the declared ones, steps nobody
    uses, cycles. Each names the step."""
    spec = manifest.pipeline
    if spec is None:
        return []
    names = [step.name for step in spec.steps]
    problems: list[Problem] = []
    for index, step in enumerate(spec.steps):
        for input_name, text in step.inputs.items():
            problems += _reference_problems(
                manifest, names, f"pipeline.steps[{index}].inputs.{input_name}", f"step '{step.name}'", text
            )
            if Reference.parse(text).source == step.name:
                problems.append(
                    (
                        f"pipeline.steps[{index}].inputs.{input_name}",
                        f"step '{step.name}' reads its own output",
                    )
                )
    for output_name, text in spec.outputs.items():
        problems += _reference_problems(
            manifest, names, f"pipeline.outputs.{output_name}", "the pipeline", text
        )
    declared = [item.name for item in manifest.outputs]
    missing = [name for name in declared if name not in spec.outputs]
    extra = [name for name in spec.outputs if name not in declared]
    if missing:
        problems.append(("pipeline.outputs", f"no source for declared outputs {missing}"))
    if extra:
        problems.append(("pipeline.outputs", f"{extra} are not among the declared outputs {declared}"))
    if problems:
        return problems
    cycle = find_cycle(spec)
    if cycle:
        path = " -> ".join(f"'{name}'" for name in cycle)
        problems.append(("pipeline.steps", f"step '{cycle[0]}' depends on itself: {path}"))
        return problems
    used = {Reference.parse(text).source for step in spec.steps for text in step.inputs.values()}
    used |= {Reference.parse(text).source for text in spec.outputs.values()}
    for index, step in enumerate(spec.steps):
        if step.name not in used:
            problems.append(
                (f"pipeline.steps[{index}]", f"step '{step.name}': no step and no output uses its outputs")
            )
    return problems


def _reference_problems(
    manifest: FunctionManifest, names: Sequence[str], where: str, who: str, text: str
) -> list[Problem]:
    reference = Reference.parse(text)
    if reference.source == REQUEST:
        if manifest.input(reference.tensor) is None:
            known = ", ".join(item.name for item in manifest.inputs)
            return [(where, f"{who}: the pipeline has no input '{reference.tensor}' (its inputs: {known})")]
        return []
    if reference.source not in names:
        return [(where, f"{who}: no step '{reference.source}' (steps: {', '.join(names)})")]
    return []


def find_cycle(spec: PipelineSpec) -> list[str]:
    """Step names around a cycle, first repeated at the end; [] for a DAG."""
    index = {step.name: position for position, step in enumerate(spec.steps)}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str]:
        state[name] = 1
        path.append(name)
        for source in step_sources(spec, index[name]):
            if source not in index:
                continue
            if state.get(source) == 1:
                return [*path[path.index(source) :], source]
            if source not in state:
                found = visit(source)
                if found:
                    return found
        path.pop()
        state[name] = 2
        return []

    for step in spec.steps:
        if step.name not in state:
            found = visit(step.name)
            if found:
                return found
    return []


def order(spec: PipelineSpec) -> list[int]:
    """The steps' indexes, each after every step it reads from (stable: manifest order otherwise).
    Raises ValueError naming a step on a cycle."""
    placed: list[int] = []
    done: set[str] = set()
    while len(placed) < len(spec.steps):
        ready = [
            index
            for index, step in enumerate(spec.steps)
            if step.name not in done and all(source in done for source in step_sources(spec, index))
        ]
        if not ready:
            stuck = next(step.name for step in spec.steps if step.name not in done)
            raise ValueError(f"step '{stuck}' is on a cycle")
        placed += ready
        done |= {spec.steps[index].name for index in ready}
    return placed


def edge_problems(
    manifest: FunctionManifest, functions: Mapping[str, FunctionManifest | None]
) -> list[Problem]:
    """Every step against the function it calls (`functions` by step name; None: not deployed): its
    inputs are exactly the function's, and each reference's datatype and shape agree with the input
    it feeds; the pipeline's outputs agree with what their steps return."""
    spec = manifest.pipeline
    if spec is None:
        return []
    problems: list[Problem] = []
    for index, step in enumerate(spec.steps):
        function = functions.get(step.name)
        where = f"pipeline.steps[{index}]"
        if function is None:
            problems.append(
                (f"{where}.function", f"step '{step.name}': function '{step.function}' is not deployed")
            )
            continue
        if function.pipeline is not None:
            problems.append(
                (
                    f"{where}.function",
                    f"step '{step.name}': '{step.function}' is a pipeline; steps call functions",
                )
            )
            continue
        if manifest.batched and function.batching.max_batch_size < manifest.batching.max_batch_size:
            problems.append(
                (
                    f"{where}.function",
                    f"step '{step.name}': {step.function} takes at most {function.batching.max_batch_size} "
                    f"rows, the pipeline up to {manifest.batching.max_batch_size} (lower its "
                    "batching.max_batch_size)",
                )
            )
        wanted = [item.name for item in function.inputs]
        missing = [name for name in wanted if name not in step.inputs]
        if missing:
            problems.append((f"{where}.inputs", f"step '{step.name}': {step.function} also takes {missing}"))
        for input_name, text in step.inputs.items():
            target = function.input(input_name)
            if target is None:
                problems.append(
                    (
                        f"{where}.inputs.{input_name}",
                        f"step '{step.name}': {step.function} has no input '{input_name}' (its inputs: "
                        f"{', '.join(wanted)})",
                    )
                )
                continue
            problems += _edge(
                manifest, functions, f"{where}.inputs.{input_name}", f"step '{step.name}'", text, target
            )
    for output_name, text in spec.outputs.items():
        declared = manifest.output(output_name)
        if declared is not None:
            problems += _edge(
                manifest, functions, f"pipeline.outputs.{output_name}", "the pipeline", text, declared
            )
    return problems


def deploy_problems(manifest: FunctionManifest, records: Mapping[str, FunctionRecord]) -> list[Problem]:
    """A pipeline against the functions deployed (`records`, by name): its graph, and every edge
    against each version a step may call now (its pinned one, else every version with traffic: a
    canary must fit too)."""
    problems = graph_problems(manifest)
    if problems or manifest.pipeline is None:
        return problems
    choices: list[dict[str, FunctionManifest | None]] = [{}]
    for index, step in enumerate(manifest.pipeline.steps):
        record = records.get(step.function_name)
        if record is None:
            choices[0][step.name] = None
            continue
        pinned = step.pinned
        if pinned is not None and pinned not in record.served:
            served = ", ".join(record.served) or "none"
            where = f"pipeline.steps[{index}].function"
            problems.append(
                (where, f"step '{step.name}': {step.function_name} serves no version {pinned} ({served})")
            )
            pinned = None
        versions = [pinned] if pinned is not None else list(record.traffic) or list(record.served[-1:])
        for position, version in enumerate(versions):
            if position == len(choices):
                choices.append(dict(choices[0]))
            choices[position][step.name] = record.versions[version].manifest
    for functions in choices:
        full = {**choices[0], **functions}
        problems += [problem for problem in edge_problems(manifest, full) if problem not in problems]
    return problems


def _edge(
    manifest: FunctionManifest,
    functions: Mapping[str, FunctionManifest | None],
    where: str,
    who: str,
    text: str,
    target: TensorSpec,
) -> list[Problem]:
    reference = Reference.parse(text)
    if reference.source == REQUEST:
        source = manifest.input(reference.tensor)
    else:
        producer = functions.get(reference.source)
        if producer is None or producer.pipeline is not None:
            return []  # reported at the step itself
        source = producer.output(reference.tensor)
        if source is None:
            outputs = ", ".join(item.name for item in producer.outputs)
            return [
                (
                    where,
                    f"{who}: step '{reference.source}' has no output '{reference.tensor}' "
                    f"(its outputs: {outputs})",
                )
            ]
    if source is None:
        return []  # graph_problems reports an unknown request input
    problems = []
    if source.datatype != target.datatype:
        problems.append(
            (where, f"{who}: {text} is {source.datatype}, '{target.name}' takes {target.datatype}")
        )
    if not shapes_agree(source.shape, target.shape):
        problems.append(
            (
                where,
                f"{who}: {text} has shape {list(source.shape)}, '{target.name}' takes {list(target.shape)}",
            )
        )
    return problems


def shapes_agree(given: Sequence[int], taken: Sequence[int]) -> bool:
    """Same rank, and each dimension equal or variable (-1) on either side."""
    return len(given) == len(taken) and all(a == b or -1 in (a, b) for a, b in zip(given, taken, strict=True))


# The plan: what the gateway resolved, carried by every step's entry.


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
