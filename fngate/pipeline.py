"""A pipeline's graph: its references, their order, and the checks made along every edge (with
messages that name the step). What an invocation carries from step to step: fngate.plan."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # fngate.manifest checks every pipeline's graph with this module when it reads one
    from fngate.manifest import FunctionManifest, PipelineSpec, TensorSpec
    from fngate.repository import FunctionRecord

STEP_REFERENCE = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.(.+)$")
"""`request.<input>` or `<step>.<output>`: what a pipeline step's input or a pipeline's output is."""
REQUEST = "request"
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
