"""Decoupled Triton Python models through real processes (gateway, runner, the model's confined
process), called as python_backend's decoupled example calls them: tritonclient's gRPC stream, many
requests in flight, any number of responses each (none too), sent by threads the model leaves
running after `execute` returns."""

from __future__ import annotations

import asyncio
import gzip
import json
import queue
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from tests.conftest import free_port, on_cluster_too
from tests.triton_repository import model

SQUARE_CONFIG = """
name: "square_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: True }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""

# As python_backend's examples/decoupled/square_model.py behaves: IN = n gets n responses, each
# OUT = n, sent 40 ms apart by a thread of its own, after `execute` returned; IN = -1 gets one
# response, then an error response, then the final flag.
SQUARE = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import json

        if not pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
            raise pb_utils.TritonModelException("square_int32 is a decoupled model")

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.answer, args=(request,), daemon=True).start()
        return None

    def answer(self, request):
        n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
        sender = request.get_response_sender()
        if n < 0:
            out = pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse([out]))
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("the input is negative")))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        for _ in range(n):
            time.sleep(0.04)
            out = pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse([out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        try:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except pb_utils.TritonModelException:
            pass  # closed, as Triton's sender is
        else:
            raise AssertionError("a response sender sent past its final flag")
"""


async def sse(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[tuple[float, Any]]:
    """The server-sent events of a generate_stream call, each with when it came."""
    found = []
    started = time.monotonic()
    async with client.stream("POST", path, json=body) as answer:
        assert answer.status_code == 200, await answer.aread()
        assert answer.headers["content-type"].startswith("text/event-stream")
        async for line in answer.aiter_lines():
            if line.startswith("data: "):
                found.append((time.monotonic() - started, json.loads(line.removeprefix("data: "))))
    return found


DOUBLE_CONFIG = """
name: "double"
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""

DOUBLE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        doubled = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2 for r in requests]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]) for y in doubled]
"""


def stream(grpc_url: str, values: list[int], empty_final: bool = False) -> list[tuple[float, Any]]:
    """What the stream gave for these requests (ids "0", "1", ...), each with when it came
    (seconds after the first request was sent), until each request had its responses."""
    got: queue.Queue[tuple[float, Any]] = queue.Queue()
    with triton_grpc.InferenceServerClient(grpc_url) as client:
        started = time.monotonic()

        def callback(result: Any, error: Any) -> None:
            got.put((time.monotonic() - started, error or result))

        client.start_stream(callback=callback)
        for index, value in enumerate(values):
            tensor = triton_grpc.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
            client.async_stream_infer(
                "square_int32",
                [tensor],
                request_id=str(index),
                outputs=[triton_grpc.InferRequestedOutput("OUT")],
                enable_empty_final_response=empty_final,
            )
        expected = sum(max(value, 0) for value in values) + 2 * values.count(-1)
        expected += len(values) if empty_final else 0
        found = [got.get(timeout=60) for _ in range(expected)]
        time.sleep(0.3)  # nothing more comes
        assert got.empty(), [found, got.get()[1].get_response()]
        client.stop_stream()
    return found


@on_cluster_too
async def test_a_decoupled_model_streams_any_number_of_responses_as_they_are_made(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path
) -> None:
    root = tmp_path / "models"
    model(root, "square_int32", SQUARE_CONFIG, {"1": {"model.py": SQUARE}})
    model(root, "double", DOUBLE_CONFIG, {"1": {"model.py": DOUBLE}})
    port = free_port()
    base = await serve_gateway(repo=str(root), grpc_port=port)
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    grpc_url = f"127.0.0.1:{port}"
    await asyncio.to_thread(stream, grpc_url, [1])  # the runner starts and loads the model

    # The example client's requests: 4, 2, 0, 1 responses, all sent before the first came.
    found = await asyncio.to_thread(stream, grpc_url, [4, 2, 0, 1, 12])
    by_id: dict[str, list[tuple[float, int]]] = {}
    for at, result in found:
        assert not isinstance(result, InferenceServerException), result
        by_id.setdefault(result.get_response().id, []).append((at, int(result.as_numpy("OUT")[0])))
    assert {key: [value for _, value in items] for key, items in by_id.items()} == {
        "0": [4] * 4,
        "1": [2] * 2,
        "3": [1],
        "4": [12] * 12,
    }
    # As they are made, not at the end: the long request's first response came well before its last
    # (its twelve are sent 40 ms apart).
    times = [at for at, _ in by_id["4"]]
    assert times[-1] - times[0] >= 0.15, times

    # An error response mid-stream reaches the client as the stream's error for that request.
    failed = await asyncio.to_thread(stream, grpc_url, [-1])
    assert int(failed[0][1].as_numpy("OUT")[0]) == -1
    assert isinstance(failed[1][1], InferenceServerException)
    assert "the input is negative" in str(failed[1][1])

    # With triton_enable_empty_final_response, each response says whether it is the last, as Triton's.
    flagged = await asyncio.to_thread(stream, grpc_url, [2, 0], True)
    finals = [
        (result.get_response().id, result.get_response().parameters["triton_final_response"].bool_param)
        for _, result in flagged
    ]
    assert sorted(finals) == [("0", False), ("0", False), ("0", True), ("1", True)]

    # Over HTTP, as Triton's generate_stream: one server-sent event per response, as they come.
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        events = await sse(client, "/v2/models/square_int32/generate_stream", {"IN": 3})
        assert [event["OUT"] for _, event in events] == [3, 3, 3]
        assert {event["model_name"] for _, event in events} == {"square_int32"}
        assert events[-1][0] - events[0][0] >= 0.03  # 40 ms apart as the model sends them
        failed_events = await sse(client, "/v2/models/square_int32/generate_stream", {"IN": -1})
        assert failed_events[0][1]["OUT"] == -1 and "the input is negative" in failed_events[1][1]["error"]
        assert await sse(client, "/v2/models/square_int32/generate_stream", {"IN": 0}) == []
        once = await sse(client, "/v2/models/double/generate_stream", {"X": [1.5, 2.0]})  # one answer
        assert [event for _, event in once] == [
            {"model_name": "double", "model_version": "1", "Y": [[3.0, 4.0]]}
        ]
        refused = await client.post("/v2/models/square_int32/generate_stream", json={"NOPE": [1, 2]})
        assert refused.status_code == 400 and "NOPE" in refused.text
        # A gzip body is decoded, as on the infer routes; an encoding fngate does not take is a 400.
        packed = gzip.compress(json.dumps({"IN": 2}).encode())
        headers = {"content-encoding": "gzip", "content-type": "application/json"}
        async with client.stream(
            "POST", "/v2/models/square_int32/generate_stream", content=packed, headers=headers
        ) as answer:
            lines = [line async for line in answer.aiter_lines() if line.startswith("data: ")]
        assert [json.loads(line.removeprefix("data: "))["OUT"] for line in lines] == [2, 2]
        brotli = await client.post(
            "/v2/models/square_int32/generate_stream", content=b"x", headers={"content-encoding": "br"}
        )
        assert brotli.status_code == 400 and "Content-Encoding 'br' is not supported" in brotli.text

    # A route that answers once refuses it, and says where to call it.
    tensor = triton_http.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    with (
        triton_http.InferenceServerClient(base.removeprefix("http://")) as http,
        pytest.raises(InferenceServerException, match="ModelStreamInfer"),
    ):
        await asyncio.to_thread(partial(http.infer, "square_int32", [tensor]))
    with triton_grpc.InferenceServerClient(grpc_url) as client:
        unary = triton_grpc.InferInput("IN", [1], "INT32")
        unary.set_data_from_numpy(np.array([1], dtype=np.int32))
        with pytest.raises(InferenceServerException, match="decoupled"):
            await asyncio.to_thread(partial(client.infer, "square_int32", [unary]))


TICKER_CONFIG = """
name: "ticker"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: True }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

# IN = n > 0: up to n responses 20 ms apart, until its caller leaves (is_cancelled()), then the
# final flag; IN = 0: one response, how many requests it saw cancelled so far (its one process keeps
# count: the next batch runs once the cancelled one has ended).
TICKER = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils

CANCELLED = []


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            if n == 0:
                count = np.array([len(CANCELLED)], dtype=np.int32)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", count)]))
            for _ in range(n):
                if request.is_cancelled() or sender.is_cancelled():
                    CANCELLED.append(n)
                    break
                tick = pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))
                sender.send(pb_utils.InferenceResponse([tick]))
                time.sleep(0.02)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def ticks(grpc_url: str, value: int, leave_after: int | None) -> list[int]:
    """The ticker's responses to one request on a stream of its own; with `leave_after`, the
    client cancels the stream once that many came."""
    got: queue.Queue[Any] = queue.Queue()
    with triton_grpc.InferenceServerClient(grpc_url) as client:
        client.start_stream(callback=lambda result, error: got.put(error or result))
        tensor = triton_grpc.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        client.async_stream_infer("ticker", [tensor], enable_empty_final_response=True)
        found: list[int] = []
        while True:
            result = got.get(timeout=60)
            assert not isinstance(result, InferenceServerException), result
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            found.append(int(result.as_numpy("OUT")[0]))
            if leave_after is not None and len(found) == leave_after:
                client.stop_stream(cancel_requests=True)
                return found
        client.stop_stream()
    return found


@on_cluster_too
async def test_a_caller_that_leaves_or_runs_out_of_time_is_cancelled_in_the_model(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path
) -> None:
    """A decoupled model's request whose caller left mid-stream (a cancelled gRPC stream, a closed
    HTTP stream) or whose deadline passed is_cancelled() in the model, which stops; the model's next
    request runs once it has (a 10 s stream would hold its process that long)."""
    root = tmp_path / "models"
    model(root, "ticker", TICKER_CONFIG, {"1": {"model.py": TICKER}})
    port = free_port()
    base = await serve_gateway(repo=str(root), grpc_port=port)
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    grpc_url = f"127.0.0.1:{port}"
    assert await asyncio.to_thread(ticks, grpc_url, 2, None) == [2, 2]  # loaded; runs to its end
    assert await asyncio.to_thread(ticks, grpc_url, 0, None) == [0]

    assert await asyncio.to_thread(ticks, grpc_url, 500, 3) == [500] * 3  # the client cancels its stream
    assert await asyncio.to_thread(ticks, grpc_url, 0, None) == [1]

    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        async with client.stream("POST", "/v2/models/ticker/generate_stream", json={"IN": 500}) as answer:
            lines = answer.aiter_lines()
            events = [line async for line in _first_events(lines, 3)]
        assert [json.loads(event)["OUT"] for event in events] == [500] * 3  # then the client hangs up
        assert await asyncio.to_thread(ticks, grpc_url, 0, None) == [2]

        late = await sse(client, "/v2/models/ticker/generate_stream", {"IN": 500, "timeout_ms": 400})
        assert 1 <= len(late) < 500 and "did not answer within 400 ms" in late[-1][1]["error"], late[-3:]
        assert await asyncio.to_thread(ticks, grpc_url, 0, None) == [3]


async def _first_events(lines: Any, count: int) -> Any:
    async for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")
            count -= 1
            if count == 0:
                return


CALLER_CONFIG = """
name: "%s"
backend: "python"
max_batch_size: 0
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TOTAL" data_type: TYPE_INT32 dims: [ 2 ] } ]
"""

# BLS with a decoupled callee, as python_backend's examples call one: exec(decoupled=True) and
# (from an async execute) await async_exec(decoupled=True) give an iterator of its responses;
# TOTAL is [the sum of their OUT, how many had outputs]. N < 0 calls it without decoupled=True.
BLS_STREAM = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    %(async)sdef execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "N").as_numpy()
            call = pb_utils.InferenceRequest(
                model_name="square_int32",
                inputs=[pb_utils.Tensor("IN", np.abs(n).astype(np.int32))],
                requested_output_names=["OUT"],
            )
            if n[0] < 0:
                answer = call.exec()
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            total = [0, 0]
            for response in %(call)s:
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                if response.output_tensors():
                    total[0] += int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])
                    total[1] += 1
            summed = pb_utils.Tensor("TOTAL", np.array(total, dtype=np.int32))
            responses.append(pb_utils.InferenceResponse([summed]))
        return responses
"""


