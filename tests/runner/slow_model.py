"""An in-process function whose batches take as long as its input says: a stand-in for an ONNX or
TensorRT model that hangs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

from bench.models import loop_body


def build_slow_model(folder: Path, execution_timeout_ms: int = 200) -> None:
    """A function `slow` in `folder`: an ONNX model that loops max(x) times inside onnxruntime (in
    the runner's process, where nothing can stop it) and answers y = x."""
    body = loop_body()
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
        helper.make_node("Cast", ["top"], ["count"], to=TensorProto.INT64),
        helper.make_node("Loop", ["count", "go", "zero"], ["acc"], body=body),
        helper.make_node("Mul", ["acc", "zero"], ["nothing"]),
        helper.make_node("Add", ["x", "nothing"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [
            numpy_helper.from_array(np.array(True), "go"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
        ],
    )
    folder.mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "model.onnx")
    manifest = {
        "name": "slow",
        "model": {
            "backend": "onnxruntime",
            "path": "model.onnx",
            "execution_timeout_ms": execution_timeout_ms,
        },
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
    }
    (folder / "function.yaml").write_text(yaml.safe_dump(manifest))
