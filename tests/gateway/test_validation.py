"""Every kind of bad request gets a 4xx naming the problem, and nothing reaches the queue."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from fngate import keys

ROW = [0.5] * 16
V2 = "/v2/models/classifier/infer"


def tensor(**changes: Any) -> dict[str, Any]:
    return {"name": "input", "datatype": "FP32", "shape": [1, 16], "data": ROW, **changes}


def binary(
    header: dict[str, Any], payload: bytes, declared: int | None = None
) -> tuple[bytes, dict[str, str]]:
    raw = httpx.Request("POST", "/", json=header).read()
    size = len(raw) if declared is None else declared
    return raw + payload, {"Inference-Header-Content-Length": str(size)}


FLOATS = struct.pack("<16f", *ROW)

CASES: list[tuple[str, str, Any, dict[str, str], int, str]] = [
    (
        "unknown function",
        "/v2/models/nope/infer",
        {"inputs": [tensor()]},
        {},
        404,
        "Request for unknown model: 'nope' is not found",
    ),
    (
        "unknown v1 function",
        "/v1/functions/nope",
        {"inputs": {"input": [ROW]}},
        {},
        404,
        "Request for unknown model: 'nope'",
    ),
    (
        "unknown version",
        "/v2/models/classifier/versions/9/infer",
        {"inputs": [tensor()]},
        {},
        404,
        "version '9'",
    ),
    ("malformed JSON", V2, b"{not json", {}, 400, "not valid JSON"),
    ("empty body", V2, b"", {}, 400, "empty"),
    ("JSON array body", V2, b"[1, 2]", {}, 400, "JSON object"),
    ("no inputs", V2, {"inputs": []}, {}, 400, "'inputs' must be a non-empty list"),
    ("unknown input", V2, {"inputs": [tensor(name="pixels")]}, {}, 400, "unknown input 'pixels'"),
    ("missing input", "/v2/models/probe/infer", {"inputs": []}, {}, 400, "non-empty"),
    ("input twice", V2, {"inputs": [tensor(), tensor()]}, {}, 400, "given twice"),
    ("wrong datatype", V2, {"inputs": [tensor(datatype="INT32")]}, {}, 400, "datatype 'INT32'"),
    ("wrong rank", V2, {"inputs": [tensor(shape=[16])]}, {}, 400, "rank 1"),
    ("wrong dimension", V2, {"inputs": [tensor(shape=[1, 8], data=ROW[:8])]}, {}, 400, "dimension 1 is 8"),
    ("zero dimension", V2, {"inputs": [tensor(shape=[0, 16], data=[])]}, {}, 400, "at least 1"),
    ("shape not a list", V2, {"inputs": [tensor(shape="1,16")]}, {}, 400, "list of integers"),
    ("too little data", V2, {"inputs": [tensor(data=ROW[:15])]}, {}, 400, "15 elements of data"),
    ("strings as floats", V2, {"inputs": [tensor(data=["a"] * 16)]}, {}, 400, "not a well-formed array"),
    (
        "no data",
        V2,
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16]}]},
        {},
        400,
        "neither 'data'",
    ),
    (
        "rows over max_batch_size",
        V2,
        {"inputs": [tensor(shape=[33, 16], data=ROW * 33)]},
        {},
        400,
        "over the function's max_batch_size 32",
    ),
    (
        "unknown output",
        V2,
        {"inputs": [tensor()], "outputs": [{"name": "logits"}]},
        {},
        400,
        "unknown output 'logits'",
    ),
    ("bad timeout", V2, {"inputs": [tensor()], "parameters": {"timeout_ms": -5}}, {}, 400, "timeout_ms"),
    ("v1 inputs not an object", "/v1/functions/classifier", {"inputs": [ROW]}, {}, 400, "must be an object"),
    ("v1 ragged rows", "/v1/functions/classifier", {"inputs": {"input": [ROW, ROW[:3]]}}, {}, 400, "ragged"),
    ("v1 scalar", "/v1/functions/classifier", {"inputs": {"input": 3}}, {}, 400, "scalar"),
    (
        "v1 missing input",
        "/v1/functions/classifier",
        {"inputs": {"other": [ROW]}},
        {},
        400,
        "unknown input 'other'",
    ),
    (
        "binary: header length not a number",
        V2,
        *binary({"inputs": [tensor()]}, b"")[0:1],
        {"Inference-Header-Content-Length": "ten"},
        400,
        "not a number",
    ),
    (
        "binary: header length past the body",
        V2,
        *binary({"inputs": [tensor()]}, b"", declared=10_000),
        400,
        "outside the body",
    ),
    (
        "binary: size past the data",
        V2,
        *binary(
            {
                "inputs": [
                    {
                        "name": "input",
                        "datatype": "FP32",
                        "shape": [1, 16],
                        "parameters": {"binary_data_size": 64},
                    }
                ]
            },
            FLOATS[:32],
        ),
        400,
        "runs past",
    ),
    (
        "binary: size wrong for the shape",
        V2,
        *binary(
            {
                "inputs": [
                    {
                        "name": "input",
                        "datatype": "FP32",
                        "shape": [1, 16],
                        "parameters": {"binary_data_size": 32},
                    }
                ]
            },
            FLOATS[:32],
        ),
        400,
        "needs 64",
    ),
    (
        "binary: bytes left over",
        V2,
        *binary(
            {
                "inputs": [
                    {
                        "name": "input",
                        "datatype": "FP32",
                        "shape": [1, 16],
                        "parameters": {"binary_data_size": 64},
                    }
                ]
            },
            FLOATS + b"junk",
        ),
        400,
        "not claimed",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "fragment"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
async def test_bad_requests_are_refused_before_the_queue(
    serve_gateway: Callable[..., Any],
    redis: aioredis.Redis,
    path: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    fragment: str,
) -> None:
    base = await serve_gateway()
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).read()
    async with httpx.AsyncClient(base_url=base) as client:
        response = await client.post(path, content=content, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error, str)
    assert fragment in error
    for name in ("classifier", "normalize"):
        assert await redis.xlen(keys.invocations(name)) == 0


async def test_body_over_the_limit_is_413(serve_gateway: Callable[..., Any], redis: aioredis.Redis) -> None:
    base = await serve_gateway(max_body_bytes=4096)
    big = {"inputs": [tensor(shape=[32, 16], data=[0.123456789] * 512)]}
    async with httpx.AsyncClient(base_url=base) as client:
        declared = await client.post(V2, json=big)

        async def chunks() -> Any:
            for _ in range(10):
                yield b" " * 1000

        # Without a Content-Length the limit is enforced while reading; the gateway answers 413 and
        # closes the connection without reading the rest, so the client may see the close instead.
        try:
            streamed = (await client.post(V2, content=chunks())).status_code
        except httpx.ReadError:
            streamed = 413
    assert declared.status_code == 413
    assert "over the limit of 4096 bytes" in declared.json()["error"]
    assert streamed == 413
    assert await redis.xlen(keys.invocations("classifier")) == 0


async def test_garbage_never_makes_a_5xx(serve_gateway: Callable[..., Any]) -> None:
    base = await serve_gateway()
    bodies = [
        b"\xff\xfe",
        b"null",
        b'{"inputs": null}',
        b'{"inputs": [1]}',
        b'{"inputs": [{"name": 5}]}',
        b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": {"a": 1}}]}',
        b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [1], '
        b'"parameters": []}]}',
        b'{"inputs": [' + b"[" * 5000 + b"]" * 5000 + b"]}",
    ]
    async with httpx.AsyncClient(base_url=base) as client:
        for body in bodies:
            for path in (V2, "/v1/functions/classifier"):
                response = await client.post(path, content=body)
                assert 400 <= response.status_code < 500, (path, body[:40], response.text)
