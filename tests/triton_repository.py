"""Triton model repositories as the Triton guide lays them out, built by the tests: a text classifier
(ONNX, two INT64 inputs, dynamic batching with preferred sizes and a queue policy, three versions of
which the policy serves the latest two), the same model without a config.pbtxt (auto-complete), an
image detector's TensorRT plan configuration with engine-cache parameters, an ensemble of a Python
tokenizer, the classifier and a Python postprocessor, and Python models for the queue's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CLASSIFIER = """
name: "text_classifier"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { latest: { num_versions: 2 } }
input [
  { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] }
]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 2 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 2, 4 ]
  max_queue_delay_microseconds: 500
  default_queue_policy {
    timeout_action: REJECT
    default_timeout_microseconds: 2000000
    allow_timeout_override: true
    max_queue_size: 64
  }
}
model_warmup [ { name: "zeros" batch_size: 1 inputs { key: "input_ids" value: {
  data_type: TYPE_INT64 dims: [ 4 ] zero_data: true } } } ]
"""

DETECTOR = """
name: "image_detector"
platform: "tensorrt_plan"
max_batch_size: 16
input [ { name: "images" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 640, 640 ] } ]
output [
  { name: "boxes" data_type: TYPE_FP32 dims: [ 100, 4 ] },
  { name: "scores" data_type: TYPE_FP32 dims: [ 100 ] }
]
instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]
dynamic_batching { preferred_batch_size: [ 8, 16 ] max_queue_delay_microseconds: 1000 }
optimization { execution_accelerators { gpu_execution_accelerator [ {
  name: "tensorrt"
  parameters { key: "precision_mode" value: "FP16" }
  parameters { key: "max_workspace_size_bytes" value: "1073741824" }
} ] } }
parameters { key: "TRT_ENGINE_CACHE_ENABLE" value: { string_value: "1" } }
parameters { key: "TRT_ENGINE_CACHE_PATH" value: { string_value: "/tmp/engines" } }
"""

TOKENIZER_CONFIG = """
name: "tokenizer"
backend: "python"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [
  { name: "input_ids" data_type: TYPE_INT64 dims: [ 4 ] },
  { name: "attention_mask" data_type: TYPE_INT64 dims: [ 4 ] }
]
dynamic_batching { }
"""

# Word lengths as token ids, four at most: enough to show the tensors flowing.
TOKENIZER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import json
        self.width = json.loads(args["model_config"])["output"][0]["dims"][0]

    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            ids = np.zeros((len(texts), self.width), dtype=np.int64)
            for row, (text,) in enumerate(texts):
                words = text.decode().split()[: self.width]
                ids[row, : len(words)] = [len(word) for word in words]
            mask = (ids > 0).astype(np.int64)
            outputs = [pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("attention_mask", mask)]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
"""

POSTPROCESSOR_CONFIG = """
name: "postprocessor"
backend: "python"
max_batch_size: 8
input [ { name: "logits" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "LABEL" data_type: TYPE_STRING dims: [ 1 ] } ]
dynamic_batching { }
"""

POSTPROCESSOR = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "logits").as_numpy()
            if (logits == 0).all():
                error = pb_utils.TritonError("no words to classify", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            labels = np.array([[b"long" if row[0] > 40 else b"short"] for row in logits], dtype=object)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("LABEL", labels)]))
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("postprocessor finalized")
"""

ENSEMBLE = """
name: "classify_text"
platform: "ensemble"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "LABEL" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "tokenizer" model_version: -1
    input_map { key: "TEXT" value: "TEXT" }
    output_map { key: "input_ids" value: "ids" }
    output_map { key: "attention_mask" value: "mask" } },
  { model_name: "text_classifier" model_version: -1
    input_map { key: "input_ids" value: "ids" }
    input_map { key: "attention_mask" value: "mask" }
    output_map { key: "logits" value: "scores" } },
  { model_name: "postprocessor" model_version: -1
    input_map { key: "logits" value: "scores" }
    output_map { key: "LABEL" value: "LABEL" } }
] }
"""

# Each batch answers its number and its size: which batch served a request, and that they batch.
BATCHES_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "BATCH" data_type: TYPE_INT64 dims: [ 2 ] }} ]
dynamic_batching {{ {batching} }}
parameters {{ key: "SLEEP_S" value: {{ string_value: "{sleep_s}" }} }}
"""

