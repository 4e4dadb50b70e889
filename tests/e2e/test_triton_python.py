"""Triton's Python backend through real processes (gateway, runner, each model's confined process),
called with tritonclient over HTTP and gRPC: an `async def execute`, the BYTES codec of pb_utils,
and two instances of one group, each with its own name and kind."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from fngate.config import GatewaySettings
from gateway.http.metrics_port import MetricsPort
from tests.conftest import free_port, on_cluster_too
from tests.triton_repository import model

WAITER_CONFIG = """
name: "waiter"
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [
  { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "CALLS" data_type: TYPE_INT64 dims: [ 1 ] }
]
dynamic_batching { }
"""

# Awaits in execute, and keeps a task of its own on the loop across batches.
WAITER = """
import asyncio
import queue

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.calls = 0
        self.loop = None

    async def execute(self, requests):
        loop = asyncio.get_running_loop()
        if self.loop is None:
            self.loop = loop
            self.beat = asyncio.ensure_future(asyncio.sleep(3600))
        if loop is not self.loop or self.beat.done():
            raise RuntimeError("a new event loop for this batch")
        self.calls += 1
        await asyncio.sleep(0.05)
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            calls = np.full((len(x), 1), self.calls, dtype=np.int64)
            outputs = [pb_utils.Tensor("Y", x * 2), pb_utils.Tensor("CALLS", calls)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
"""

WIRE_CONFIG = """
name: "wire"
backend: "python"
max_batch_size: 0
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 3 ] } ]
output [
  { name: "BACK" data_type: TYPE_STRING dims: [ 3 ] },
  { name: "WIRE_BYTES" data_type: TYPE_INT64 dims: [ 1 ] }
]
"""

# Through Triton's BYTES wire layout and back, each element reversed.
WIRE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            wire = pb_utils.serialize_byte_tensor(text).item()
            back = pb_utils.deserialize_bytes_tensor(wire)
            back = np.array([item[::-1] for item in back], dtype=np.object_).reshape(text.shape)
            size = np.array([len(wire)], dtype=np.int64)
            outputs = [pb_utils.Tensor("BACK", back), pb_utils.Tensor("WIRE_BYTES", size)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
"""

POOL_CONFIG = """
name: "pool"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "INSTANCE" data_type: TYPE_STRING dims: [ 2 ] } ]
instance_group [ { name: "pair" count: 2 kind: KIND_CPU } ]
"""

# Each batch held long enough for the next to go to the other instance.
POOL = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.who = [args["model_instance_name"].encode(), args["model_instance_kind"].encode()]

    def execute(self, requests):
        time.sleep(0.3)
        out = np.array(self.who, dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("INSTANCE", out)]) for _ in requests]
