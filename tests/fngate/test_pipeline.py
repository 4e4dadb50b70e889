"""A pipeline's manifest and graph: references, order, the checks along every edge (with messages
that name the step), the plan and context carried on the queue, and what deploy refuses."""

from __future__ import annotations

import dataclasses
import io
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fngate import keys
from fngate.cli.deploy import deploy, deploy_all, list_functions
from fngate.cli.validation import check
from fngate.manifest import FunctionManifest, ManifestError, parse_manifest
from fngate.pipeline import (
    deploy_problems,
    edge_problems,
    find_cycle,
    graph_problems,
    order,
    shapes_agree,
)
from fngate.plan import Plan, StepContext, carried_for, first_steps, make_plan, step_entry, step_inputs
from fngate.repository import (
    ArtifactFile,
    FolderRepository,
    FunctionVersion,
    decode_version,
    digest_of,
    encode_version,
    make_record,
)
from fngate.wire import Invocation

ROOT = Path(__file__).resolve().parents[2]


def function(name: str, inputs: dict[str, Any], outputs: dict[str, Any]) -> FunctionManifest:
    """A model function with tensors given as {name: (datatype, shape)}."""
    return parse_manifest(
        {
            "name": name,
            "model": {"backend": "python", "path": "model.py"},
            "inputs": [
                {"name": key, "datatype": kind, "shape": list(shape)} for key, (kind, shape) in inputs.items()
            ],
            "outputs": [
                {"name": key, "datatype": kind, "shape": list(shape)}
                for key, (kind, shape) in outputs.items()
            ],
        },
        name,
    )


NORMALIZE = function("normalize", {"input": ("FP32", (-1, -1))}, {"normalized": ("FP32", (-1, -1))})
MLP = function("mlp", {"input": ("FP32", (-1, 16))}, {"probabilities": ("FP32", (-1, 4))})
DOUBLE = function("double", {"x": ("FP32", (-1, 16))}, {"y": ("FP32", (-1, 16))})
MERGE = function("merge", {"a": ("FP32", (-1, 4)), "b": ("FP32", (-1, 16))}, {"out": ("FP32", (-1, 20))})
FUNCTIONS = {"normalize": NORMALIZE, "mlp": MLP, "double": DOUBLE, "merge": MERGE}

TWO_STEPS: dict[str, Any] = {
    "name": "scored",
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}],
    "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 4]}],
    "pipeline": {
        "steps": [
            {"name": "norm", "function": "normalize", "inputs": {"input": "request.input"}},
            {"name": "score", "function": "mlp@2", "inputs": {"input": "norm.normalized"}},
        ],
        "outputs": {"probabilities": "score.probabilities"},
    },
}

DIAMOND: dict[str, Any] = {
    "name": "diamond",
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}],
    "outputs": [
        {"name": "merged", "datatype": "FP32", "shape": [-1, 20]},
        {"name": "normalized", "datatype": "FP32", "shape": [-1, 16]},
    ],
    "pipeline": {
        "steps": [
            # Listed out of order on purpose: references make the graph.
            {"name": "join", "function": "merge", "inputs": {"a": "left.probabilities", "b": "right.y"}},
            {"name": "left", "function": "mlp", "inputs": {"input": "norm.normalized"}},
            {"name": "right", "function": "double", "inputs": {"x": "norm.normalized"}},
            {"name": "norm", "function": "normalize", "inputs": {"input": "request.input"}},
        ],
        "outputs": {"merged": "join.out", "normalized": "norm.normalized"},
    },
}


def pipeline(doc: dict[str, Any], **steps: Any) -> dict[str, Any]:
    """`doc` with its pipeline section changed."""
    return {**doc, "pipeline": {**doc["pipeline"], **steps}}


def steps_of(manifest: FunctionManifest) -> dict[str, FunctionManifest | None]:
    assert manifest.pipeline is not None
    return {step.name: FUNCTIONS.get(step.function_name) for step in manifest.pipeline.steps}


