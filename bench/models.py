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


CONV_INPUT = (3, 32, 32)
CONV_CLASSES = 10


def conv() -> onnx.ModelProto:
    """Two 3x3 convolutions (16 channels, ReLU) over images [-1, 3, 32, 32], pooled, then a
    layer to 10 scores: what makes onnxruntime's CUDA provider use cuDNN."""
    rng = np.random.default_rng(32)
    channels = CONV_INPUT[0]

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        array = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        return numpy_helper.from_array(array, name)

    initializers = [
        weight("k0", 16, channels, 3, 3),
        numpy_helper.from_array(np.zeros(16, dtype=np.float32), "c0"),
        weight("k1", 16, 16, 3, 3),
        numpy_helper.from_array(np.zeros(16, dtype=np.float32), "c1"),
        weight("fc", 16, CONV_CLASSES),
        numpy_helper.from_array(np.zeros(CONV_CLASSES, dtype=np.float32), "fb"),
    ]
    pads = [1, 1, 1, 1]
    nodes = [
        helper.make_node("Conv", ["input", "k0", "c0"], ["v0"], kernel_shape=[3, 3], pads=pads),
        helper.make_node("Relu", ["v0"], ["r0"]),
        helper.make_node("Conv", ["r0", "k1", "c1"], ["v1"], kernel_shape=[3, 3], pads=pads),
        helper.make_node("Relu", ["v1"], ["r1"]),
        helper.make_node("GlobalAveragePool", ["r1"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc", "fb"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", *CONV_INPUT])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", CONV_CLASSES])],
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
    repo: Path,
    name: str,
    model: onnx.ModelProto,
    features: int,
    cache: bool = False,
    shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    **batching: Any,
) -> Path:
    """The model's function folder: one FP32 `input` and `output` of `features` columns each, or
    of `shapes` (input's, output's, after the batch dimension)."""
    folder = repo / name
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "model.onnx"))
    takes, gives = shapes or ((features,), (features,))
    manifest = {
        "name": name,
        "model": {"backend": "onnxruntime", "path": "model.onnx"},
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, *takes]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, *gives]}],
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