BATCHES = """
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.sleep_s = float(config["parameters"]["SLEEP_S"]["string_value"])
        self.batches = 0

    def execute(self, requests):
        self.batches += 1
        time.sleep(self.sleep_s)
        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "X").as_numpy().shape[0]
            batch = np.array([[self.batches, len(requests)]] * rows, dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("BATCH", batch)]))
        return responses
"""


def save_graph(graph: Any, path: Path) -> None:
    """An ONNX graph saved as a model onnxruntime loads (opset 17, IR version 8) at `path`."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def classifier_onnx(path: Path, factor: float) -> None:
    """logits = [s, -s] * factor, s the sum of input_ids where attention_mask is 1."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["input_ids", "attention_mask"], ["masked"]),
            helper.make_node("Cast", ["masked"], ["floats"], to=TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["floats", "axes"], ["total"], keepdims=1),
            helper.make_node("Mul", ["total", "factor"], ["scaled"]),
            helper.make_node("Neg", ["scaled"], ["negated"]),
            helper.make_node("Concat", ["scaled", "negated"], ["logits"], axis=1),
        ],
        "text_classifier",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
        [
            helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
            helper.make_tensor("factor", TensorProto.FLOAT, [], [factor]),
        ],
    )
    save_graph(graph, path)


SIMPLE_STRING = """
name: "simple_string"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
"""
"""The quickstart's string model: numbers written as text in, their sum and difference as text out."""


def simple_string_onnx(path: Path) -> None:
    """OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1, each element a decimal integer as a
    string: ONNX's Cast from and back to strings, as the quickstart's simple_string does."""
    import onnx
    from onnx import TensorProto, helper

    def strings(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.STRING, ["batch", 16])

    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["INPUT0"], ["left"], to=TensorProto.INT32),
            helper.make_node("Cast", ["INPUT1"], ["right"], to=TensorProto.INT32),
            helper.make_node("Add", ["left", "right"], ["sum"]),
            helper.make_node("Sub", ["left", "right"], ["difference"]),
            helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
            helper.make_node("Cast", ["difference"], ["OUTPUT1"], to=TensorProto.STRING),
        ],
        "simple_string",
        [strings("INPUT0"), strings("INPUT1")],
        [strings("OUTPUT0"), strings("OUTPUT1")],
    )
    save_graph(graph, path)


SIMPLE = """
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
"""
"""The quickstart's `simple`: the sum and the difference of two vectors of 16 int32."""


def simple_onnx(path: Path) -> None:
    """OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1, int32."""
    import onnx
    from onnx import TensorProto, helper

    def ints(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 16])

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "simple",
        [ints("INPUT0"), ints("INPUT1")],
        [ints("OUTPUT0"), ints("OUTPUT1")],
    )
    save_graph(graph, path)


IDENTITY = """
name: "identity"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
"""A vector of any length in, the same out."""


def identity_onnx(path: Path) -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["n"])],
    )
    save_graph(graph, path)


def model(root: Path, name: str, config: str | None, versions: dict[str, dict[str, str | None]]) -> Path:
    """root/name/config.pbtxt and root/name/{version}/{file} (None: a factor for the classifier)."""
    folder = root / name
    folder.mkdir(parents=True)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    for version, files in versions.items():
        (folder / version).mkdir()
        for file, text in files.items():
            if text is None:
                classifier_onnx(folder / version / file, float(version))
            else:
                (folder / version / file).write_text(text)
    return folder


def guide_repository(root: Path) -> Path:
    """The guide's models: classifier (versions 1 to 3), the same without configuration, the plan
    configuration, and the ensemble with its two Python steps."""
    model(root, "text_classifier", CLASSIFIER, {version: {"model.onnx": None} for version in ("1", "2", "3")})
    model(root, "autocompleted", None, {"1": {"model.onnx": None}})
    model(root, "image_detector", DETECTOR, {"1": {"model.plan": "not an engine: checked without a GPU"}})
    model(root, "tokenizer", TOKENIZER_CONFIG, {"1": {"model.py": TOKENIZER}})
    model(root, "postprocessor", POSTPROCESSOR_CONFIG, {"1": {"model.py": POSTPROCESSOR}})
    model(root, "classify_text", ENSEMBLE, {"1": {}})
    return root


def batches_model(root: Path, name: str, batching: str, sleep_s: float) -> Path:
    config = BATCHES_CONFIG.format(name=name, batching=batching, sleep_s=sleep_s)
    return model(root, name, config, {"1": {"model.py": BATCHES}})


SIMPLE_SEQUENCE = """
name: "simple_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""
"""The quickstart's sequence model's configuration, as Triton's repository has it."""

