"""config.pbtxt onto the manifest (every field honoured or named in a warning), fngate validate and
import-triton of the guide's repository, and where a request's priority and timeout place it."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from fngate import keys, queue
from fngate.cli.triton import import_repository, validate_repository
from fngate.cli.validation import validate_files
from fngate.manifest import BatchingSpec, ManifestError, load_manifest
from fngate.triton.config import complete, map_config, parse_config
from tests.triton_repository import CLASSIFIER, DETECTOR, guide_repository


def mapped(text: str, model: str) -> tuple[dict[str, object], list[str]]:
    config = parse_config(text, f"{model}/config.pbtxt")
    complete(config, model, None)
    result = map_config(config, f"{model}/config.pbtxt")
    return result.data, [warning.removeprefix(f"{model}/config.pbtxt: ") for warning in result.warnings]


def test_the_classifier_configuration_maps_onto_a_manifest() -> None:
    config = parse_config(CLASSIFIER, "config.pbtxt")
    complete(config, "text_classifier", None)
    manifest = map_config(config, "config.pbtxt").manifest("3", "config.pbtxt")
    assert (manifest.name, manifest.model_name, manifest.model.backend) == (
        "text-classifier",
        "text_classifier",
        "onnxruntime",
    )
    assert manifest.model.path == "3/model.onnx" and manifest.model.accelerator == "cpu"
    assert [(spec.name, spec.datatype, spec.shape) for spec in manifest.inputs] == [
        ("input_ids", "INT64", (-1, -1)),
        ("attention_mask", "INT64", (-1, -1)),
    ]
    batching = manifest.batching
    assert (batching.max_batch_size, batching.preferred_batch_sizes, batching.max_queue_delay_us) == (
        8,
        (2, 4),
        500,
    )
    assert batching.queue_policy.model_dump() == {
        "timeout_action": "reject",
        "timeout_us": 2_000_000,
        "allow_timeout_override": True,
        "max_queue_size": 64,
    }
    assert (manifest.versions.policy, manifest.versions.latest) == ("latest", 2)


def data_instances(config: str) -> int:
    data, _ = mapped(config, "text_classifier")
    return int(data["model"].get("instances", 1))


def test_what_fngate_does_not_honour_is_named() -> None:
    _, warnings = mapped(CLASSIFIER, "text_classifier")
    assert [warning.split(":")[0] for warning in warnings] == ["model_warmup"]
    assert data_instances(CLASSIFIER) == 2  # instance_group [ { count: 2 } ]
    data, warnings = mapped(DETECTOR, "image_detector")
    assert data["model"] == {"backend": "tensorrt", "path": "model.plan"}
    assert any(warning.startswith("instance_group.gpus") for warning in warnings)
    assert any("'tensorrt' on tensorrt: not honoured" in warning for warning in warnings)
    assert any(
        "TRT_ENGINE_CACHE_ENABLE" in warning and "TRT_ENGINE_CACHE_PATH" in warning for warning in warnings
    )
    accelerated = CLASSIFIER.replace(
        "model_warmup",
        'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" '
        'parameters { key: "precision_mode" value: "FP16" } '
        'parameters { key: "max_workspace_size_bytes" value: "1024" } '
        'parameters { key: "trt_engine_cache_path" value: "/x" } } ] } }\nmodel_warmup',
    )
    data, warnings = mapped(accelerated, "text_classifier")
    assert data["model"] == {
        "backend": "onnxruntime",
        "path": "model.onnx",
        "accelerator": "tensorrt",
        "precision": "fp16",
        "instances": 2,
    }
    assert any("max_workspace_size_bytes: not honoured" in warning for warning in warnings)
    assert any("trt_engine_cache_path: not honoured" in warning for warning in warnings)
    stateful = CLASSIFIER.split("dynamic_batching")[0] + (
        "sequence_batching { max_sequence_idle_microseconds: 5000"
        " oldest { max_queue_delay_microseconds: 300 }"
        " control_input [ { name: 'START'"
        " control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },"
        " { name: 'ID' control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] } ]"
        " state [ { input_name: 'IN' output_name: 'OUT' data_type: TYPE_FP32 dims: [ 1 ]"
        " use_growable_memory: true } ] }"
    )
    data, warnings = mapped(stateful, "text_classifier")
    assert data["sequence"] == {
        "controls": [
            {"input": "START", "kind": "start", "datatype": "FP32", "false_true": [0, 1]},
            {"input": "ID", "kind": "corrid", "datatype": "STRING"},
        ],
        "idle_timeout_us": 5000,
        "states": [{"input": "IN", "output": "OUT", "datatype": "FP32", "dims": [1]}],
    }
    assert data["batching"]["max_queue_delay_us"] == 300
    # A GPU buffer's growth is the one part not served: said, and nothing else about sequences.
    assert [warning for warning in warnings if "sequence_batching" in warning] == [
        "sequence_batching.state.use_growable_memory: not honoured (a state is copied in and out)"
    ]
    for state, why in (
        ("data_type: TYPE_STRING dims: [ 1 ]", "a state is a tensor of numbers or booleans"),
        ("data_type: TYPE_FP32 dims: [ -1 ]", "a state's dimensions are fixed"),
        (
            "data_type: TYPE_FP32 dims: [ 1 ] initial_state [ { data_type: TYPE_FP32 dims: [ 1 ]"
            " data_file: 'x' } ]",
            "an initial state from data_file is not honoured",
        ),
        ("data_type: TYPE_FP32 dims: [ 1024, 1024 ]", "past the 1048576 fngate keeps"),
    ):
        config = stateful.replace("data_type: TYPE_FP32 dims: [ 1 ] use_growable_memory: true", state)
        with pytest.raises(ManifestError, match=re.escape(why)):
            parsed = parse_config(config, "config.pbtxt")
            complete(parsed, "text_classifier", None)
            map_config(parsed, "config.pbtxt").manifest("1", "config.pbtxt")
    assert not any(warning.startswith("dynamic_batching") for warning in warnings)
    with pytest.raises(ManifestError, match="not a Triton model configuration"):  # Triton's schema decides
        parse_config(CLASSIFIER + "\nno_such_field: 1", "config.pbtxt")


GENERATOR = """
name: "generator"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
dynamic_batching { }
parameters { key: "text_generation_input" value: { string_value: "text_input" } }
parameters { key: "text_generation_output" value: { string_value: "text_output" } }
"""


def test_a_text_generator_is_declared_by_parameters_that_name_its_tensors() -> None:
    config = parse_config(GENERATOR, "config.pbtxt")
    complete(config, "generator", None)
    mapped_config = map_config(config, "config.pbtxt")
    manifest = mapped_config.manifest("1", "config.pbtxt")
    assert manifest.text_generation is not None
    assert (manifest.text_generation.input, manifest.text_generation.output) == ("text_input", "text_output")
    assert mapped_config.warnings == ()  # fngate's own parameters, on any backend
    half = GENERATOR.replace('parameters { key: "text_generation_output"', 'parameters { key: "other"')
    with pytest.raises(ManifestError, match=r"parameters\.text_generation_output: a text generator names"):
        mapped(half, "generator")
    unknown = GENERATOR.replace('string_value: "text_output"', 'string_value: "nope"')
    with pytest.raises(ManifestError, match=r"text_generation\.output: 'nope' must name a BYTES output"):
        map_config(parse_config(unknown, "config.pbtxt"), "config.pbtxt").manifest("1", "config.pbtxt")


def test_validate_and_import_the_guide_repository(tmp_path: Path) -> None:
    root = guide_repository(tmp_path / "models")
    out, err = io.StringIO(), io.StringIO()
    assert validate_repository(root, out, err) == 0, err.getvalue()
    assert len(out.getvalue().splitlines()) == 6
    assert "text_classifier as text-classifier version 3, onnxruntime" in out.getvalue()
    assert "model_warmup: not honoured" in err.getvalue()
    written = import_repository(root, tmp_path / "functions", io.StringIO())
    assert sorted(path.parent.name for path in written) == [
        "autocompleted",
        "classify-text",
        "image-detector",
        "postprocessor",
        "text-classifier",
        "tokenizer",
    ]
    classifier = load_manifest(tmp_path / "functions" / "text-classifier" / "function.yaml")
    assert classifier.model.path == "3/model.onnx" and classifier.model_name == "text_classifier"
    assert (tmp_path / "functions" / "text-classifier" / "3" / "model.onnx").is_file()
    pipeline = tmp_path / "functions" / "classify-text" / "function.yaml"
    ok = io.StringIO()
    assert validate_files([pipeline, *[path for path in written if path != pipeline]], ok, io.StringIO()) == 0


def test_a_priority_and_a_timeout_place_an_invocation() -> None:
    batching = BatchingSpec.model_validate(
        {
            "priority_levels": 3,
            "default_priority_level": 2,
            "queue_policy": {"timeout_us": 5000, "allow_timeout_override": True, "max_queue_size": 100},
            "priority_queue_policy": {1: {"timeout_action": "delay", "timeout_us": 1000}},
        }
    )
    assert keys.levels("f", 3) == ("fngate:q:{f}", "fngate:q:{f}:p2", "fngate:q:{f}:p3", "fngate:q:{f}:1")
    table = [
        # priority, timeout (µs): level, its limit, queue timeout (ms), delay
        ((0, None), (2, 100, 5, False)),
        ((7, None), (2, 100, 5, False)),  # past priority_levels: the default level, as Triton
        ((3, 2000), (3, 100, 2, False)),  # shortened where the policy allows it
        ((3, 9000), (3, 100, 5, False)),  # never lengthened
        ((1, 500), (1, 1000, 1, True)),  # level 1's own policy: no override, DELAY
    ]
    for (priority, timeout_us), (level, limit, timeout_ms, delay) in table:
        placed = queue.place("f", batching, priority, timeout_us)
        assert (placed.priority, placed.max_queue_size, placed.queue_timeout_ms, placed.delay) == (
            level,
            limit,
            timeout_ms,
            delay,
        )
        assert placed.stream == keys.levels("f", 3)[level - 1]
    assert queue.place("g", BatchingSpec(), 2, 10).stream == "fngate:q:{g}"
    # A runner's room per level: what it holds of a lower level never fills a higher one's.
    assert queue.rooms(4, [2, 2, 2, 2], 4) == [4, 4, 0, 0]
    assert queue.rooms(4, [0, 1, 1], 3) == [3, 1, 1]


def test_a_priority_queue_policy_is_honoured_as_triton_serves_it() -> None:
    config = """
