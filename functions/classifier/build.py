"""Builds model.onnx for this example: a fixed-weight MLP, 16 features -> 32 hidden (ReLU) -> 4 class
probabilities. Deterministic (seeded), no downloads: `python functions/classifier/build.py`."""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(path: Path) -> None:
    rng = np.random.default_rng(20261130)
    w1 = rng.standard_normal((16, 32), dtype=np.float32) / 4
    b1 = rng.standard_normal(32, dtype=np.float32) / 10
    w2 = rng.standard_normal((32, 4), dtype=np.float32) / 4
    b2 = rng.standard_normal(4, dtype=np.float32) / 10
    nodes = [
        helper.make_node("Gemm", ["input", "w1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["hr"]),
        helper.make_node("Gemm", ["hr", "w2", "b2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="fngate")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


if __name__ == "__main__":
    build(Path(__file__).with_name("model.onnx"))
