"""The Open Inference Protocol over gRPC: tritonclient's gRPC clients (sync, callbacks, streams,
asyncio) and KServe's clients (gRPC and REST) against a real gateway and runner, with the same keys,
scopes, limits, deadlines and input checks as over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from fngate import apikeys, keys
from fngate.wire import Invocation
from gateway.grpc.service import UNIMPLEMENTED
from tests.conftest import free_port
from tests.gateway.test_auth import (
    ANY_KEY,
    BROWSING,
    INVOKE_CLASSIFIER,
    INVOKERS,
    READ_CLASSIFIER,
    SCOPES,
    WRONG,
    create_key,
)

ROOT = Path(__file__).resolve().parents[2]
BATCH = np.random.default_rng(3).standard_normal((3, 16), dtype=np.float32)


def reference(repo: Path, batch: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        str(repo / "classifier" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    result: np.ndarray = session.run(["probabilities"], {"input": batch})[0]
    return result


def tensor(batch: np.ndarray, name: str = "input", datatype: str = "FP32") -> triton.InferInput:
    item = triton.InferInput(name, list(batch.shape), datatype)
    item.set_data_from_numpy(batch)
    return item


def the_guides_client(url: str, repo: Path) -> None:
    """What Triton's client examples do: metadata, configuration, infer with a client timeout and a
    request id, 100 async_infer calls with a callback, a stream, statistics."""
    client = triton.InferenceServerClient(url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("classifier")
        assert client.get_server_metadata().name == "fngate"
        metadata = client.get_model_metadata("classifier", as_json=True)
        assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "16"]}]
        config = client.get_model_config("classifier", as_json=True)["config"]
        assert config["name"] == "classifier" and int(config["max_batch_size"]) >= 1

        wanted = reference(repo, BATCH)
        result = client.infer(
            "classifier",
            [tensor(BATCH)],
            outputs=[triton.InferRequestedOutput("probabilities")],
            request_id="req-7",
            client_timeout=10,
            headers={"x-trace-me": "no"},
        )
        assert result.get_response().id == "req-7"
        assert result.get_response().model_version == "1"
        np.testing.assert_allclose(result.as_numpy("probabilities"), wanted, rtol=1e-5)

        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        for index in range(100):
            client.async_infer(
                "classifier",
                [tensor(BATCH[index % 3 : index % 3 + 1])],
                callback=lambda result, error: answers.put((result, error)),
                request_id=str(index),
            )
        seen = set()
        for _ in range(100):
            result, error = answers.get(timeout=30)
            assert error is None, error
            index = int(result.get_response().id)
            np.testing.assert_allclose(
                result.as_numpy("probabilities"), wanted[index % 3 : index % 3 + 1], rtol=1e-5
            )
            seen.add(index)
        assert seen == set(range(100))

        streamed: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: streamed.put((result, error)))
        for index in range(10):
            client.async_stream_infer("classifier", [tensor(BATCH)], request_id=f"s{index}")
        client.async_stream_infer("classifier", [tensor(BATCH[:, :3])], request_id="bad")
        ids, errors = set(), []
        for _ in range(11):
            result, error = streamed.get(timeout=30)
            if error is not None:
                errors.append(str(error))
            else:
                ids.add(result.get_response().id)
                np.testing.assert_allclose(result.as_numpy("probabilities"), wanted, rtol=1e-5)
        client.stop_stream()
        assert ids == {f"s{index}" for index in range(10)}
        assert len(errors) == 1 and "dimension 1 is 3" in errors[0]

        stats = client.get_inference_statistics("classifier", as_json=True)["model_stats"]
        assert stats[0]["name"] == "classifier" and int(stats[0]["inference_count"]) >= 111
        index = client.get_model_repository_index(as_json=True)["models"]
        assert {"name": "classifier", "version": "1"}.items() <= index[0].items() or any(
            entry["name"] == "classifier" for entry in index
        )
    finally:
        client.close()


async def test_tritonclients_grpc_clients_work_unchanged(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], repo: Path
) -> None:
    port = free_port()
    await serve_gateway(grpc_port=port)
    await inprocess_runner()
    await asyncio.to_thread(the_guides_client, f"127.0.0.1:{port}", repo)

    client = triton_aio.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        results = await asyncio.gather(*(client.infer("classifier", [tensor(BATCH)]) for _ in range(8)))
        for result in results:
            np.testing.assert_allclose(result.as_numpy("probabilities"), reference(repo, BATCH), rtol=1e-5)
        with pytest.raises(InferenceServerException, match="Request for unknown model") as raised:
            await client.infer("nope", [tensor(BATCH)])
        assert raised.value.status() == "StatusCode.NOT_FOUND"
        assert raised.value.message().startswith("Request for unknown model: 'nope' is not found")
    finally:
        await client.close()


async def test_kserves_clients_work_unchanged(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis_url: str, repo: Path
) -> None:
    """KServe's gRPC and REST clients, in their own environment and process (.venv/kserve, from
    requirements/kserve.txt): KServe's generated messages and tritonclient's (which the gateway
    uses) define the same `inference.*` names, which one protobuf descriptor pool refuses to hold
    twice."""
    python = os.environ.get("KSERVE_PYTHON") or str(ROOT / ".venv" / "kserve" / "bin" / "python")
    if not os.access(python, os.X_OK):
        pytest.skip(f"KServe's clients are not installed in {python}: scripts/bootstrap installs them")
    port = free_port()
    key, _ = create_key(redis_url, "invoke")
    http_url = await serve_gateway(grpc_port=port, auth=True)
    await inprocess_runner()
    client = await asyncio.create_subprocess_exec(
        python,
        str(ROOT / "tests" / "e2e" / "kserve_clients.py"),
        f"127.0.0.1:{port}",
        http_url,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(client.communicate(key.encode() + b"\n" + BATCH.tobytes()), 120)
    assert client.returncode == 0, err.decode()[-3000:]
    found = json.loads(out)
    wanted = reference(repo, BATCH)
    assert found["grpc_live"] is True and found["grpc_ready"] is True
    assert found["grpc_id"] == "ks-1"
    np.testing.assert_allclose(np.asarray(found["grpc_output"], np.float32), wanted, rtol=1e-5)
    assert found["grpc_missing"][0] == "NOT_FOUND"
    assert "Request for unknown model: 'nope' is not found" in found["grpc_missing"][1]
    assert found["grpc_no_key"] == "UNAUTHENTICATED"
    assert found["rest_ready"] is True
    np.testing.assert_allclose(
        np.asarray(found["rest_output"], np.float32).reshape(wanted.shape), wanted, rtol=1e-5
    )


def raw_call(port: int, request: service_pb2.ModelInferRequest, **kwargs: Any) -> grpc.RpcError:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request, timeout=10, **kwargs)
    error: grpc.RpcError = raised.value
    return error


def request_of(*inputs: tuple[str, str, list[int]], raw: list[bytes] | None = None) -> Any:
    request = service_pb2.ModelInferRequest(model_name="classifier")
    for name, datatype, shape in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.extend(raw or [])
    return request


def typed_answer(port: int) -> np.ndarray:
    """Typed contents (fp32_contents) instead of raw buffers."""
    request = request_of(("input", "FP32", [3, 16]))
    request.inputs[0].contents.fp32_contents.extend(BATCH.ravel().tolist())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)
    return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(3, 4)


def bad_inputs(port: int) -> list[tuple[str, grpc.StatusCode, str]]:
    row = BATCH[:1].tobytes()
    cases = [
        (request_of(("nope", "FP32", [1, 16]), raw=[row]), "unknown input 'nope'"),
        (request_of(("input", "INT32", [1, 16]), raw=[row]), "datatype 'INT32'"),
        (request_of(("input", "FP32", [1, 15]), raw=[row]), "dimension 1 is 15"),
        (request_of(("input", "FP32", [2, 16]), raw=[row]), "64 bytes of data but shape [2, 16]"),
        (request_of(("input", "FP32", [1, 16]), raw=[row, row]), "2 raw_input_contents for 1 inputs"),
        (request_of(("input", "FP32", [1, 16])), "0 elements in fp32_contents"),
    ]
    found = []
    for request, expected in cases:
        error = raw_call(port, request)
        found.append((expected, error.code(), error.details() or ""))
    return found


async def test_typed_contents_work_and_bad_input_is_invalid_argument(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], repo: Path
) -> None:
    port = free_port()
    await serve_gateway(grpc_port=port, max_body_bytes=64 * 1024)
    await inprocess_runner()
    np.testing.assert_allclose(await asyncio.to_thread(typed_answer, port), reference(repo, BATCH), rtol=1e-5)
    for expected, code, details in await asyncio.to_thread(bad_inputs, port):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (expected, details)
        assert expected in details
    too_big = request_of(("input", "FP32", [1, 16]), raw=[b"\0" * (128 * 1024)])
    error = await asyncio.to_thread(raw_call, port, too_big)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # grpc's own limit: max_body_bytes


def guarded(port: int, keys: dict[str, str]) -> dict[str, Any]:
    """What each key gets over gRPC; the key travels as `authorization` metadata."""
    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    found: dict[str, Any] = {"live": client.is_server_live()}  # health needs no key
    for who, key in keys.items():
        headers = {"authorization": f"Bearer {key}"} if key else None
        try:
            client.infer("classifier", [tensor(BATCH)], headers=headers)
            found[who] = "ok"
        except InferenceServerException as exc:
            found[who] = (exc.status(), exc.message())
    try:
        client.get_model_metadata("classifier", headers={"authorization": f"Bearer {keys['other']}"})
        found["other-metadata"] = "ok"
    except InferenceServerException as exc:
        found["other-metadata"] = exc.status()
    client.close()
    return found


async def test_keys_scopes_and_limits_hold_over_grpc(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis_url: str
) -> None:
    port = free_port()
    invoker, _ = create_key(redis_url, "invoke:classifier")
    other, _ = create_key(redis_url, "invoke:normalize")
    limited, _ = create_key(redis_url, "invoke:classifier", rps=0.01, burst=1)
    await serve_gateway(grpc_port=port, auth=True)
    await inprocess_runner()
    found = await asyncio.to_thread(
        guarded, port, {"none": "", "invoker": invoker, "other": other, "limited": limited, "again": limited}
    )
    assert found["live"] is True
    assert found["none"][0] == "StatusCode.UNAUTHENTICATED"
    assert found["invoker"] == "ok"
    assert found["other"] == (
        "StatusCode.PERMISSION_DENIED",
        f"the API key {apikeys.key_id(other)} lacks the scope invoke:classifier",
    )
    assert found["other-metadata"] == "StatusCode.PERMISSION_DENIED"
    assert found["limited"] == "ok"
    assert found["again"][0] == "StatusCode.RESOURCE_EXHAUSTED" and "over its rate" in found["again"][1]


def too_late(port: int, timeout_s: float, headers: dict[str, str] | None = None) -> str:
    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        client.infer("classifier", [tensor(BATCH)], client_timeout=timeout_s, headers=headers)
    except InferenceServerException as exc:
        return str(exc.status())
    finally:
        client.close()
    raise AssertionError("answered with no runner")


async def queued_while_waiting(redis: Any, port: int, timeout_s: float, **headers: str) -> Invocation:
    """The one invocation queued by a call that no runner answers, read while its caller still
    waits: once the caller gives up, the gateway withdraws it from the stream."""
    waiting = asyncio.create_task(asyncio.to_thread(too_late, port, timeout_s, headers))
    deadline = time.monotonic() + timeout_s / 2
    entries = []
    while not entries and time.monotonic() < deadline:
        entries = await redis.xrange(keys.invocations("classifier"))
        await asyncio.sleep(0.01)
    assert await waiting == "StatusCode.DEADLINE_EXCEEDED"
    assert len(entries) == 1, f"queued within {timeout_s / 2} s of the call: {entries}"
    return Invocation.decode(entries[0][1])


async def test_the_rpc_deadline_is_the_invocations(serve_gateway: Callable[..., Any], redis: Any) -> None:
    """With no runner the call times out; the queued entry shows the server took the RPC's
    deadline (2 s) rather than the function's timeout_ms (5 s)."""
    port = free_port()
    await serve_gateway(grpc_port=port)
    sent_ms = time.time() * 1000
    invocation = await queued_while_waiting(redis, port, 2.0)
    assert 2000 <= invocation.deadline_ms - sent_ms < 4000


