"""Builds the large model of scenario S4 (--large-model): four 4096x4096 FP32 MatMuls with ReLU
between them, 268 MB, seeded, no downloads: `python -m bench.large_model PATH`."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WIDTH = 4096
LAYERS = 4


def build(path: Path) -> None:
    rng = np.random.default_rng(20261130)
    nodes, weights = [], []
    current = "input"
    for layer in range(LAYERS):
        weight = rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) / np.float32(WIDTH**0.5)
        weights.append(numpy_helper.from_array(weight, f"w{layer}"))
        product = f"m{layer}" if layer < LAYERS - 1 else "output"
        nodes.append(helper.make_node("MatMul", [current, f"w{layer}"], [product]))
        if layer < LAYERS - 1:
            nodes.append(helper.make_node("Relu", [product], [f"r{layer}"]))
            current = f"r{layer}"
    graph = helper.make_graph(
        nodes,
        "large",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", WIDTH])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="fngate")
    model.ir_version = 8
    onnx.save(model, str(path))


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("large.onnx"))
