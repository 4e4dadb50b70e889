"""KServe's own clients against a fngate gateway, run by KServe's environment (.venv/kserve) apart
from tritonclient's (the two ship generated messages of the same names):
`.venv/kserve/bin/python tests/e2e/kserve_clients.py GRPC_ADDRESS HTTP_URL`, the API key and a
[3, 16] FP32 batch on stdin (the key's line, then the raw bytes); prints what each call got as JSON
(tests/e2e/test_grpc.py checks it). It imports nothing of fngate's."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import grpc
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig


async def calls(grpc_address: str, http_url: str, key: str, batch: np.ndarray) -> dict[str, Any]:
    metadata = [("authorization", f"Bearer {key}")]
    found: dict[str, Any] = {}
    client = InferenceGRPCClient(grpc_address, timeout=10, retries=0)
    try:
        found["grpc_live"] = await client.is_server_live()
        found["grpc_ready"] = await client.is_model_ready("classifier", headers=metadata)
        inputs = [InferInput("input", list(batch.shape), "FP32", batch)]
        response = await client.infer(InferRequest("classifier", inputs, request_id="ks-1"), headers=metadata)
        found["grpc_id"] = response.id
        found["grpc_output"] = response.get_output_by_name("probabilities").as_numpy().tolist()
        found["grpc_missing"] = await refused(client.infer(InferRequest("nope", inputs), headers=metadata))
        found["grpc_no_key"] = (await refused(client.infer(InferRequest("classifier", inputs))))[0]
    finally:
        await client.close()
    rest = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=10))
    try:
        headers = dict(metadata)
        found["rest_ready"] = await rest.is_model_ready(http_url, "classifier", headers=headers)
        inputs = [InferInput("input", list(batch.shape), "FP32", batch.ravel().tolist())]
        request = InferRequest("classifier", inputs)
        answer = await rest.infer(http_url, request, model_name="classifier", headers=headers)
        found["rest_output"] = answer.get_output_by_name("probabilities").data
    finally:
        await rest.close()
    return found


async def refused(call: Any) -> tuple[str, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""
    raise AssertionError("answered")


def main() -> None:
    grpc_address, http_url = sys.argv[1:3]
    key = sys.stdin.buffer.readline().decode().strip()
    batch = np.frombuffer(sys.stdin.buffer.read(), np.float32).reshape(3, 16)
    print(json.dumps(asyncio.run(calls(grpc_address, http_url, key, batch))))


if __name__ == "__main__":
    main()