"""

TEXT = np.array([b"caf\xc3\xa9", b"", b"\x00\xff\x80raw"], dtype=np.object_)
WIRE_BYTES = 3 * 4 + 5 + 0 + 6


def repository(root: Path) -> Path:
    model(root, "waiter", WAITER_CONFIG, {"1": {"model.py": WAITER}})
    model(root, "wire", WIRE_CONFIG, {"1": {"model.py": WIRE}})
    model(root, "pool", POOL_CONFIG, {"1": {"model.py": POOL}})
    return root


def over_http(url: str) -> dict[str, Any]:
    client = triton_http.InferenceServerClient(url.removeprefix("http://"), concurrency=8)
    try:
        x = triton_http.InferInput("X", [2, 1], "FP32")
        x.set_data_from_numpy(np.array([[1.0], [2.5]], dtype=np.float32))
        first = client.infer("waiter", [x])
        second = client.infer("waiter", [x])
        text = triton_http.InferInput("TEXT", [3], "BYTES")
        text.set_data_from_numpy(TEXT)
        wire = client.infer("wire", [text])
        one = triton_http.InferInput("X", [1], "FP32")
        one.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        pending = [client.async_infer("pool", [one]) for _ in range(6)]
        instances = [tuple(call.get_result().as_numpy("INSTANCE").tolist()) for call in pending]
        return {
            "y": first.as_numpy("Y"),
            "calls": (int(first.as_numpy("CALLS")[0, 0]), int(second.as_numpy("CALLS")[0, 0])),
            "back": wire.as_numpy("BACK").tolist(),
            "wire_bytes": int(wire.as_numpy("WIRE_BYTES")[0]),
            "instances": set(instances),
        }
    finally:
        client.close()


def over_grpc(url: str) -> dict[str, Any]:
    client = triton_grpc.InferenceServerClient(url)
    try:
        x = triton_grpc.InferInput("X", [2, 1], "FP32")
        x.set_data_from_numpy(np.array([[1.0], [2.5]], dtype=np.float32))
        first = client.infer("waiter", [x])
        text = triton_grpc.InferInput("TEXT", [3], "BYTES")
        text.set_data_from_numpy(TEXT)
        wire = client.infer("wire", [text])
        one = triton_grpc.InferInput("X", [1], "FP32")
        one.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        answers: queue.Queue[Any] = queue.Queue()
        for _ in range(6):
            client.async_infer("pool", [one], lambda result, error: answers.put(error or result))
        results = [answers.get(timeout=60) for _ in range(6)]
        instances = {tuple(result.as_numpy("INSTANCE").tolist()) for result in results}
        return {
            "y": first.as_numpy("Y"),
            "calls": int(first.as_numpy("CALLS")[0, 0]),
            "back": wire.as_numpy("BACK").tolist(),
            "wire_bytes": int(wire.as_numpy("WIRE_BYTES")[0]),
            "instances": instances,
        }
    finally:
        client.close()


async def test_async_execute_bytes_codec_and_instances_over_http_and_grpc(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path
) -> None:
    root = repository(tmp_path / "models")
    port = free_port()
    base = await serve_gateway(repo=str(root), grpc_port=port)
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    reversed_text = [b"\xa9\xc3fac", b"", b"war\x80\xff\x00"]
    pair = {(b"pair_0", b"CPU"), (b"pair_1", b"CPU")}

    http = await asyncio.to_thread(over_http, base)
    np.testing.assert_array_equal(http["y"], [[2.0], [5.0]])
    first, second = http["calls"]
    assert second == first + 1  # one model object, awaited batch after batch on one loop
    assert http["back"] == reversed_text and http["wire_bytes"] == WIRE_BYTES
    assert http["instances"] == pair  # two processes, one name each

    grpc = await asyncio.to_thread(over_grpc, f"127.0.0.1:{port}")
    np.testing.assert_array_equal(grpc["y"], [[2.0], [5.0]])
    assert grpc["calls"] == second + 1
    assert grpc["back"] == reversed_text and grpc["wire_bytes"] == WIRE_BYTES
    assert grpc["instances"] == pair


COUNTED_CONFIG = """
name: "counted"
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

# Custom metrics as Triton's Python backend makes them: a counter of rows, a gauge of the last
# batch's size, a histogram of values; a request with X = -1 asks for more families than a model may
# make, and fails alone with what pb_utils says.
COUNTED = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"]}
        kind = pb_utils.MetricFamily
        rows = kind(name="counted_rows_total", description="Rows seen", kind=kind.COUNTER)
        self.rows = rows.Metric(labels=labels)
        self.again = kind("counted_rows_total", "another description", kind.COUNTER).Metric(labels=labels)
        self.batch = kind("counted_batch_rows", "Rows of the last batch", kind.GAUGE).Metric(labels=labels)
        values = kind("counted_values", "Values seen", kind.HISTOGRAM)
        self.values = values.Metric(labels=labels, buckets=[1.0, 10.0])

    def execute(self, requests):
        responses = []
        total = 0
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x == -1).any():
                try:
                    for index in range(100):
                        family = pb_utils.MetricFamily
                        family(f"too_many_{index}", "one too many", family.GAUGE)
                except pb_utils.TritonModelException as exc:
                    responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
                    continue
            total += len(x)
            for value in x.ravel():
                self.values.observe(float(value))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        self.rows.increment(total)
        self.batch.set(total)
        assert self.again is self.rows  # one family, one series, under one name
        return responses