# Each RPC of the service -> (its request, who may call it). Every RPC of the service's descriptor
# must be here, so that an RPC served later without a scope check fails this test.
RPC_POLICY: dict[str, tuple[dict[str, Any], set[str] | None]] = {
    "ServerLive": ({}, None),
    "ServerReady": ({}, None),
    "ServerMetadata": ({}, ANY_KEY),
    "ModelReady": ({"name": "classifier"}, READ_CLASSIFIER),
    "ModelMetadata": ({"name": "classifier"}, READ_CLASSIFIER),
    "ModelConfig": ({"name": "classifier"}, READ_CLASSIFIER),
    "ModelStatistics": ({"name": "classifier"}, READ_CLASSIFIER),
    "ModelInfer": (
        {"model_name": "classifier"},
        INVOKE_CLASSIFIER,
    ),  # no inputs: INVALID_ARGUMENT once allowed
    "ModelStreamInfer": ({"model_name": "classifier"}, INVOKE_CLASSIFIER),
    "RepositoryIndex": ({}, {"admin", "read"}),
    "RepositoryModelLoad": ({"model_name": "nope"}, {"admin"}),
    "RepositoryModelUnload": ({"model_name": "nope"}, {"admin"}),
    **{name: ({}, ANY_KEY) for name in UNIMPLEMENTED},
    # Shared memory: any key that may invoke some function (off in this gateway: registrations are
    # refused once allowed).
    **{
        f"{kind}SharedMemory{action}": ({}, INVOKERS)
        for kind in ("System", "Cuda")
        for action in ("Status", "Register", "Unregister")
    },
}
RPC_EXTRA = [("ModelStatistics", {}, BROWSING)]  # every function's statistics: those the key may read
DENIED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


