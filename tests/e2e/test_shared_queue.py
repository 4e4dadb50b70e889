"""Two gateway processes and two runner processes on one Redis: every answer is right, and
invocations that came through different gateways run in the same batch."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import redis.asyncio as aioredis

from fngate import keys
from tests.conftest import EVERY_CONNECTION_KEPT, wait_http

BACKLOG = 200
LIVE = 200
CONCURRENCY = 48


async def test_two_gateways_two_runners_share_batches(
    gateway_process: Callable[..., str], runner_process: Callable[..., Any], repo: Path
) -> None:
    gateways = [gateway_process(), gateway_process()]
    for base in gateways:
        await wait_http(base)
    session = ort.InferenceSession(
        str(repo / "classifier" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(2026)
    inputs = [
        rng.standard_normal((int(rng.integers(1, 4)), 16), dtype=np.float32) for _ in range(BACKLOG + LIVE)
    ]
    origins: dict[str, set[int]] = collections.defaultdict(set)
    sizes: dict[str, int] = {}

    async def call(client: httpx.AsyncClient, index: int) -> None:
        which = index % 2
        response = await client.post(
            f"{gateways[which]}/v1/functions/classifier",
            json={"inputs": {"input": inputs[index].tolist()}, "timeout_ms": 5000},
        )
        assert response.status_code == 200, response.text
        body = response.json()
        expected = session.run(["probabilities"], {"input": inputs[index]})[0]
        np.testing.assert_allclose(
            np.asarray(body["outputs"]["probabilities"]), expected, rtol=1e-5, atol=1e-7
        )
        origins[body["batch"]["id"]].add(which)
        sizes[body["batch"]["id"]] = body["batch"]["size"]

    # A backlog queued through both gateways before any runner exists...
    async with httpx.AsyncClient(timeout=30, limits=EVERY_CONNECTION_KEPT) as client:
        backlog = [asyncio.create_task(call(client, index)) for index in range(BACKLOG)]
        await asyncio.sleep(0.5)
        for _ in range(2):
            runner_process(FNGATE_FUNCTIONS='["classifier"]')
        await asyncio.gather(*backlog)
    mixed = [batch for batch, seen in origins.items() if seen == {0, 1}]
    assert mixed, f"no batch held invocations from both gateways ({len(origins)} batches)"
    assert 1 < len(origins) < BACKLOG

    # ...then live traffic at a fixed concurrency, spread over both gateways (a client of its own:
    # the backlog's connections, one per invocation, are closed).
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=30, limits=EVERY_CONNECTION_KEPT) as client:

        async def limited(index: int) -> None:
            async with limit:
                await call(client, index)

        await asyncio.gather(*(limited(index) for index in range(BACKLOG, BACKLOG + LIVE)))
    assert max(sizes.values()) <= 32


async def test_a_delivered_reply_leaves_nothing_in_redis(
    serve_gateway: Callable[..., Any], runner_process: Callable[..., Any], redis: aioredis.Redis
) -> None:
    base = await serve_gateway()
    runner_process(FNGATE_FUNCTIONS='["probe"]')
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [16, 4], "data": [1.0] * 64}]}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await client.post("/v2/models/probe/infer", json=body)).status_code == 200
    lengths: list[int] = []
    for _ in range(50):  # trimmed with the gateway's next read of its stream (within its block time)
        streams = [key async for key in redis.scan_iter(match=keys.replies("*"))]
        lengths = [await redis.xlen(key) for key in streams]
        if lengths and sum(lengths) == 0:
            break
        await asyncio.sleep(0.1)
    assert lengths == [0]