name: "ranked"
backend: "python"
max_batch_size: 8
input [{ name: "x" data_type: TYPE_FP32 dims: [2] }]
output [{ name: "y" data_type: TYPE_FP32 dims: [2] }]
dynamic_batching {
  priority_levels: 2
  default_priority_level: 1
  priority_queue_policy { key: 2 value { timeout_action: DELAY default_timeout_microseconds: 3000
    max_queue_size: 5 } }
}
"""
    data, _ = mapped(config, "ranked")
    parsed = parse_config(config, "ranked/config.pbtxt")
    complete(parsed, "ranked", None)
    manifest = map_config(parsed, "ranked/config.pbtxt").manifest("1", "ranked/config.pbtxt")
    placed = queue.place("ranked", manifest.batching, 2, None)
    assert (placed.priority, placed.max_queue_size, placed.queue_timeout_ms, placed.delay) == (2, 5, 3, True)
    assert queue.place("ranked", manifest.batching, 1, None).max_queue_size != 5
    served = data["triton"]["config"]["dynamic_batching"]["priority_queue_policy"]  # type: ignore[index]
    assert served == {
        "2": {
            "timeout_action": "DELAY",
            "default_timeout_microseconds": 3000,
            "allow_timeout_override": False,
            "max_queue_size": 5,
        }
    }