async def call_rpc(channel: grpc.aio.Channel, name: str, fields: dict[str, Any], key: str | None) -> str:
    """The status code's name an RPC ends with ('OK' when answered); a stream's in-band refusal is
    PERMISSION_DENIED."""
    method = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name[name]
    request_type = getattr(service_pb2, method.input_type.name)
    response_type = getattr(service_pb2, method.output_type.name)
    path = f"/inference.GRPCInferenceService/{name}"
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    try:
        if method.server_streaming:
            stream = channel.stream_stream(path, request_type.SerializeToString, response_type.FromString)
            call = stream(iter([request_type(**fields)]), metadata=metadata)
            async for answer in call:
                if "lacks the scope" in answer.error_message:
                    return "PERMISSION_DENIED"
            return "OK"
        unary = channel.unary_unary(path, request_type.SerializeToString, response_type.FromString)
        await unary(request_type(**fields), metadata=metadata, timeout=10)
    except grpc.aio.AioRpcError as exc:
        return str(exc.code().name)
    return "OK"


async def test_every_rpc_against_every_caller(serve_gateway: Callable[..., Any], redis_url: str) -> None:
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert set(service.methods_by_name) == set(RPC_POLICY), "RPCs without a policy in this test, or gone"
    port = free_port()
    await serve_gateway(grpc_port=port, auth=True, load_timeout_s=1)
    callers: dict[str, str | None] = {"no key": None, "wrong key": WRONG}
    callers |= {scope: create_key(redis_url, scope)[0] for scope in SCOPES}
    failures = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        cases = [(name, fields, allowed) for name, (fields, allowed) in RPC_POLICY.items()] + RPC_EXTRA
        for name, fields, allowed in cases:
            for caller, key in callers.items():
                code = await call_rpc(channel, name, fields, key)
                if allowed is None or caller in allowed:
                    ok = code not in {status.name for status in DENIED}
                else:
                    ok = code == ("PERMISSION_DENIED" if caller in SCOPES else "UNAUTHENTICATED")
                if not ok:
                    failures.append(f"{name}({fields}) as {caller}: {code}")
    assert failures == []


async def test_a_traceparent_in_the_metadata_travels_with_the_invocation(
    serve_gateway: Callable[..., Any], redis: Any
) -> None:
    """The caller's trace continues in the runner's spans, whether or not the gateway traces."""
    port = free_port()
    await serve_gateway(grpc_port=port)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    invocation = await queued_while_waiting(redis, port, 2.0, traceparent=traceparent)
    assert invocation.traceparent == traceparent
