"""Asynchronous results cannot fill Redis: a key past its quota of result bytes is refused (429)
and keeps every result it was accepted for; under memory pressure asynchronous submissions are
refused (503) while synchronous invocations are served."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import redis.asyncio as aioredis

from tests.conftest import on_cluster_too

BODY = {"inputs": {"input": [[0.5] * 16]}}
ASYNC = {"Prefer": "respond-async"}
CLASSIFY = "/v1/functions/classifier"


async def collect(client: httpx.AsyncClient, invocation_id: str) -> httpx.Response:
    return await client.get(f"/v1/invocations/{invocation_id}", params={"wait": 20})


@on_cluster_too
async def test_a_key_past_its_result_quota_gets_429_and_loses_no_result(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], redis: aioredis.Redis
) -> None:
    """Each done result counts against its key (with auth off, every caller is one key) until it
    expires. A burst that outruns the quota (2 KB here) is accepted while results are not yet done
    and gets every result; then the key holds more than its quota, and is refused with
    Retry-After. On a cluster the quota is in the key's slot, the results in the function's."""
    base = await serve_gateway(result_quota_bytes=2000)
    await inprocess_runner(functions=("classifier",))
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        burst = await asyncio.gather(*(client.post(CLASSIFY, json=BODY, headers=ASYNC) for _ in range(12)))
        accepted = [response.json()["id"] for response in burst if response.status_code == 202]
        answers = [await collect(client, invocation_id) for invocation_id in accepted]
        refused = await client.post(CLASSIFY, json=BODY, headers=ASYNC)
    assert {response.status_code for response in burst} <= {202, 429}
    assert len(accepted) >= 2  # about 500 bytes a result: the quota is passed within the burst
    assert {answer.status_code for answer in answers} == {200}
    assert len({str(answer.json()["outputs"]) for answer in answers}) == 1
    assert refused.status_code == 429, refused.text
    assert refused.json()["code"] == "rate_limited"
    assert (
        "holds as many bytes of asynchronous results as it may (result_quota_bytes"
        in (refused.json()["error"])
    )
    assert int(refused.headers["retry-after"]) >= 1


async def test_under_memory_pressure_asynchronous_submissions_get_503(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    extra_redis: Callable[..., tuple[Any, str]],
) -> None:
    _process, url = extra_redis("--maxmemory", "32mb", "--maxmemory-policy", "noeviction")
    base = await serve_gateway(redis_url=url)
    await inprocess_runner(redis_url=url, functions=("classifier",))
    client_redis = aioredis.from_url(url)
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        before = await client.post(CLASSIFY, json=BODY, headers=ASYNC)
        assert before.status_code == 202, before.text
        assert (await collect(client, before.json()["id"])).status_code == 200
        for index in range(200):  # to 85% of maxmemory, a piece at a time
            if int((await client_redis.info("memory"))["used_memory"]) > 0.85 * 32 * 2**20:
                break
            await client_redis.set(f"ballast{index}", b"x" * 2**18)
        refused = await client.post(CLASSIFY, json=BODY, headers=ASYNC)
        served = await client.post(CLASSIFY, json=BODY)
    await client_redis.aclose()
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert "asynchronous invocations are refused until results expire" in refused.json()["error"]
    assert served.status_code == 200, served.text
