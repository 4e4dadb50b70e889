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


PEER_DELAYS_US = (0, 2000)
"""The dynamic batcher's max_queue_delay_us at which fngate and Triton are compared: each point runs
with the same delay on both sides, and each server's better delay is reported beside it."""
PEER_MAX_BATCH = 32
"""max_batch_size of the models on both sides of a comparison (Triton's peer repository's)."""


def peer_function(model: str, delay_us: int) -> str:
    """fngate's function for `model` (tiny, wide) with the batching Triton is given at `delay_us`."""
    return f"{model}-d{delay_us}"


def build_repository(repo: Path) -> None:
    """tiny and wide with batching (max 64 rows, no fixed wait), tiny-cached (response cache on),
    wide-nobatch (one row a batch), and for the comparisons with Triton each of tiny and wide at
    Triton's settings: max 32 rows, waiting at most each of PEER_DELAYS_US (peer_function)."""
    tiny_model, wide_model = tiny(), wide()
    write_function(repo, "tiny", tiny_model, 16, max_batch_size=64, max_queue_delay_us=0)
    write_function(repo, "tiny-cached", tiny_model, 16, cache=True, max_batch_size=64, max_queue_delay_us=0)
    write_function(repo, "wide", wide_model, 512, max_batch_size=64, max_queue_delay_us=0)
    write_function(repo, "wide-nobatch", wide_model, 512, max_batch_size=1, max_queue_delay_us=0)
    for delay_us in PEER_DELAYS_US:
        for name, model, features in (("tiny", tiny_model, 16), ("wide", wide_model, 512)):
            write_function(
                repo,
                peer_function(name, delay_us),
                model,
                features,
                max_batch_size=PEER_MAX_BATCH,
                max_queue_delay_us=delay_us,
            )


POISON_ROWS = 16
"""The batch of the poison functions: one poison invocation among fifteen innocent ones."""
BUSY_TURNS = 500_000
"""x[0, 1] of an invocation of `pick` that keeps it busy for about a second (2 us a turn)."""
POISON_MODEL = '''"""y = 2x, and each batch prints its size ("batch of N"). x[:, 0] steers it: -3 ends its
process, -4 never returns, -5 allocates 1 GiB, -6 sleeps a second (keeps the function busy)."""

import os
import time

import numpy as np


class Model:
    def __init__(self, directory):
        pass

    def infer(self, inputs):
        x = inputs["x"]
        print(f"batch of {len(x)}")
        first = x[:, 0]
        if (first == -3).any():
            os._exit(3)
        if (first == -4).any():
            while True:
                time.sleep(1)
        if (first == -5).any():
            np.ones(2**27).sum()
        if (first == -6).any():
            time.sleep(1)
        return {"y": x * 2}
'''


def loop_body() -> onnx.GraphProto:
    """The body of a Loop that counts its turns (a float accumulator): a model that takes as long
    as its input says."""
    return helper.make_graph(
        [
            helper.make_node("Add", ["acc_in", "a_turn"], ["acc_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "turn",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, []),
        ],
        [numpy_helper.from_array(np.array(1, np.float32), "a_turn")],
    )


def pick() -> onnx.ModelProto:
    """x FP32 [-1, 4] -> y = 2x, through a Gather of a 16-row table at x[:, 0]: onnxruntime fails
    the batch of any row whose x[0] is not in 0..15 (a function whose model fails on a value); and a
    loop of max(x[:, 1]) turns, so that a row can keep it busy (BUSY_TURNS: a second or so)."""
    body = loop_body()
    nodes = [
        helper.make_node("Gather", ["x", "zero"], ["first"], axis=1),
        helper.make_node("Cast", ["first"], ["index"], to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "index"], ["picked"], axis=0),
        helper.make_node("Unsqueeze", ["picked", "one"], ["column"]),
        helper.make_node("Gather", ["x", "one_index"], ["second"], axis=1),
        helper.make_node("ReduceMax", ["second"], ["most"], keepdims=0),
        helper.make_node("Cast", ["most"], ["turns"], to=TensorProto.INT64),
        helper.make_node("Loop", ["turns", "go", "nothing"], ["counted"], body=body),
        helper.make_node("Add", ["column", "counted"], ["noise"]),
        helper.make_node("Mul", ["noise", "nothing"], ["zeros"]),
        helper.make_node("Mul", ["x", "two"], ["doubled"]),
        helper.make_node("Add", ["doubled", "zeros"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "pick",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [
            numpy_helper.from_array(np.array(0, dtype=np.int64), "zero"),
            numpy_helper.from_array(np.array(1, dtype=np.int64), "one_index"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "one"),
            numpy_helper.from_array(np.arange(16, dtype=np.float32), "table"),
            numpy_helper.from_array(np.array(0.0, dtype=np.float32), "nothing"),
            numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"),
            numpy_helper.from_array(np.array(True), "go"),
        ],
    )
    return _model(graph)


def write_poison_functions(repo: Path, execution_timeout_ms: int = 500) -> None:
    """`poison` (python, POISON_MODEL, memory_limit_mb 200) and `pick` (onnxruntime, pick()), each
    batching POISON_ROWS invocations (and waiting a second at most to fill a batch)."""
    batching = {
        "max_batch_size": POISON_ROWS,
        "max_queue_delay_us": 1_000_000,
        "timeout_ms": 60_000,
        "max_queue_size": 1000,
    }
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
        "batching": batching,
    }
    python = {"backend": "python", "path": "model.py", "execution_timeout_ms": execution_timeout_ms}
    functions = {
        "poison": ({**python, "memory_limit_mb": 200}, "model.py"),
        "pick": ({"backend": "onnxruntime", "path": "model.onnx"}, "model.onnx"),
    }
    for name, (model, path) in functions.items():
        folder = repo / name
        folder.mkdir(parents=True, exist_ok=True)
        if path == "model.py":
            (folder / path).write_text(POISON_MODEL)
        else:
            onnx.save(pick(), str(folder / path))
        manifest = {"name": name, "model": model, **signature}
        (folder / "function.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