"""


def call_each(url: str, name: str, values: list[float]) -> list[str]:
    """Each value in a request of its own, one after another: what each answered."""
    client = triton_http.InferenceServerClient(url.removeprefix("http://"))
    answers = []
    try:
        for value in values:
            x = triton_http.InferInput("X", [1, 1], "FP32")
            x.set_data_from_numpy(np.array([[value]], dtype=np.float32))
            try:
                answers.append(str(client.infer(name, [x]).as_numpy("Y")[0, 0]))
            except InferenceServerException as exc:
                answers.append(exc.message())
    finally:
        client.close()
    return answers


async def test_custom_metrics_reach_the_metrics_port_as_triton_exports_them(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis_url: str, tmp_path: Path
) -> None:
    """pb_utils.MetricFamily's counters, gauges and histograms, made in two instances' processes,
    summed over them on the gateways' metrics port with the model's own help, type and labels; a
    model past the cap on families gets pb_utils's error, and the rest goes on."""
    root = tmp_path / "models"
    model(root, "counted", COUNTED_CONFIG, {"1": {"model.py": COUNTED}})
    base = await serve_gateway(repo=str(root))
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    answers = await asyncio.to_thread(call_each, base, "counted", [0.5, 2.0, 20.0, -1.0, 3.0])
    assert answers[:3] + answers[4:] == ["0.5", "2.0", "20.0", "3.0"], answers
    assert "at most 64 metric families" in answers[3], answers
    port = MetricsPort(GatewaySettings(redis_url=redis_url, repo=str(root)))
    try:
        # A batch's metrics are recorded before its answers leave, as Triton counts them in execute:
        # the first scrape after the last answer holds them all (Triton's custom_metrics client
        # scrapes once, at once).
        scraped = (await port.scrape()).decode()
    finally:
        await port.aclose()
    labels = 'model="counted",version="1"'
    for line in (
        "# HELP counted_rows_total Rows seen",
        "# TYPE counted_rows_total counter",
        f"counted_rows_total{{{labels}}} 4",
        "# TYPE counted_batch_rows gauge",
        f"counted_batch_rows{{{labels}}} 1",
        "# TYPE counted_values histogram",
        f'counted_values_bucket{{{labels},le="1.0"}} 1',
        f'counted_values_bucket{{{labels},le="10.0"}} 3',
        f'counted_values_bucket{{{labels},le="+Inf"}} 4',
        f"counted_values_sum{{{labels}}} 25.5",
        f"counted_values_count{{{labels}}} 4",
    ):
        assert line in scraped, (line, [text for text in scraped.splitlines() if "counted" in text])


LIAR_CONFIG = """
name: "liar"
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""

# A model that goes around pb_utils and reports what it likes: malformed families, then 5,000 series.
LIAR = """
import triton_python_backend_utils as pb_utils

REPORTS = [
    [{"f": "lies", "k": "histogram", "b": "not buckets", "c": 7}],
    [{"f": "nv_inference_count", "k": "counter", "a": 1e9}],
    [{"f": "lies", "k": "counter", "l": {"n": str(index)}, "a": 1.0} for index in range(5000)],
]


class TritonPythonModel:
    def initialize(self, args):
        self.sent = 0

        def report():
            self.sent += 1
            return REPORTS[(self.sent - 1) % len(REPORTS)]

        pb_utils.take_metrics = report

    def execute(self, requests):
        x = [pb_utils.get_input_tensor_by_name(request, "X").as_numpy() for request in requests]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", each)]) for each in x]
"""


async def test_a_model_that_reports_metrics_around_pb_utils_gets_none_exported(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis_url: str, tmp_path: Path
) -> None:
    """The runner checks what a model's process reports (it is the model's code): malformed reports,
    fngate's own names and a flood of series are dropped, and the model answers all the same."""
    root = tmp_path / "models"
    model(root, "liar", LIAR_CONFIG, {"1": {"model.py": LIAR}})
    base = await serve_gateway(repo=str(root))
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    answers = await asyncio.to_thread(call_each, base, "liar", [1.0, 2.0, 3.0, 4.0])
    assert answers == ["1.0", "2.0", "3.0", "4.0"], answers
    port = MetricsPort(GatewaySettings(redis_url=redis_url, repo=str(root)))
    try:
        scraped = (await port.scrape()).decode()
    finally:
        await port.aclose()
    assert "lies" not in scraped
    assert 'nv_inference_count{model="liar",version="1"} 4' in scraped


ADD_SUB_CONFIG = """
name: "add_sub"
backend: "python"
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
"""

