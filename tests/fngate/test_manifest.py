from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fngate.config import GatewaySettings
from fngate.manifest import FunctionManifest, ManifestError, load_manifest, parse_manifest
from fngate.tensors import DATATYPES

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(ROOT.glob("functions/*/function.yaml"))

VALID: dict[str, Any] = {
    "name": "text-classifier",
    "model": {"backend": "onnxruntime", "path": "model.onnx"},
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 256]}],
    "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 16]}],
}


def with_(**changes: Any) -> dict[str, Any]:
    return {**VALID, **changes}


PROMPT = {"name": "prompt", "datatype": "BYTES", "shape": [-1, 1]}
SAMPLING = {"name": "sampling", "datatype": "BYTES", "shape": [-1]}


def generator(inputs: tuple[dict[str, Any], ...] = (PROMPT,), **fields: Any) -> dict[str, Any]:
    """A text generator's manifest: its prompt input and text output, and `fields` of text_generation."""
    return with_(
        inputs=list(inputs),
        outputs=[{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}],
        text_generation={"input": "prompt", "output": "text", **fields},
    )


def test_examples_are_valid() -> None:
    assert EXAMPLES, "functions/ has no examples"
    for path in EXAMPLES:
        manifest = load_manifest(path)
        assert manifest.name == path.parent.name


def test_defaults() -> None:
    manifest = parse_manifest(VALID, "f.yaml")
    assert manifest.batching.max_batch_size == 32
    assert manifest.batched
    assert manifest.cache.enabled is False
    assert manifest.scaling.min_replicas == 0


def test_datatypes_match_the_tensor_table() -> None:
    for datatype in DATATYPES:
        spec = with_(inputs=[{"name": "x", "datatype": datatype, "shape": [-1, 2]}])
        assert parse_manifest(spec, "f.yaml").inputs[0].datatype == datatype


@pytest.mark.parametrize(
    ("manifest", "where", "fragment"),
    [
        (with_(name="Bad_Name"), "name", "DNS-1123"),
        (with_(name="x" * 64), "name", "at most 63"),
        (with_(extra_key=1), "extra_key", "unknown key (known keys: name, description, model,"),
        (with_(scalling={}), "scalling", "unknown key; did you mean 'scaling'?"),
        (with_(batching={"max_batch": 8}), "batching.max_batch", "did you mean 'max_batch_size'?"),
        (
            with_(inputs=[{"name": "x", "datatype": "FP32", "shape": [-1], "dtype": 1}]),
            "inputs[0].dtype",
            "did you mean 'datatype'?",
        ),
        (with_(model={"backend": "onnx", "path": "m"}), "model.backend", "'onnx' is not allowed: use"),
        (with_(model={"path": "m"}), "model.backend", "is required"),
        (with_(model={"backend": "tensorflow", "path": "m"}), "model.backend", "onnxruntime"),
        (with_(model={"backend": "onnxruntime", "path": "../escape.onnx"}), "model.path", "relative path"),
        (with_(model={"backend": "onnxruntime", "path": "/abs.onnx"}), "model.path", "relative path"),
        (with_(model={"backend": "python", "path": "m.py", "accelerator": "tensorrt"}), "model", "or cuda"),
        (
            with_(model={"backend": "onnxruntime", "path": "m", "memory_limit_mb": 512}),
            "model",
            "python backend",
        ),
        (
            with_(model={"backend": "onnxruntime", "path": "m", "pids_limit": 64}),
            "model",
            "pids_limit applies to a process of the model's own",
        ),
        (
            with_(model={"backend": "tensorrt", "path": "m", "working_folder_limit_mb": 64}),
            "model",
            "working_folder_limit_mb applies to a process of the model's own",
        ),
        (
            with_(model={"backend": "onnxruntime", "path": "m", "own_process": True}),
            "model",
            "own_process applies to the pytorch backend",
        ),
        (
            with_(model={"backend": "python", "path": "m.py", "max_output_bytes": 2**29 + 1}),
            "model.max_output_bytes",
            "less than or equal to 536870912",
        ),
        (
            with_(model={"backend": "python", "path": "m.py", "execution_timeout_ms": 0}),
            "model.execution_timeout_ms",
            "greater than or equal to 1",
        ),
        (with_(inputs=[{"name": "x", "datatype": "FLOAT", "shape": [-1]}]), "inputs[0].datatype", "FP32"),
        (
            with_(inputs=[{"name": "x", "datatype": "FP32", "shape": [-1, 0]}]),
            "inputs[0].shape",
            "dimension 0",
        ),
        (with_(inputs=[{"name": "x", "datatype": "FP32", "shape": [4, 2]}]), "", "batch dimension"),
        (with_(inputs=[]), "inputs", "at least 1"),
        (
            with_(batching={"max_batch_size": 8, "preferred_batch_sizes": [16]}),
            "batching",
            "over max_batch_size",
        ),
        (with_(batching={"max_queue_size": 0}), "batching.max_queue_size", "greater than or equal to 1"),
        (generator(output="probabilities"), "", "text_generation.output: 'probabilities' must name a BYTES"),
        (generator(input="nope"), "", "text_generation.input: 'nope' must name a BYTES input of one element"),
        (
            generator((PROMPT, {**SAMPLING, "shape": [-1, 2]}), parameters="sampling"),
            "",
            "text_generation.parameters: 'sampling' must name a BYTES input of one element",
        ),
        (generator((PROMPT, SAMPLING)), "", "the inputs ['sampling'] would be missing from every call"),
        (generator(parameters="prompt"), "", "its input and parameters are two inputs"),
        (generator(prompt="x"), "text_generation.prompt", "unknown key"),
        (with_(scaling={"min_replicas": 5, "max_replicas": 2}), "scaling", "over max_replicas"),
        (
            with_(
                inputs=[
                    {"name": "x", "datatype": "FP32", "shape": [-1]},
                    {"name": "x", "datatype": "FP32", "shape": [-1]},
                ]
            ),
            "",
            "duplicate names",
        ),
    ],
)
def test_bad_manifests_name_the_field(manifest: dict[str, Any], where: str, fragment: str) -> None:
    with pytest.raises(ManifestError) as caught:
        parse_manifest(manifest, "f.yaml")
    problems = caught.value.problems
    assert any(path == where and fragment in message for path, message in problems), problems
    assert not any(message.startswith("Value error") for _, message in problems)