@on_cluster_too
async def test_business_logic_scripting_streams_from_a_decoupled_model(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path
) -> None:
    """exec(decoupled=True) and async_exec(decoupled=True) iterate over a decoupled callee's
    responses; exec() of a decoupled callee answers an error that says how to call it."""
    root = tmp_path / "models"
    model(root, "square_int32", SQUARE_CONFIG, {"1": {"model.py": SQUARE}})
    sync = BLS_STREAM % {"async": "", "call": "call.exec(decoupled=True)"}
    awaited = BLS_STREAM % {"async": "async ", "call": "await call.async_exec(decoupled=True)"}
    model(root, "bls_stream", CALLER_CONFIG % "bls_stream", {"1": {"model.py": sync}})
    model(root, "bls_stream_async", CALLER_CONFIG % "bls_stream_async", {"1": {"model.py": awaited}})
    base = await serve_gateway(repo=str(root))
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:  # the callee loaded first: its
        # cold start would count against the calling batch's execution timeout
        assert len(await sse(client, "/v2/models/square_int32/generate_stream", {"IN": 1})) == 1

    def total(caller: str, n: int) -> list[int]:
        with triton_http.InferenceServerClient(base.removeprefix("http://")) as http:
            tensor = triton_http.InferInput("N", [1], "INT32")
            tensor.set_data_from_numpy(np.array([n], dtype=np.int32))
            return [int(value) for value in http.infer(caller, [tensor]).as_numpy("TOTAL")]

    for caller in ("bls_stream", "bls_stream_async"):
        assert await asyncio.to_thread(total, caller, 3) == [9, 3]
        assert await asyncio.to_thread(total, caller, 0) == [0, 0]
        with pytest.raises(InferenceServerException, match=r"call it with exec\(decoupled=True\)"):
            await asyncio.to_thread(total, caller, -1)  # exec() without decoupled=True


