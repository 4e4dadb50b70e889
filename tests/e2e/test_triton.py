"""A Triton model repository served as it is: the guide's models through tritonclient unchanged
(versions, auto-complete, Triton's Python backend, an ensemble, what /config and statistics say),
and the queue policies: priorities served highest first, max_queue_size."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from fngate import keys
from fngate.config import GatewaySettings
from gateway.http.metrics_port import MetricsPort
from tests.conftest import EVERY_CONNECTION_KEPT, free_port, queued_invocations
from tests.gateway.test_triton_tools import wait_for
from tests.triton_repository import (
    SIMPLE,
    SIMPLE_STRING,
    batches_model,
    guide_repository,
    model,
    simple_onnx,
    simple_string_onnx,
)


def exercise_guide(url: str) -> None:
    """What a Triton user's client does with the guide's repository, unchanged."""
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    try:
        ids = np.array([[3, 1, 4, 1], [5, 9, 2, 6]], dtype=np.int64)
        mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=np.int64)
        inputs = [
            triton.InferInput("input_ids", [2, 4], "INT64"),
            triton.InferInput("attention_mask", [2, 4], "INT64"),
        ]
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(mask)
        # version_policy latest 2 of versions 1, 2, 3: version k scales by k.
        newest = client.infer("text_classifier", inputs)
        assert newest.get_response()["model_name"] == "text_classifier"
        assert newest.get_response()["model_version"] == "3"
        np.testing.assert_allclose(newest.as_numpy("logits"), [[24.0, -24.0], [42.0, -42.0]])
        pinned = client.infer("text_classifier", inputs, model_version="2")
        np.testing.assert_allclose(pinned.as_numpy("logits"), [[16.0, -16.0], [28.0, -28.0]])
        with pytest.raises(InferenceServerException, match="no version '1'"):
            client.infer("text_classifier", inputs, model_version="1")
        # No config.pbtxt: inputs, outputs and max_batch_size from the model, as Triton's auto-complete.
        completed = client.get_model_config("autocompleted")
        assert completed["max_batch_size"] == 4 and "dynamic_batching" in completed
        assert [(item["name"], item["data_type"], item["dims"]) for item in completed["input"]] == [
            ("input_ids", "TYPE_INT64", [-1]),
            ("attention_mask", "TYPE_INT64", [-1]),
        ]
        np.testing.assert_allclose(client.infer("autocompleted", inputs).as_numpy("logits")[0], [8.0, -8.0])

        # What /config and metadata say is what Triton says for the same config.pbtxt.
        config = client.get_model_config("text_classifier")
        assert (config["name"], config["platform"], config["backend"]) == (
            "text_classifier",
            "onnxruntime_onnx",
            "onnxruntime",
        )
        assert config["max_batch_size"] == 8 and config["version_policy"] == {"latest": {"num_versions": 2}}
        assert config["dynamic_batching"]["preferred_batch_size"] == [2, 4]
        assert config["dynamic_batching"]["default_queue_policy"] == {
            "timeout_action": "REJECT",
            "default_timeout_microseconds": 2000000,
            "allow_timeout_override": True,
            "max_queue_size": 64,
        }
        assert config["instance_group"][0]["count"] == 2 and config["instance_group"][0]["kind"] == "KIND_CPU"
        metadata = client.get_model_metadata("text_classifier")
        assert (metadata["name"], metadata["platform"], metadata["versions"]) == (
            "text_classifier",
            "onnxruntime_onnx",
            ["2", "3"],
        )
        assert metadata["inputs"][0] == {"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}
        detector = client.get_model_config("image_detector")  # a plan: configuration only, no GPU here
        assert detector["platform"] == "tensorrt_plan" and detector["instance_group"][0]["kind"] == "KIND_GPU"

        # The ensemble: a Python tokenizer, the ONNX classifier and a Python postprocessor.
        text = triton.InferInput("TEXT", [3, 1], "BYTES")
        text.set_data_from_numpy(
            np.array([[b"a tiny note"], [b"extraordinary circumstances"], [b"ok"]], dtype=object)
        )
        labels = client.infer("classify_text", [text]).as_numpy("LABEL")
        assert labels.tolist() == [[b"short"], [b"long"], [b"short"]]
        assert client.get_model_metadata("classify_text")["platform"] == "ensemble"
        # A TritonError response fails its own request, with its message.
        empty = triton.InferInput("TEXT", [1, 1], "BYTES")
        empty.set_data_from_numpy(np.array([[b""]], dtype=object))
        with pytest.raises(InferenceServerException, match="no words to classify"):
            client.infer("classify_text", [empty])

        stats = client.get_inference_statistics("text_classifier")["model_stats"]
        assert {item["name"] for item in stats} == {"text_classifier"}
        assert sum(int(item["inference_count"]) for item in stats) >= 6
    finally:
        client.close()


async def test_the_guide_repository_runs_unchanged(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis_url: str, tmp_path: Path
) -> None:
    root = guide_repository(tmp_path / "models")
    base = await serve_gateway(repo=str(root))
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    await asyncio.to_thread(exercise_guide, base)

    # The ensemble is ready in the index as its steps are (no runner loads an ensemble itself), and
    # a load of it loads its steps.
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        # Its statistics count its own calls (one answered, one failed) beside its steps'.
        for _ in range(100):
            (stats,) = (await client.get("/v2/models/classify_text/stats")).json()["model_stats"]
            counted = stats["inference_stats"]["success"]["count"], stats["inference_stats"]["fail"]["count"]
            if counted == (1, 1):
                break
            await asyncio.sleep(0.05)
        assert counted == (1, 1), stats
        assert stats["inference_stats"]["success"]["ns"] > 0 and stats["last_inference"] > 0, stats
        index = (await client.post("/v2/repository/index")).json()
        states = {entry["name"]: entry["state"] for entry in index if entry.get("version")}
        assert states["classify_text"] == "READY", index
        assert (await client.post("/v2/repository/models/classify_text/unload")).status_code == 200
        assert (await client.post("/v2/repository/models/tokenizer/unload")).status_code == 200
        index = (await client.post("/v2/repository/index")).json()
        ensemble = next(entry for entry in index if entry["name"] == "classify_text")
        assert ensemble["state"] == "UNAVAILABLE" and "step 'tokenizer'" in ensemble["reason"], index
        loaded = await client.post("/v2/repository/models/classify_text/load")
        assert loaded.status_code == 200, loaded.text
        index = (await client.post("/v2/repository/index")).json()
        states = {entry["name"]: entry["state"] for entry in index if entry.get("version")}
        assert states["classify_text"] == states["tokenizer"] == "READY", index

    # Triton's series name the model as Triton does (text_classifier, not the function text-classifier),
    # so that a dashboard or alert written for Triton matches.
    port = MetricsPort(GatewaySettings(redis_url=redis_url, repo=str(root)))
    try:
        scraped = (await port.scrape()).decode()
    finally:
        await port.aclose()
    models = {
        (sample.labels["model"], sample.labels["version"]): sample.value
        for family in text_string_to_metric_families(scraped)
        if family.name == "nv_inference_request_success"
        for sample in family.samples
    }
    assert models[("text_classifier", "3")] >= 3 and models[("text_classifier", "2")] >= 1, models
    assert not any("-" in model for model, _ in models), models


def exercise_strings(url: str, grpc_url: str) -> None:
    """The quickstart's string clients: numbers written as strings in, their sum and difference as
    strings out, over HTTP (binary and JSON tensors) and gRPC; text that is not UTF-8 is the
    caller's error, named."""
    import tritonclient.grpc as triton_grpc

    numbers = [list(range(16)), [10 * i for i in range(16)]]
    left = np.array([[str(n).encode() for n in row] for row in numbers], dtype=object)
    right = np.full((2, 16), b"1", dtype=object)
    sums = [[str(n + 1) for n in row] for row in numbers]
    differences = [[str(n - 1) for n in row] for row in numbers]

    def text(array: np.ndarray) -> list[list[str]]:
        """As the client gives them: bytes from binary outputs, str from JSON ones (with Triton too)."""
        return [
            [item.decode() if isinstance(item, bytes) else item for item in row] for row in array.tolist()
        ]

    http = triton.InferenceServerClient(url.removeprefix("http://"))
    rpc = triton_grpc.InferenceServerClient(grpc_url)
    try:
        for binary in (True, False):
            inputs = [triton.InferInput(name, [2, 16], "BYTES") for name in ("INPUT0", "INPUT1")]
            for tensor, array in zip(inputs, (left, right), strict=True):
                tensor.set_data_from_numpy(array, binary_data=binary)
            outputs = [
                triton.InferRequestedOutput(name, binary_data=binary) for name in ("OUTPUT0", "OUTPUT1")
            ]
            answer = http.infer("simple_string", inputs, outputs=outputs)
            assert text(answer.as_numpy("OUTPUT0")) == sums, binary
            assert text(answer.as_numpy("OUTPUT1")) == differences, binary
        grpc_inputs = [triton_grpc.InferInput(name, [2, 16], "BYTES") for name in ("INPUT0", "INPUT1")]
        for tensor, array in zip(grpc_inputs, (left, right), strict=True):
            tensor.set_data_from_numpy(array)
        answer = rpc.infer("simple_string", grpc_inputs)
        assert answer.as_numpy("OUTPUT0").tolist() == [[item.encode() for item in row] for row in sums]
        assert text(answer.as_numpy("OUTPUT1")) == differences

        broken = left[:1].copy()
        broken[0, 3] = b"\xff1"
        inputs = [triton.InferInput(name, [1, 16], "BYTES") for name in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(broken)
        inputs[1].set_data_from_numpy(right[:1])
        with pytest.raises(
            InferenceServerException, match="input 'INPUT0': element 3 is not UTF-8"
        ) as raised:
            http.infer("simple_string", inputs)
        assert raised.value.status() == "400"
    finally:
        http.close()
        rpc.close()


async def test_string_tensors_into_and_out_of_an_onnx_model(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path
) -> None:
    root = tmp_path / "models"
    folder = model(root, "simple_string", SIMPLE_STRING, {"1": {}})
    simple_string_onnx(folder / "1" / "model.onnx")
    grpc_port = free_port()
    base = await serve_gateway(repo=str(root), grpc_port=grpc_port)
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    await asyncio.to_thread(exercise_strings, base, f"127.0.0.1:{grpc_port}")


def exercise_load_with_a_configuration(url: str, other: str, grpc_url: str) -> None:
    """What Triton's model-control examples do with a configuration: a load with one serves it (on
    every gateway, the runner loading the model again), a load without one serves config.pbtxt
    again, and one that cannot serve the model is refused and leaves it as it was."""
    import tritonclient.grpc as triton_grpc

    client = triton.InferenceServerClient(url.removeprefix("http://"))
    elsewhere = triton.InferenceServerClient(other.removeprefix("http://"))
    rpc = triton_grpc.InferenceServerClient(grpc_url)

    def rows(count: int) -> np.ndarray:
        inputs = [triton.InferInput(name, [count, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(np.arange(count * 16, dtype=np.int32).reshape(count, 16))
        inputs[1].set_data_from_numpy(np.ones((count, 16), dtype=np.int32))
        return client.infer("simple", inputs).as_numpy("OUTPUT0")

    try:
        assert client.get_model_config("simple")["max_batch_size"] == 8
        with pytest.raises(InferenceServerException, match="8"):
            rows(16)
        rpc.load_model("simple", config='{"max_batch_size":"16"}')
        assert rpc.get_model_config("simple").config.max_batch_size == 16
        assert client.get_model_config("simple")["max_batch_size"] == 16
        assert wait_for(lambda: elsewhere.get_model_config("simple")["max_batch_size"] == 16)
        assert rows(16).tolist() == (np.arange(256).reshape(16, 16) + 1).tolist()

        # One that cannot serve the model (an input the model does not have) is refused in Triton's
        # words; the model serves on as it was.
        broken = '{"max_batch_size": 4, "input": [{"name": "NOPE", "data_type": "TYPE_INT32", "dims": [16]}]}'
        with pytest.raises(InferenceServerException, match="failed to load 'simple': ") as refused:
            client.load_model("simple", config=broken)
        assert refused.value.status() == "400"
        assert client.get_model_config("simple")["max_batch_size"] == 16

        client.load_model("simple")  # no configuration: config.pbtxt's again
        assert client.get_model_config("simple")["max_batch_size"] == 8
        assert wait_for(lambda: elsewhere.get_model_config("simple")["max_batch_size"] == 8)
        assert rows(8).tolist() == (np.arange(128).reshape(8, 16) + 1).tolist()
    finally:
        client.close()
        elsewhere.close()
        rpc.close()


async def test_a_load_with_a_configuration_serves_it_until_a_load_without(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path
) -> None:
    root = tmp_path / "models"
    simple_onnx(model(root, "simple", SIMPLE, {"1": {}}) / "1" / "model.onnx")
    grpc_port = free_port()
    base = await serve_gateway(repo=str(root), grpc_port=grpc_port)
    other = await serve_gateway(repo=str(root))
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    await asyncio.to_thread(exercise_load_with_a_configuration, base, other, f"127.0.0.1:{grpc_port}")


async def infer(client: httpx.AsyncClient, name: str, **parameters: int) -> httpx.Response:
    body = {
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}],
        "parameters": parameters,
    }
    return await client.post(f"/v2/models/{name}/infer", json=body)


def batch_of(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    number: int = response.json()["outputs"][0]["data"][0]
    return number


async def test_priorities_and_the_queue_size(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    root = tmp_path / "models"
    batches_model(root, "ranked", "priority_levels: 3 default_priority_level: 3", 0.4)
    batches_model(root, "bounded", "default_queue_policy { max_queue_size: 100 }", 0.0)
    base = await serve_gateway(repo=str(root))
    # No runner takes "bounded": what is queued stays queued.
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"), functions=["ranked"])
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=EVERY_CONNECTION_KEPT) as client:
        assert batch_of(await infer(client, "ranked")) == 1  # loaded; the Python model batches from here

        # 3 levels: a burst of low-priority work (level 3, the default) and then one at level 1.
        low = [asyncio.create_task(infer(client, "ranked")) for _ in range(16)]
        done, _ = await asyncio.wait(low, return_when=asyncio.FIRST_COMPLETED)
        running = batch_of(done.pop().result())  # the batch after it starts as this answer leaves
        high = batch_of(await infer(client, "ranked", priority=1))
        await asyncio.gather(*low)
        answers = [task.result() for task in low]
        lows = [batch_of(answer) for answer in answers]
        assert high <= running + 2, (high, running, sorted(lows))  # at most the batch then running
        assert max(lows) > high  # low-priority work still queued was served after it
        assert max(answer.json()["outputs"][0]["data"][1] for answer in answers) == 4  # batches of 4

        # max_queue_size 100: the 101st is refused at once, with Retry-After.
        stream = keys.invocations("bounded")
        held = [asyncio.create_task(infer(client, "bounded")) for _ in range(100)]
        deadline = time.monotonic() + 20
        while await queued_invocations(redis, stream) < 100 and time.monotonic() < deadline:  # noqa: ASYNC110 (Redis)
            await asyncio.sleep(0.05)
        assert await queued_invocations(redis, stream) == 100
        refused = await infer(client, "bounded")
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert "has too many invocations queued (max_queue_size)" in refused.json()["error"]
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
