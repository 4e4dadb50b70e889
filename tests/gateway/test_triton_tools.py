"""What Triton's own clients read besides inference: model configuration, statistics, health
bodies, explicit model control, compressed bodies and JSON errors for unknown routes."""

from __future__ import annotations

import asyncio
import gzip
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import free_port

ROW = [0.5] * 16


def infer(client: Any, rows: int, **options: Any) -> Any:
    tensor = triton.InferInput("input", [rows, 16], "FP32")
    tensor.set_data_from_numpy(np.full((rows, 16), 0.5, dtype=np.float32), binary_data=True)
    return client.infer("classifier", [tensor], **options)


def wait_for(check: Callable[[], Any], timeout_s: float = 10) -> Any:
    """Poll until `check` answers something truthy (statistics are written after the reply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.05)


def exercise_config_and_statistics(url: str) -> None:
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    try:
        assert client.is_server_live()
        assert client.is_server_ready()
        extensions = client.get_server_metadata()["extensions"]
        assert {"binary_tensor_data", "model_repository", "model_configuration", "statistics"} <= set(
            extensions
        )

        config = client.get_model_config("classifier")
        assert config["name"] == "classifier"
        assert config["platform"] == "onnxruntime_onnx"
        assert config["max_batch_size"] == 32
        assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [16]}]
        assert config["output"] == [{"name": "probabilities", "data_type": "TYPE_FP32", "dims": [4]}]
        assert config["dynamic_batching"]["preferred_batch_size"] == [8, 16, 32]
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
        assert client.get_model_config("classifier", "1")["name"] == "classifier"

        before = client.get_inference_statistics("classifier")["model_stats"]
        assert [(item["name"], item["version"]) for item in before] == [("classifier", "1")]
        assert before[0]["inference_stats"]["success"]["count"] == 0

        infer(client, 3)
        infer(client, 2, request_compression_algorithm="gzip")
        infer(client, 1, request_compression_algorithm="deflate", response_compression_algorithm="gzip")

        def counted() -> dict[str, Any] | None:
            stats = client.get_inference_statistics("classifier", "1")["model_stats"][0]
            return stats if stats["inference_stats"]["success"]["count"] == 3 else None

        stats = wait_for(counted)
        assert stats is not None, "three invocations were not counted"
        assert stats["inference_count"] == 6
        assert 1 <= stats["execution_count"] <= 3
        inference = stats["inference_stats"]
        assert inference["queue"]["count"] == 3
        assert inference["compute_infer"]["count"] == 3
        assert inference["success"]["ns"] >= inference["compute_infer"]["ns"] > 0
        assert inference["fail"]["count"] == 0
        assert (
            sum(batch["compute_infer"]["count"] for batch in stats["batch_stats"]) == stats["execution_count"]
        )
        assert stats["last_inference"] > 0

        everything = client.get_inference_statistics()["model_stats"]
        assert ("classifier", "1") in {(item["name"], item["version"]) for item in everything}
        with pytest.raises(InferenceServerException, match="Request for unknown model"):
            client.get_model_config("nope")
        with pytest.raises(InferenceServerException, match="no version '9'"):
            client.get_inference_statistics("classifier", "9")
    finally:
        client.close()


async def test_tritonclient_reads_config_and_statistics(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis: Any
) -> None:
    """(`redis` flushes the statistics that earlier tests left.)"""
    base = await serve_gateway()
    await inprocess_runner()
    await asyncio.to_thread(exercise_config_and_statistics, base)


def exercise_model_control(url: str, other: str, grpc_url: str) -> None:
    import tritonclient.grpc as triton_grpc

    client = triton.InferenceServerClient(url.removeprefix("http://"))
    elsewhere = triton.InferenceServerClient(other.removeprefix("http://"))
    try:
        infer(client, 1)
        assert client.is_model_ready("classifier")
        client.unload_model("classifier")
        assert not client.is_model_ready("classifier")
        with pytest.raises(InferenceServerException, match="unloaded") as refused:
            infer(client, 1)
        assert refused.value.status() == "503"
        # The other gateway learns it from Redis: not ready there either, within its refresh.
        assert wait_for(lambda: not elsewhere.is_model_ready("classifier"))
        with pytest.raises(InferenceServerException, match="unloaded"):
            infer(elsewhere, 1)
        # Metadata and configuration stay readable while unloaded.
        assert client.get_model_metadata("classifier")["name"] == "classifier"
        assert client.get_model_config("classifier")["name"] == "classifier"

        # A configuration given with the load applies to a Triton model (tests/e2e/test_triton.py),
        # not to a function deployed from its manifest; model files are never taken; neither is
        # silently ignored (a configuration that is none is refused as Triton refuses it). The
        # function stays unloaded.
        overrides = [
            ({"config": "{not json"}, "not a Triton model configuration"),
            ({"config": '{"max_batch_size": 4}'}, "applies to a Triton model of a repository folder"),
            (
                {"config": "{}", "files": {"file:1/model.onnx": b"onnx"}},
                "failed to poll from model repository",
            ),
        ]
        for arguments, message in overrides:
            with pytest.raises(InferenceServerException, match=message) as refused:
                client.load_model("classifier", **arguments)
            assert refused.value.status() == "400"
            # Triton's words first: its model-control example looks for them.
            assert refused.value.message().startswith("failed to load 'classifier': ")
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("wrong_model_name")
        assert refused.value.message().startswith("failed to load 'wrong_model_name': ")
        rpc = triton_grpc.InferenceServerClient(grpc_url)
        try:
            with pytest.raises(InferenceServerException, match="applies to a Triton model") as refused:
                rpc.load_model("classifier", config='{"max_batch_size": 4}')
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        finally:
            rpc.close()
        assert not client.is_model_ready("classifier")

        client.load_model("classifier")
        assert client.is_model_ready("classifier")
        assert wait_for(lambda: elsewhere.is_model_ready("classifier"))
        assert infer(elsewhere, 1).as_numpy("probabilities").shape == (1, 4)
    finally:
        client.close()
        elsewhere.close()


async def test_explicit_unload_is_not_ready_everywhere_until_load(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis: Any
) -> None:
    grpc_port = free_port()
    base = await serve_gateway(grpc_port=grpc_port)
    other = await serve_gateway()
    await inprocess_runner()
    await asyncio.to_thread(exercise_model_control, base, other, f"127.0.0.1:{grpc_port}")


async def test_idle_unload_keeps_the_function_ready(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis: Any
) -> None:
    base = await serve_gateway()
    await inprocess_runner(pool="brief")
    body = {"inputs": {"input": [ROW]}}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await client.post("/v1/functions/brief", json=body)).status_code == 200
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # brief unloads after one idle second
            index = (await client.post("/v2/repository/index", json={})).json()
            state = next(item for item in index if item["name"] == "brief")
            if state["reason"] == "idle-unloaded":
                break
            await asyncio.sleep(0.2)
        assert state["reason"] == "idle-unloaded"
        ready = await client.get("/v2/models/brief/ready")
        assert ready.status_code == 200
        assert ready.json() == {"name": "brief", "ready": True}


async def test_health_bodies_and_json_errors(serve_gateway: Callable[..., Any], redis: Any) -> None:
    """The bodies the protocol defines, read as KServe's InferenceRESTClient reads them:
    is_server_live takes `live`, is_server_ready `ready`, is_model_ready the status. (KServe's
    package pulls in its whole server, Kubernetes client and pandas, so it is not installed.)"""
    base = await serve_gateway(max_body_bytes=1024 * 1024)
    async with httpx.AsyncClient(base_url=base) as client:
        live = await client.get("/v2/health/live")
        assert (live.status_code, live.json()) == (200, {"live": True})
        ready = await client.get("/v2/health/ready")
        assert (ready.status_code, ready.json()) == (200, {"ready": True})
        model = await client.get("/v2/models/classifier/ready")
        assert (model.status_code, model.json()) == (200, {"name": "classifier", "ready": True})

        missing = await client.get("/v2/nothing/here")
        assert missing.status_code == 404
        assert missing.json() == {"error": "no route GET /v2/nothing/here", "code": "not_found"}
        wrong_method = await client.delete("/v2/health/live")
        assert wrong_method.status_code == 405
        assert wrong_method.json()["code"] == "invalid_argument"
        assert "GET" in wrong_method.headers["allow"]

        bomb = gzip.compress(b" " * (8 * 1024 * 1024))
        too_big = await client.post(
            "/v1/functions/classifier", content=bomb, headers={"content-encoding": "gzip"}
        )
        assert too_big.status_code == 413
        assert "decompressed body is over the limit" in too_big.json()["error"]
        broken = await client.post(
            "/v1/functions/classifier", content=b"not gzip", headers={"content-encoding": "gzip"}
        )
        assert broken.status_code == 400
        assert "does not decompress" in broken.json()["error"]


async def test_server_not_ready_while_redis_does_not_answer(
    serve_gateway: Callable[..., Any], redis: Any
) -> None:
    base = await serve_gateway()
    async with httpx.AsyncClient(base_url=base) as client:
        await redis.execute_command("CLIENT", "PAUSE", 4000, "ALL")
        for _ in range(30):  # the gateway's loops notice within about a second
            ready = await client.get("/v2/health/ready")
            if ready.status_code == 503:
                break
            await asyncio.sleep(0.1)
        assert ready.status_code == 503
        assert ready.json()["ready"] is False
        assert ready.headers["retry-after"] == "1"
        assert (await client.get("/v2/health/live")).json() == {"live": True}


async def test_large_responses_are_gzipped_for_clients_that_accept_it(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis: Any
) -> None:
    base = await serve_gateway()
    await inprocess_runner()
    row = [1.0] * 20_000
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, len(row)], "data": row}]}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        compressed = await client.post(
            "/v2/models/normalize/infer", json=body, headers={"accept-encoding": "gzip"}
        )
        assert compressed.status_code == 200, compressed.text
        assert compressed.headers["content-encoding"] == "gzip"
        assert len(compressed.json()["outputs"][0]["data"]) == len(row)
        plain = await client.post(
            "/v2/models/normalize/infer", json=body, headers={"accept-encoding": "identity"}
        )
        assert "content-encoding" not in plain.headers
        assert plain.json()["outputs"][0]["data"] == compressed.json()["outputs"][0]["data"]
        small = await client.get("/v2/models/normalize", headers={"accept-encoding": "gzip"})
        assert "content-encoding" not in small.headers