def test_a_text_generator_names_its_prompt_and_parameters_inputs_and_its_text_output() -> None:
    manifest = parse_manifest(generator((PROMPT, SAMPLING), parameters="sampling"), "f.yaml")
    assert manifest.text_generation is not None
    assert manifest.text_generation.model_dump() == {
        "input": "prompt",
        "output": "text",
        "parameters": "sampling",
    }
    assert parse_manifest(VALID, "f.yaml").text_generation is None


def test_execution_timeout_defaults_to_the_batching_timeout() -> None:
    assert parse_manifest(with_(batching={"timeout_ms": 2500}), "f").execution_timeout_s == 2.5
    python = {"backend": "python", "path": "m.py", "execution_timeout_ms": 100, "memory_limit_mb": 256}
    manifest = parse_manifest(with_(model=python), "f")
    assert manifest.execution_timeout_s == 0.1
    assert manifest.model.memory_limit_mb == 256


def test_unbatched_functions_take_whole_shapes() -> None:
    manifest = parse_manifest(
        with_(batching={"max_batch_size": 0}, inputs=[{"name": "x", "datatype": "INT64", "shape": [3, 2]}]),
        "f",
    )
    assert not manifest.batched


def test_yaml_is_loaded_safely(tmp_path: Path) -> None:
    path = tmp_path / "function.yaml"
    path.write_text("!!python/object/apply:os.system ['true']\n")
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_manifest(path)


def test_validate_command_prints_every_problem(tmp_path: Path) -> None:
    good = EXAMPLES[0]
    bad = tmp_path / "function.yaml"
    bad.write_text(yaml.safe_dump(with_(name="Bad", batching={"max_batch_size": -1}, extra=True)))
    result = subprocess.run(
        [sys.executable, "-m", "fngate.cli.main", "validate", str(good), str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert f"{good}: ok" in result.stdout
    lines = result.stderr.splitlines()
    assert any(line.startswith(f"{bad}: name: ") for line in lines), lines
    assert any(line.startswith(f"{bad}: batching.max_batch_size: ") for line in lines), lines
    assert any(line.startswith(f"{bad}: extra: ") for line in lines), lines


def test_validate_command_succeeds_on_the_examples() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fngate.cli.main", "validate", *map(str, EXAMPLES)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_manifest_is_frozen() -> None:
    manifest = parse_manifest(VALID, "f")
    with pytest.raises(ValueError, match="frozen"):
        manifest.name = "other"  # type: ignore[misc]
    assert isinstance(manifest, FunctionManifest)


def test_outputs_are_bounded_by_default_as_the_gateway_bounds_a_message() -> None:
    manifest = parse_manifest(VALID, "f.yaml")
    assert manifest.model.max_output_bytes == GatewaySettings.model_fields["max_body_bytes"].default


def test_a_stored_manifest_with_every_default_written_out_reads_back() -> None:
    """The repository stores a manifest as JSON with its defaults (the python backend's own included)."""
    manifest = parse_manifest(VALID, "f.yaml")
    assert parse_manifest(manifest.model_dump(mode="json"), "1.json") == manifest