def test_a_manifest_has_a_model_or_a_pipeline() -> None:
    manifest = parse_manifest(TWO_STEPS, "f")
    assert manifest.pipeline is not None and manifest.model_spec is None
    assert [step.pinned for step in manifest.pipeline.steps] == [None, "2"]
    with pytest.raises(AttributeError, match="is a pipeline"):
        _ = manifest.model
    both = {**TWO_STEPS, "model": {"backend": "python", "path": "model.py"}}
    with pytest.raises(ManifestError, match="either a model or a pipeline"):
        parse_manifest(both, "f")
    neither = {key: value for key, value in TWO_STEPS.items() if key != "pipeline"}
    with pytest.raises(ManifestError, match=r"model .* or pipeline .* is required"):
        parse_manifest(neither, "f")


def test_a_model_manifest_reads_and_writes_model() -> None:
    manifest = function("mlp", {"input": ("FP32", (-1, 16))}, {"p": ("FP32", (-1, 4))})
    dumped = manifest.model_dump(mode="json")
    assert dumped["model"]["backend"] == "python" and "model_spec" not in dumped
    assert parse_manifest(dumped, "again") == manifest


@pytest.mark.parametrize(
    ("steps", "where", "message"),
    [
        (
            [{"name": "request", "function": "a", "inputs": {"x": "request.x"}}],
            "pipeline.steps.0.name",
            "'request' names",
        ),
        (
            [{"name": "a", "function": "A", "inputs": {"x": "request.x"}}],
            "pipeline.steps.0.function",
            "not a function",
        ),
        (
            [{"name": "a", "function": "a@0", "inputs": {"x": "request.x"}}],
            "pipeline.steps.0.function",
            "pinned",
        ),
        (
            [{"name": "a", "function": "a", "inputs": {"x": "nodot"}}],
            "pipeline.steps.0.inputs",
            "not `request.",
        ),
        ([{"name": "a", "function": "a", "inputs": {}}], "pipeline.steps.0.inputs", "at least 1"),
        (
            [
                {"name": "a", "function": "a", "inputs": {"x": "request.input"}},
                {"name": "a", "function": "b", "inputs": {"x": "request.input"}},
            ],
            "pipeline",
            "duplicate names ['a']",
        ),
    ],
)
def test_the_schema_refuses_malformed_steps(steps: list[dict[str, Any]], where: str, message: str) -> None:
    with pytest.raises(ManifestError) as caught:
        parse_manifest(pipeline(TWO_STEPS, steps=steps), "f")
    assert any(
        place.replace("[", ".").replace("]", "") == where and message in text
        for place, text in caught.value.problems
    ), caught.value.problems


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"steps": [{"name": "norm", "function": "normalize", "inputs": {"input": "request.image"}}]},
            "step 'norm': the pipeline has no input 'image' (its inputs: input)",
        ),
        (
            {
                "steps": [
                    {"name": "norm", "function": "normalize", "inputs": {"input": "request.input"}},
                    {"name": "score", "function": "mlp", "inputs": {"input": "nrom.normalized"}},
                ]
            },
            "step 'score': no step 'nrom' (steps: norm, score)",
        ),
        (
            {"outputs": {"probabilities": "score.probabilities", "extra": "norm.normalized"}},
            "['extra'] are not among",
        ),
        ({"outputs": {"other": "score.probabilities"}}, "no source for declared outputs ['probabilities']"),
        (
            {
                "steps": [
                    {"name": "norm", "function": "normalize", "inputs": {"input": "request.input"}},
                    {"name": "unused", "function": "normalize", "inputs": {"input": "request.input"}},
                    {"name": "score", "function": "mlp", "inputs": {"input": "norm.normalized"}},
                ]
            },
            "step 'unused': no step and no output uses its outputs",
        ),
        (
            {"steps": [{"name": "norm", "function": "normalize", "inputs": {"input": "norm.normalized"}}]},
            "step 'norm' reads its own output",
        ),
    ],
)
def test_graph_problems_name_the_step(change: dict[str, Any], message: str) -> None:
    manifest = FunctionManifest.model_validate(pipeline(TWO_STEPS, **change))  # the schema alone
    problems = graph_problems(manifest)
    assert any(message in text for _where, text in problems), problems
    with pytest.raises(ManifestError) as caught:  # what reading a manifest reports
        parse_manifest(pipeline(TWO_STEPS, **change), "f")
    assert caught.value.problems == problems