@on_cluster_too
async def test_a_decoupled_models_next_batch_runs_while_the_last_one_streams(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path
) -> None:
    """As on Triton, the model gets its next batch once `execute` returned, while the threads it
    left running still answer the last one: a request sent after a long stream began (so in a
    batch of its own, on the model's one instance) is answered before that stream ends."""
    root = tmp_path / "models"
    model(root, "square_int32", SQUARE_CONFIG, {"1": {"model.py": SQUARE}})
    port = free_port()
    await serve_gateway(repo=str(root), grpc_port=port)
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    grpc_url = f"127.0.0.1:{port}"
    await asyncio.to_thread(stream, grpc_url, [1])  # the runner starts and loads the model

    def overlapping() -> list[tuple[str, int]]:
        got: queue.Queue[tuple[str, Any]] = queue.Queue()
        long, short = triton_grpc.InferenceServerClient(grpc_url), triton_grpc.InferenceServerClient(grpc_url)
        try:
            long.start_stream(callback=lambda result, error: got.put(("long", error or result)))
            short.start_stream(callback=lambda result, error: got.put(("short", error or result)))
            for client, value in ((long, 25), (short, 2)):
                tensor = triton_grpc.InferInput("IN", [1], "INT32")
                tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
                client.async_stream_infer("square_int32", [tensor])
                if client is long:
                    first = got.get(timeout=60)  # the long one streams: its batch's execute returned
                    assert first[0] == "long", first
            order = [("long", 25)]
            for _ in range(25 - 1 + 2):
                which, result = got.get(timeout=60)
                assert not isinstance(result, InferenceServerException), result
                order.append((which, int(result.as_numpy("OUT")[0])))
            return order
        finally:
            long.stop_stream()
            short.stop_stream()
            long.close()
            short.close()

    order = await asyncio.to_thread(overlapping)
    assert order.count(("long", 25)) == 25 and order.count(("short", 2)) == 2, order
    assert order[-1] == ("long", 25), order  # the short request ended while the long one streamed