ADD_SUB = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            outputs = [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
"""

CALLER_CONFIG = """
name: "%s"
backend: "python"
input [
  { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
"""

# Business logic scripting as Triton's examples do it: the model to call comes with the request;
# an error response of the callee fails the caller's request with its message.
BLS_SYNC = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            callee = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0]
            inputs = [pb_utils.get_input_tensor_by_name(request, name) for name in ("INPUT0", "INPUT1")]
            call = pb_utils.InferenceRequest(
                model_name=callee, requested_output_names=["OUTPUT0", "OUTPUT1"], inputs=inputs
            )
            answer = call.exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            responses.append(pb_utils.InferenceResponse(output_tensors=answer.output_tensors()))
        return responses
"""

# Two calls at once from an async execute: OUTPUT0 is the sum of both calls' sums.
BLS_ASYNC = """
import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            callee = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0]
            inputs = [pb_utils.get_input_tensor_by_name(request, name) for name in ("INPUT0", "INPUT1")]
            calls = [
                pb_utils.InferenceRequest(
                    model_name=callee, requested_output_names=["OUTPUT0", "OUTPUT1"], inputs=inputs
                ).async_exec()
                for _ in range(2)
            ]
            first, second = await asyncio.gather(*calls)
            for answer in (first, second):
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
            total = pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy() * 2
            difference = pb_utils.get_output_tensor_by_name(second, "OUTPUT1").as_numpy()
            outputs = [pb_utils.Tensor("OUTPUT0", total), pb_utils.Tensor("OUTPUT1", difference)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
"""


def call_bls(url: str, grpc_url: str) -> dict[str, Any]:
    """Each caller with each callee, over HTTP and gRPC: the outputs, or the error's message."""
    a = np.arange(4, dtype=np.float32)
    b = np.ones(4, dtype=np.float32)
    found: dict[str, Any] = {}
    http = triton_http.InferenceServerClient(url.removeprefix("http://"))
    rpc = triton_grpc.InferenceServerClient(grpc_url)
    try:
        for caller, callee in (
            ("bls_sync", "add_sub"),
            ("bls_async", "add_sub"),
            ("bls_sync", "nope"),
            ("bls_sync", "bls_sync"),
        ):
            for protocol, module, client in (("http", triton_http, http), ("grpc", triton_grpc, rpc)):
                inputs = [
                    module.InferInput("MODEL_NAME", [1], "BYTES"),
                    module.InferInput("INPUT0", [4], "FP32"),
                    module.InferInput("INPUT1", [4], "FP32"),
                ]
                inputs[0].set_data_from_numpy(np.array([callee.encode()], dtype=object))
                inputs[1].set_data_from_numpy(a)
                inputs[2].set_data_from_numpy(b)
                try:
                    answer = client.infer(caller, inputs)
                except InferenceServerException as exc:
                    found[f"{caller} {callee} {protocol}"] = exc.message()
                    continue
                found[f"{caller} {callee} {protocol}"] = [
                    answer.as_numpy("OUTPUT0").tolist(),
                    answer.as_numpy("OUTPUT1").tolist(),
                ]
    finally:
        http.close()
        rpc.close()
    return found


@on_cluster_too
async def test_business_logic_scripting_calls_other_models_through_the_queue(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path
) -> None:
    """A model calls another (exec(), and two at once with async_exec() from an async execute),
    queued and batched as any invocation; the callee's answer or its error comes back, and a model
    that calls itself is refused at once."""
    root = tmp_path / "models"
    model(root, "add_sub", ADD_SUB_CONFIG, {"1": {"model.py": ADD_SUB}})
    model(root, "bls_sync", CALLER_CONFIG % "bls_sync", {"1": {"model.py": BLS_SYNC}})
    model(root, "bls_async", CALLER_CONFIG % "bls_async", {"1": {"model.py": BLS_ASYNC}})
    port = free_port()
    base = await serve_gateway(repo=str(root), grpc_port=port)
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    found = await asyncio.to_thread(call_bls, base, f"127.0.0.1:{port}")
    for protocol in ("http", "grpc"):
        assert found[f"bls_sync add_sub {protocol}"] == [[1.0, 2.0, 3.0, 4.0], [-1.0, 0.0, 1.0, 2.0]], found
        assert found[f"bls_async add_sub {protocol}"] == [[2.0, 4.0, 6.0, 8.0], [-1.0, 0.0, 1.0, 2.0]], found
        assert "Request for unknown model: 'nope' is not found" in found[f"bls_sync nope {protocol}"], found
        assert "calls itself" in found[f"bls_sync bls_sync {protocol}"], found