def test_a_cycle_is_refused_naming_its_steps() -> None:
    cyclic = pipeline(
        TWO_STEPS,
        steps=[
            {"name": "norm", "function": "normalize", "inputs": {"input": "score.probabilities"}},
            {"name": "score", "function": "mlp", "inputs": {"input": "norm.normalized"}},
        ],
    )
    manifest = FunctionManifest.model_validate(cyclic)
    assert manifest.pipeline is not None
    assert find_cycle(manifest.pipeline) == ["norm", "score", "norm"]
    assert graph_problems(manifest) == [
        ("pipeline.steps", "step 'norm' depends on itself: 'norm' -> 'score' -> 'norm'")
    ]
    with pytest.raises(ValueError, match="step 'norm' is on a cycle"):
        order(manifest.pipeline)


def test_order_puts_each_step_after_what_it_reads() -> None:
    manifest = parse_manifest(DIAMOND, "f")
    assert manifest.pipeline is not None
    names = [manifest.pipeline.steps[index].name for index in order(manifest.pipeline)]
    assert names == ["norm", "left", "right", "join"]
    assert graph_problems(manifest) == []
    assert edge_problems(manifest, steps_of(manifest)) == []


@pytest.mark.parametrize(
    ("given", "taken", "agree"),
    [
        ((-1, 16), (-1, 16), True),
        ((-1, -1), (-1, 16), True),
        ((-1, 8), (-1, 16), False),
        ((-1, 16), (16,), False),
    ],
)
def test_shapes_agree_when_every_dimension_may_match(
    given: tuple[int, ...], taken: tuple[int, ...], agree: bool
) -> None:
    assert shapes_agree(given, taken) is agree


def test_edge_problems_check_names_datatypes_and_shapes_along_each_edge() -> None:
    wrong = {
        **FUNCTIONS,
        "mlp": function(
            "mlp", {"input": ("FP64", (-1, 8)), "mask": ("BOOL", (-1, 8))}, {"p": ("FP32", (-1, 4))}
        ),
    }
    manifest = parse_manifest(TWO_STEPS, "f")
    assert manifest.pipeline is not None
    problems = [
        text
        for _where, text in edge_problems(
            manifest, {s.name: wrong.get(s.function_name) for s in manifest.pipeline.steps}
        )
    ]
    assert "step 'score': mlp@2 also takes ['mask']" in problems
    assert "step 'score': norm.normalized is FP32, 'input' takes FP64" in problems
    assert (
        "step 'score': norm.normalized has shape [-1, -1], 'input' takes [-1, 8]" not in problems
    )  # -1 may be 8
    assert any(
        "the pipeline: step 'score' has no output 'probabilities' (its outputs: p)" in text
        for text in problems
    )
    small = {
        **steps_of(manifest),
        "score": MLP.model_copy(update={"batching": MLP.batching.model_copy(update={"max_batch_size": 8})}),
    }
    assert [text for _where, text in edge_problems(manifest, small)] == [
        "step 'score': mlp@2 takes at most 8 rows, the pipeline up to 32 (lower its batching.max_batch_size)"
    ]
    missing = edge_problems(manifest, {"norm": NORMALIZE, "score": None})
    assert missing == [("pipeline.steps[1].function", "step 'score': function 'mlp@2' is not deployed")]