SEQUENCE_CONTROLS = """
name: "sequence_controls"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 1500000
  oldest { max_queue_delay_microseconds: 100000 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 5, 7 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "START_OUT" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "END_OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "READY_OUT" data_type: TYPE_BOOL dims: [ 1 ] },
  { name: "CORRID_OUT" data_type: TYPE_UINT64 dims: [ 1 ] },
  { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }
]
"""
"""A model that answers each control input as it was fed (every kind, of several datatypes), with
an idle timeout of 1.5 s, whose batches wait up to 100 ms to fill."""

RUNNING_TOTAL_CONFIG = """
name: "running_total"
backend: "python"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 1000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
input [
  { name: "VALUE" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "DELAY_MS" data_type: TYPE_INT32 dims: [ 1 ] }
]
output [ { name: "TOTAL" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
"""A Python model that keeps each sequence's running total in its process (by CORRID, from START),
and sleeps DELAY_MS first; its sequences idle out after 1 s."""

RUNNING_TOTAL = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.totals = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            def get(name):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            time.sleep(int(get("DELAY_MS").max()) / 1000)
            corrid = int(get("CORRID")[0][0])
            if int(get("START")[0][0]):
                self.totals[corrid] = 0
            self.totals[corrid] += int(get("VALUE").sum())
            total = np.array([[self.totals[corrid]]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("TOTAL", total)]))
        return responses
"""

ACCUMULATOR = """
name: "accumulator"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  oldest { max_queue_delay_microseconds: 100000 }
  state [ {
    input_name: "TOTAL_IN" output_name: "TOTAL_OUT" data_type: TYPE_INT64 dims: [ 2 ]
    initial_state [ { data_type: TYPE_INT64 dims: [ 2 ] zero_data: true name: "zeros" } ]
  } ]
}
input [ { name: "INPUT" data_type: TYPE_INT64 dims: [ 2 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT64 dims: [ 2 ] } ]
"""
"""A model with implicit state: its total so far (TOTAL_IN, zeros at a sequence's start) plus
INPUT is both its OUTPUT and its next state; batches wait up to 100 ms to fill. Its sequences idle
out after 60 s: a test's sequence outlives a runner's restart."""


def accumulator_onnx(path: Path) -> None:
    """ACCUMULATOR's graph: OUTPUT = TOTAL_OUT = TOTAL_IN + INPUT."""
    import onnx
    from onnx import TensorProto, helper

    def tensor(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", 2])

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["TOTAL_IN", "INPUT"], ["OUTPUT"]),
            helper.make_node("Identity", ["OUTPUT"], ["TOTAL_OUT"]),
        ],
        "accumulator",
        [tensor("INPUT"), tensor("TOTAL_IN")],
        [tensor("OUTPUT"), tensor("TOTAL_OUT")],
    )
    save_graph(graph, path)


def sequence_onnx(path: Path, echo_controls: bool = False) -> None:
    """The quickstart's simple_sequence graph: OUTPUT = READY * (INPUT + START) (so a sequence's
    first answer is its input plus one, the others their input); with `echo_controls`, each control
    input (START FP32, END INT32, READY BOOL, CORRID UINT64) also comes back as its *_OUT, and
    OUTPUT is INPUT."""
    import onnx
    from onnx import TensorProto, helper

    def tensor(name: str, kind: int) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, kind, ["batch", 1])

    if echo_controls:
        kinds = {"START": TensorProto.FLOAT, "END": TensorProto.INT32, "READY": TensorProto.BOOL,
                 "CORRID": TensorProto.UINT64}  # fmt: skip
        nodes = [helper.make_node("Identity", [name], [f"{name}_OUT"]) for name in kinds]
        nodes.append(helper.make_node("Identity", ["INPUT"], ["OUTPUT"]))
        inputs = [tensor("INPUT", TensorProto.INT32), *(tensor(name, kind) for name, kind in kinds.items())]
        outputs = [
            *(tensor(f"{name}_OUT", kind) for name, kind in kinds.items()),
            tensor("OUTPUT", TensorProto.INT32),
        ]
    else:
        nodes = [
            helper.make_node("Add", ["INPUT", "START"], ["sum"]),
            helper.make_node("Mul", ["READY", "sum"], ["OUTPUT"]),
        ]
        inputs = [tensor(name, TensorProto.INT32) for name in ("INPUT", "START", "READY")]
        outputs = [tensor("OUTPUT", TensorProto.INT32)]
    graph = helper.make_graph(nodes, "sequence", inputs, outputs)
    save_graph(graph, path)
