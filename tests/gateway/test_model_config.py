"""Triton's model configuration, derived from a manifest."""

from __future__ import annotations

from typing import Any

from fngate.manifest import parse_manifest
from gateway.model_config import model_config


def manifest(**changes: Any) -> Any:
    doc: dict[str, Any] = {
        "name": "classifier",
        "model": {"backend": "onnxruntime", "path": "model.onnx"},
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}],
        "outputs": [{"name": "labels", "datatype": "BYTES", "shape": [-1, 1]}],
        "batching": {"max_batch_size": 32, "preferred_batch_sizes": [8, 16], "max_queue_delay_us": 500},
        **changes,
    }
    return parse_manifest(doc, "test")


def test_batched_function() -> None:
    config = model_config(manifest())
    assert config["name"] == "classifier"
    assert config["platform"] == "onnxruntime_onnx"
    assert config["backend"] == "onnxruntime"
    assert config["max_batch_size"] == 32
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [16]}]
    assert config["output"] == [{"name": "labels", "data_type": "TYPE_STRING", "dims": [1]}]
    batching = config["dynamic_batching"]
    assert batching["preferred_batch_size"] == [8, 16]
    assert batching["max_queue_delay_microseconds"] == 500
    assert batching["default_queue_policy"]["max_queue_size"] == 1000
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["version_policy"] == {"latest": {"num_versions": 1}}


def test_unbatched_function_keeps_whole_shapes() -> None:
    config = model_config(
        manifest(
            batching={"max_batch_size": 0},
            inputs=[{"name": "input", "datatype": "INT64", "shape": [2, 3]}],
            outputs=[{"name": "labels", "datatype": "FP16", "shape": [2]}],
        )
    )
    assert config["max_batch_size"] == 0
    assert "dynamic_batching" not in config
    assert config["input"][0]["dims"] == [2, 3]
    assert config["output"][0]["data_type"] == "TYPE_FP16"


def test_accelerators_and_policies() -> None:
    config = model_config(
        manifest(
            model={
                "backend": "onnxruntime",
                "path": "m.onnx",
                "accelerator": "tensorrt",
                "precision": "fp16",
            },
            versions={"policy": "specific", "specific": [2, 3]},
        )
    )
    assert config["instance_group"][0]["kind"] == "KIND_GPU"
    accelerator = config["optimization"]["execution_accelerators"]["gpu_execution_accelerator"][0]
    assert accelerator == {"name": "tensorrt", "parameters": {"precision_mode": "FP16"}}
    assert config["version_policy"] == {"specific": {"versions": [2, 3]}}
    assert model_config(manifest(model={"backend": "python", "path": "model.py"}))["platform"] == ""