def test_the_plan_joins_carries_only_what_later_steps_read_and_round_trips() -> None:
    manifest = parse_manifest(DIAMOND, "f")
    resolved = {
        step: (FUNCTIONS[name], "1", f"digest-{name}")
        for step, name in (("norm", "normalize"), ("left", "mlp"), ("right", "double"), ("join", "merge"))
    }
    plan = make_plan(manifest, "3", resolved)
    assert [step.name for step in plan.steps] == ["norm", "left", "right", "join"]
    assert plan.first() == [0]
    assert plan.successors(0) == [1, 2, plan.end]  # the outputs read norm.normalized too
    assert plan.predecessors(3) == [1, 2] and plan.predecessors(plan.end) == [3, 0]
    rows = np.ones((2, 16), dtype=np.float32)
    available = {"request.input": rows, "norm.normalized": rows / 4}
    # After `left`, only what `join` and the outputs read travels on.
    assert set(carried_for(plan, 1, available)) == {"norm.normalized"}
    assert set(step_inputs(plan, 1, available)) == {"input"}
    context = StepContext(
        "id1", "fngate:r:g", 123, plan, 1, carried_for(plan, 1, available), "00-tp", "ck", 60
    )
    back = StepContext.decode(context.encode())
    assert back.plan == plan and Plan.decode(plan.encode()) == plan
    assert (back.invocation_id, back.reply_to, back.deadline_ms, back.node, back.cache_key) == (
        "id1",
        "fngate:r:g",
        123,
        1,
        "ck",
    )
    np.testing.assert_array_equal(back.carried["norm.normalized"], rows / 4)


def test_deploy_refuses_a_pipeline_whose_steps_are_not_deployed_or_do_not_fit(tmp_path: Path) -> None:
    repository = FolderRepository(tmp_path / "repo")
    (tmp_path / "repo").mkdir()
    shutil.copytree(ROOT / "functions" / "normalize", tmp_path / "repo" / "normalize")
    folder = tmp_path / "scored"
    folder.mkdir()
    path = folder / "function.yaml"
    path.write_text(yaml.safe_dump(TWO_STEPS))
    out, err = io.StringIO(), io.StringIO()
    assert deploy(path, repository, "redis://127.0.0.1:1", None, out, err) == 2
    assert "pipeline.steps[1].function: step 'score': function 'mlp@2' is not deployed" in err.getvalue()
    assert "nothing was uploaded" in err.getvalue()
    # The classifier is deployed, but takes 16 features where this pipeline's norm gives INT32.
    shutil.copytree(ROOT / "functions" / "classifier", tmp_path / "repo" / "classifier")
    wrong = pipeline(
        {**TWO_STEPS, "inputs": [{"name": "input", "datatype": "INT32", "shape": [-1, 16]}]},
        steps=[{"name": "score", "function": "classifier", "inputs": {"input": "request.input"}}],
    )
    path.write_text(yaml.safe_dump(wrong))
    err = io.StringIO()
    assert deploy(path, repository, "redis://127.0.0.1:1", None, out, err) == 2
    assert "step 'score': request.input is INT32, 'input' takes FP32" in err.getvalue()
    assert deploy_problems(parse_manifest(wrong, "f"), repository.scan()) != []


def test_validate_checks_a_pipeline_against_the_functions_beside_it(tmp_path: Path) -> None:
    for name in ("normalize", "classifier"):
        shutil.copytree(ROOT / "functions" / name, tmp_path / name)
    (tmp_path / "scored").mkdir()
    path = tmp_path / "scored" / "function.yaml"
    doc = pipeline(
        TWO_STEPS,
        steps=[
            {"name": "norm", "function": "normalize", "inputs": {"input": "request.input"}},
            {"name": "score", "function": "classifier", "inputs": {"input": "norm.normalized"}},
        ],
    )
    path.write_text(yaml.safe_dump(doc))
    assert check(path) == ([], "")
    doc["outputs"] = [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 16]}]
    path.write_text(yaml.safe_dump(doc))
    problems, _note = check(path)
    assert problems == [
        f"{path}: pipeline.outputs.probabilities: the pipeline: score.probabilities has shape [-1, 4], "
        "'probabilities' takes [-1, 16]"
    ]


