"""The benchmark's models, built deterministically (seeded weights, no downloads), and the function
folders that serve them."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

WIDE_LAYERS = (512, 2048, 2048, 512)


def tiny() -> onnx.ModelProto:
    """input FP32 [-1, 16] times 2: no compute to speak of, so it measures pure overhead."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["input", "two"], ["output"])],
        "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 16])],
        [numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")],
    )
    return _model(graph)


def wide() -> onnx.ModelProto:
    """An MLP 512 -> 2048 -> 2048 -> 512 (ReLU between) with fixed random weights: batch 1 is
    memory-bound, so batching pays several times over."""
    rng = np.random.default_rng(512)
    nodes = []
    initializers = []
    current = "input"
    layers = list(itertools.pairwise(WIDE_LAYERS))
    for index, (fan_in, fan_out) in enumerate(layers):
        weight = (rng.standard_normal((fan_in, fan_out), dtype=np.float32) / np.sqrt(fan_in)).astype(
            np.float32
        )
        initializers += [
            numpy_helper.from_array(weight, f"w{index}"),
            numpy_helper.from_array(np.zeros(fan_out, dtype=np.float32), f"b{index}"),
        ]
        last = index == len(layers) - 1
        gemm = "output" if last else f"g{index}"
        nodes.append(helper.make_node("Gemm", [current, f"w{index}", f"b{index}"], [gemm]))
        if not last:
            nodes.append(helper.make_node("Relu", [gemm], [f"h{index}"]))
            current = f"h{index}"
    graph = helper.make_graph(
        nodes,
        "wide",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", WIDE_LAYERS[0]])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", WIDE_LAYERS[-1]])],
        initializers,
    )
    return _model(graph)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="fngate-bench"
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write_function(
    repo: Path, name: str, model: onnx.ModelProto, features: int, cache: bool = False, **batching: Any
) -> Path:
    folder = repo / name
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "model.onnx"))
    manifest = {
        "name": name,
        "model": {"backend": "onnxruntime", "path": "model.onnx"},
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, features]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, features]}],
        "batching": {"max_queue_size": 10000, "timeout_ms": 30000, **batching},
        "cache": {"enabled": cache, "ttl_s": 600},
        "scaling": {"idle_unload_s": 2},
    }
    (folder / "function.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return folder


def build_repository(repo: Path) -> None:
    """tiny and wide with batching (max 64 rows, no fixed wait), tiny-cached (response cache on),
    and wide-nobatch (one row a batch)."""
    write_function(repo, "tiny", tiny(), 16, max_batch_size=64, max_queue_delay_us=0)
    write_function(repo, "tiny-cached", tiny(), 16, cache=True, max_batch_size=64, max_queue_delay_us=0)
    wide_model = wide()
    write_function(repo, "wide", wide_model, 512, max_batch_size=64, max_queue_delay_us=0)
    write_function(repo, "wide-nobatch", wide_model, 512, max_batch_size=1, max_queue_delay_us=0)
