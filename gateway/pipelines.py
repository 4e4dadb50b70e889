"""A pipeline's steps for one invocation: every step's version resolved at once by the normal
routing (pins honoured, canaries applied), the steps checked against each other, and the plan that
its first steps' entries carry (gateway.submission queues them)."""

from __future__ import annotations

from collections.abc import Mapping

from fngate.errors import FunctionError, Unavailable
from fngate.manifest import FunctionManifest
from fngate.pipeline import Problem, edge_problems
from fngate.plan import Plan, make_plan
from fngate.repository import FunctionVersion
from gateway.catalog import Catalog

PLANNED_MAX = 256
_planned: dict[tuple[str, ...], tuple[list[Problem], Plan | None]] = {}
"""Problems, or the plan, by a pipeline version and its steps' versions: each worked out once."""


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