def test_ls_shows_pipelines_with_their_steps_in_order(tmp_path: Path) -> None:
    (tmp_path / "diamond").mkdir()
    (tmp_path / "diamond" / "function.yaml").write_text(yaml.safe_dump(DIAMOND))
    out, err = io.StringIO(), io.StringIO()
    assert list_functions(FolderRepository(tmp_path), "redis://127.0.0.1:1", False, out, err) == 0
    lines = out.getvalue().splitlines()
    assert lines[lines.index("PIPELINE  VERSION  STEPS") + 1] == (
        "diamond   1        norm (normalize) -> left (mlp) -> right (double) -> join (merge)"
    )


def test_one_deploy_command_deploys_a_pipeline_with_its_functions(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    repository = FolderRepository(tmp_path / "repo")
    for name in ("normalize", "classifier"):
        shutil.copytree(ROOT / "functions" / name, tmp_path / name)
    (tmp_path / "scored").mkdir()
    doc = pipeline(
        TWO_STEPS,
        steps=[
            {"name": "norm", "function": "normalize", "inputs": {"input": "request.input"}},
            {"name": "score", "function": "classifier", "inputs": {"input": "norm.normalized"}},
        ],
    )
    (tmp_path / "scored" / "function.yaml").write_text(yaml.safe_dump(doc))
    paths = [tmp_path / name / "function.yaml" for name in ("scored", "normalize")]
    out, err = io.StringIO(), io.StringIO()
    # The classifier is neither deployed nor given: nothing at all is uploaded.
    assert deploy_all(paths, repository, "redis://127.0.0.1:1", None, out, err) == 2
    assert "step 'score': function 'classifier' is not deployed" in err.getvalue()
    assert repository.scan() == {}
    paths.append(tmp_path / "classifier" / "function.yaml")
    assert deploy_all(paths, repository, "redis://127.0.0.1:1", None, out, err) == 0
    assert sorted(repository.scan()) == ["classifier", "normalize", "scored"]
    deployed = [line.split()[1] for line in out.getvalue().splitlines() if line.startswith("deployed ")]
    assert deployed == ["normalize", "classifier", "scored"]  # functions first, in the order given


def test_deploy_checks_every_version_a_step_may_be_routed_to() -> None:
    canary = parse_manifest(
        {
            **MLP.model_dump(mode="json"),
            "inputs": [{"name": "input", "datatype": "FP16", "shape": [-1, 16]}],
            "versions": {"policy": "latest", "latest": 2, "traffic": {1: 90, 2: 10}},
        },
        "mlp",
    )
    records = {
        "normalize": make_record([FunctionVersion(NORMALIZE, "1", Path())]),
        "mlp": make_record([FunctionVersion(MLP, "1", Path()), FunctionVersion(canary, "2", Path())]),
    }
    unpinned = parse_manifest(
        pipeline(
            TWO_STEPS,
            steps=[
                TWO_STEPS["pipeline"]["steps"][0],
                {**TWO_STEPS["pipeline"]["steps"][1], "function": "mlp"},
            ],
        ),
        "f",
    )
    assert [text for _where, text in deploy_problems(unpinned, records)] == [
        "step 'score': norm.normalized is FP32, 'input' takes FP16"  # the canary's input
    ]
    pinned_to_three = parse_manifest(
        pipeline(
            TWO_STEPS,
            steps=[
                TWO_STEPS["pipeline"]["steps"][0],
                {**TWO_STEPS["pipeline"]["steps"][1], "function": "mlp@3"},
            ],
        ),
        "f",
    )
    assert "step 'score': mlp serves no version 3 (1, 2)" in [
        text for _where, text in deploy_problems(pinned_to_three, records)
    ]
    pinned_to_one = parse_manifest(TWO_STEPS, "f").model_copy()
    assert (
        deploy_problems(pinned_to_one, records)[0][1]
        == "step 'score': norm.normalized is FP32, 'input' takes FP16"
    )


def test_validate_refuses_a_cycle_naming_its_steps(tmp_path: Path) -> None:
    cyclic = pipeline(
        TWO_STEPS,
        steps=[
            {"name": "norm", "function": "normalize", "inputs": {"input": "score.probabilities"}},
            {"name": "score", "function": "mlp", "inputs": {"input": "norm.normalized"}},
        ],
    )
    path = tmp_path / "function.yaml"
    path.write_text(yaml.safe_dump(cyclic))
    assert check(path) == (
        [f"{path}: pipeline.steps: step 'norm' depends on itself: 'norm' -> 'score' -> 'norm'"],
        "",
    )


def test_a_pipeline_version_round_trips_through_its_index() -> None:
    """What the registry and an S3 repository keep: a pipeline has no model file among its files."""
    manifest = parse_manifest(TWO_STEPS, "f")
    files = (ArtifactFile("function.yaml", "a" * 64, 10),)
    version = FunctionVersion(manifest, "1", Path(), digest_of(files), files)
    back = decode_version(encode_version(version), Path(), "index")
    assert back == version


def test_an_asynchronous_pipelines_first_steps_wait_at_the_asynchronous_level() -> None:
    """Two steps read the request: both are first, each queued on its function's asynchronous
    stream under that level's limit, replying to the result stream and carrying what the runner
    needs to keep the result and tell the callback."""
    fork = {
        **DIAMOND,
        "outputs": DIAMOND["outputs"][:1],
        "pipeline": {
            "steps": [
                {"name": "join", "function": "merge", "inputs": {"a": "left.probabilities", "b": "right.y"}},
                {"name": "left", "function": "mlp", "inputs": {"input": "request.input"}},
                {"name": "right", "function": "double", "inputs": {"x": "request.input"}},
            ],
            "outputs": {"merged": "join.out"},
        },
    }
    limited = MLP.batching.model_copy(update={"max_queue_size": 5, "max_async_queue_size": 7})
    functions = {**FUNCTIONS, "mlp": MLP.model_copy(update={"batching": limited})}
    resolved = {
        step: (functions[name], "1", "")
        for step, name in (("left", "mlp"), ("right", "double"), ("join", "merge"))
    }
    plan = make_plan(parse_manifest(fork, "f"), "2", resolved)
    result = keys.result("id1")
    context = StepContext("id1", result, 123, plan, 0, {}, None, "", 0, keys.ASYNC, 60, f"{result}:cb")
    rows = np.ones((2, 16), dtype=np.float32)
    steps = first_steps(context, {"input": rows})
    assert [(step.step.name, list(inputs)) for step, inputs in steps] == [
        ("left", ["input"]),
        ("right", ["x"]),
    ]
    entries = [step_entry(step, inputs) for step, inputs in steps]
    assert [entry.stream for entry in entries] == [
        keys.invocations("mlp", keys.ASYNC),
        keys.invocations("double", keys.ASYNC),
    ]
    assert entries[0].max_queue_size == 7
    invocation = Invocation.decode(entries[1].fields)
    assert (invocation.id, invocation.function, invocation.reply_to) == ("id1", "double", result)
    back = StepContext.decode(entries[0].step)
    assert (back.node, back.level, back.result_ttl_s, back.callback) == (0, keys.ASYNC, 60, f"{result}:cb")
    assert list(back.carried) == []  # `join` reads only the steps' outputs

    synchronous = step_entry(*first_steps(dataclasses.replace(context, level=keys.SYNC), {"input": rows})[0])
    assert (synchronous.stream, synchronous.max_queue_size) == (keys.invocations("mlp"), 5)
    # A plan encoded before the asynchronous limit was carried still decodes.
    older = plan.encode()
    older["steps"] = [item[:8] for item in older["steps"]]
    assert Plan.decode(older).steps[0].max_queue_size == 5
