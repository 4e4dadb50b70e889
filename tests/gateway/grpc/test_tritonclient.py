"""The official tritonclient HTTP client works against the gateway unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.conftest import free_port


def reference(repo: Path, batch: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        str(repo / "classifier" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    result: np.ndarray = session.run(["probabilities"], {"input": batch})[0]
    return result


def exercise(url: str, repo: Path) -> None:
    client = triton.InferenceServerClient(url.removeprefix("http://"))
    try:
        assert client.is_server_live()
        assert client.is_server_ready()
        assert client.is_model_ready("classifier")
        server = client.get_server_metadata()
        assert server["name"] == "fngate"
        assert "binary_tensor_data" in server["extensions"]
        metadata = client.get_model_metadata("classifier")
        assert metadata["name"] == "classifier"
        assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}]
        assert metadata["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 4]}]

        rng = np.random.default_rng(7)
        for binary in (False, True):
            batch = rng.standard_normal((3, 16), dtype=np.float32)
            tensor = triton.InferInput("input", list(batch.shape), "FP32")
            tensor.set_data_from_numpy(batch, binary_data=binary)
            wanted = triton.InferRequestedOutput("probabilities", binary_data=binary)
            result = client.infer("classifier", [tensor], outputs=[wanted], request_id=f"req-{binary}")
            assert result.get_response()["id"] == f"req-{binary}"
            assert result.get_response()["model_version"] == "1"
            np.testing.assert_allclose(result.as_numpy("probabilities"), reference(repo, batch), rtol=1e-5)
            # No outputs named: every output comes back.
            everything = client.infer("classifier", [tensor], model_version="1")
            np.testing.assert_allclose(
                everything.as_numpy("probabilities"), reference(repo, batch), rtol=1e-5
            )

        wrong = triton.InferInput("input", [1, 3], "FP32")
        wrong.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
        with pytest.raises(InferenceServerException, match="dimension 1 is 3"):
            client.infer("classifier", [wrong])
        with pytest.raises(InferenceServerException, match="Request for unknown model"):
            client.get_model_metadata("nope")
    finally:
        client.close()


async def test_tritonclient_http(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], repo: Path
) -> None:
    base = await serve_gateway()
    await inprocess_runner()
    await asyncio.to_thread(exercise, base, repo)


def server_names(url: str, grpc_url: str) -> tuple[str, str]:
    import tritonclient.grpc as triton_grpc

    http, rpc = triton.InferenceServerClient(url), triton_grpc.InferenceServerClient(grpc_url)
    try:
        return http.get_server_metadata()["name"], rpc.get_server_metadata().name
    finally:
        http.close()
        rpc.close()


async def test_the_server_name_is_the_one_set(serve_gateway: Callable[..., Any]) -> None:
    """Triton's health and metadata examples check that the server calls itself triton: with
    server_name (--server-name, FNGATE_SERVER_NAME) set so, it does over both protocols."""
    port = free_port()
    base = await serve_gateway(server_name="triton", grpc_port=port)
    names = await asyncio.to_thread(server_names, base.removeprefix("http://"), f"127.0.0.1:{port}")
    assert names == ("triton", "triton")
