"""Asynchronous invocations with real processes (a Redis, gateway and runner processes of this
module's own): submit, poll, long-poll and fetch, V2 and v1 shapes, idempotent resubmission,
cancellation, expiry, callbacks with retries and a signature, synchronous invocations served ahead
of an asynchronous backlog, a result served by a gateway other than the one that accepted it, and
pipelines submitted, cancelled and failing (a step's error, the deadline between steps) like
functions."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
import uvicorn
import yaml
from redis.exceptions import ResponseError

from fngate import apikeys, clients, keys
from fngate.process import stop_processes
from fngate.queue import entry_runs
from fngate.registry import function_source
from fngate.up.scaler import LocalScaler, PoolSpec, pool_specs
from tests.conftest import ROOT, child_env, free_socket, start_redis, wait_http

SECRET = "test-callback-secret"
IDENTITY = """import numpy as np


class Model:
    def __init__(self, directory):
        pass

    def infer(self, inputs):
        return {"y": inputs["x"]}
"""
SLOW = """import time


class Model:
    def __init__(self, directory):
        pass

    def infer(self, inputs):
        time.sleep(1.5)
        return {"y": inputs["x"]}
"""
TICKET = '''import numpy as np


class Model:
    """Each row's answer is the number of the batch it ran in: 0 for the first."""

    def __init__(self, directory):
        self.batches = 0

    def infer(self, inputs):
        out = np.full_like(inputs["x"], self.batches, dtype=np.float32)
        self.batches += 1
        return {"y": out}
'''
REJECT = """class Model:
    def __init__(self, directory):
        pass

    def infer(self, inputs):
        raise ValueError("no rows accepted here")
"""
ROW = {"inputs": {"x": [[1.0, 2.0]]}}


def _function(
    repo: Path, name: str, model: str, cache: bool = False, pool: str = "default", **batching: Any
) -> None:
    folder = repo / name
    folder.mkdir()
    manifest = {
        "name": name,
        "model": {"backend": "python", "path": "model.py"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        "batching": {"max_batch_size": 8, "max_queue_delay_us": 0, "timeout_ms": 20000, **batching},
        "cache": {"enabled": cache},
        "scaling": {"pool": pool, "min_replicas": 0},
    }
    (folder / "function.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    (folder / "model.py").write_text(model)


def _pipeline(repo: Path, name: str, steps: dict[str, str], outputs: dict[str, str], **batching: Any) -> None:
    """A pipeline over this module's functions: `steps` maps each step to "function input-source"."""
    (repo / name).mkdir()
    tensor = {"datatype": "FP32", "shape": [-1, 2]}
    manifest = {
        "name": name,
        "inputs": [{"name": "x", **tensor}],
        "outputs": [{"name": output, **tensor} for output in outputs],
        "batching": {"max_batch_size": 8, "timeout_ms": 20000, **batching},
        "pipeline": {
            "steps": [
                {"name": step, "function": spec.split()[0], "inputs": {"x": spec.split()[1]}}
                for step, spec in steps.items()
            ],
            "outputs": outputs,
        },
    }
    (repo / name / "function.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))


class Deployment:
    """This module's processes; `started` are stopped at its end."""

    def __init__(self, redis_url: str, repo: Path, logs: Path) -> None:
        self.redis_url = redis_url
        self.repo = repo
        self.logs = logs
        self.started: list[subprocess.Popen[bytes]] = []
        self.gateways: dict[str, subprocess.Popen[bytes]] = {}
        client = clients.connect_sync(redis_url)
        self.admin, _ = apikeys.create(client, ["admin"])
        self.user, _ = apikeys.create(client, ["invoke"])
        self.other, _ = apikeys.create(client, ["invoke"])
        client.close()
        self.base = self.gateway()

    def _start(self, module: str, name: str, **env: str) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}-{len(self.started)}.log", "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", module],
                env=child_env(self.redis_url, self.repo, **env),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=[int(env["FNGATE_BIND"][5:])] if "FNGATE_BIND" in env else (),
            )
        self.started.append(process)
        return process

    def gateway(self) -> str:
        sock = free_socket()
        # The receivers of these tests listen on loopback: allowed here, refused by default.
        env = {"FNGATE_AUTH": "true", "FNGATE_CALLBACK_SECRET": SECRET, "FNGATE_CALLBACK_ALLOW": "127.0.0.1"}
        process = self._start("gateway", "gateway", FNGATE_BIND=f"fd://{sock.fileno()}", **env)
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        sock.close()
        self.gateways[base] = process
        return base

    def runner(self, *functions: str, **env: str) -> subprocess.Popen[bytes]:
        names = ",".join(f'"{name}"' for name in functions)
        return self._start("runner", "runner", FNGATE_FUNCTIONS=f"[{names}]", **env)


@pytest.fixture(scope="module")
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    """The module's processes on a Redis of their own, or on the session's Redis Cluster (a test
    parametrized with on_cluster_too)."""
    folder = tmp_path_factory.mktemp("async")
    process = None
    if getattr(request, "param", "redis") == "cluster":
        url = request.getfixturevalue("redis_cluster").url
        clients.connect_sync(url).flushall()
    else:
        process, url = start_redis(folder)
    repo = folder / "repo"
    repo.mkdir()
    shutil.copytree(ROOT / "functions" / "classifier", repo / "classifier")
    _function(repo, "echo", IDENTITY)
    _function(repo, "slow", SLOW)
    _function(repo, "relay", IDENTITY)
    _function(repo, "idle", IDENTITY)
    _function(repo, "held", IDENTITY)
    _function(repo, "lapse", IDENTITY, async_timeout_s=1, result_ttl_s=1)
    _function(repo, "brief", IDENTITY, async_timeout_s=600, result_ttl_s=1)
    _function(repo, "crowded", SLOW, async_timeout_s=1, max_batch_size=1)
    _function(repo, "cached", IDENTITY, cache=True)
    _function(repo, "parked", IDENTITY)
    _function(repo, "woken", IDENTITY, pool="woken")
    _function(repo, "ticket", TICKET, max_batch_size=4)
    _function(repo, "refuse", REJECT)
    _function(repo, "dormant", IDENTITY)
    _function(repo, "resting", IDENTITY)
    _function(repo, "unheard", IDENTITY)
    _function(repo, "kept", IDENTITY)  # no runner: what is submitted stays pending
    _pipeline(repo, "chain", {"first": "echo request.x", "second": "echo first.y"}, {"y": "second.y"})
    _pipeline(
        repo,
        "waiting",
        {"one": "dormant request.x", "two": "resting request.x"},
        {"y": "one.y", "z": "two.y"},
    )
    _pipeline(
        repo,
        "straddle",
        {"one": "unheard request.x", "two": "slow request.x"},
        {"y": "one.y", "z": "two.y"},
    )
    _pipeline(repo, "doomed", {"first": "echo request.x", "check": "refuse first.y"}, {"y": "check.y"})
    _pipeline(
        repo,
        "overdue",
        {"first": "echo request.x", "wait": "slow first.y", "then": "echo wait.y"},
        {"y": "then.y"},
        async_timeout_s=1,
    )
    found = Deployment(url, repo, folder)
    found.runner("classifier", "echo", "slow", "brief", "crowded", "cached", "refuse")
    try:
        yield found
    finally:
        stop_processes(found.started)
        if process is not None:
            process.terminate()
            process.wait(timeout=10)


on_cluster_too = pytest.mark.parametrize(
    "deployment", ["redis", pytest.param("cluster", marks=pytest.mark.cluster)], indirect=True
)
"""Run the test on the module's Redis and on the session's Redis Cluster."""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def client(deployment: Deployment) -> AsyncIterator[httpx.AsyncClient]:
    await wait_http(deployment.base)
    async with httpx.AsyncClient(
        base_url=deployment.base, timeout=60, headers=bearer(deployment.user)
    ) as found:
        yield found


async def submit(
    client: httpx.AsyncClient, path: str, body: Any = ROW, base: str = "", **headers: str
) -> str:
    response = await client.post(f"{base}{path}", json=body, headers={"Prefer": "respond-async", **headers})
    assert response.status_code == 202, response.text
    invocation_id: str = response.json()["id"]
    assert response.headers["location"] == f"/v1/invocations/{invocation_id}"
    assert response.headers["preference-applied"] == "respond-async"
    return invocation_id


async def result(client: httpx.AsyncClient, invocation_id: str, base: str = "") -> httpx.Response:
    """The result, long-polled until it is no longer pending (bounded)."""
    deadline = time.monotonic() + 60
    while True:
        response = await client.get(f"{base}/v1/invocations/{invocation_id}", params={"wait": 10})
        if response.status_code != 202 or time.monotonic() > deadline:
            return response


@on_cluster_too
async def test_submit_poll_and_fetch_in_both_shapes(client: httpx.AsyncClient) -> None:
    rows = np.random.default_rng(18).standard_normal((3, 16), dtype=np.float32)
    deadline = time.monotonic() + 60
    while True:  # the runner's cold start may outlast the function's timeout
        synchronous = await client.post("/v1/functions/classifier", json={"inputs": {"input": rows.tolist()}})
        if synchronous.status_code == 200 or time.monotonic() > deadline:
            break
    assert synchronous.status_code == 200, synchronous.text
    invocation_id = await submit(client, "/v1/functions/classifier", {"inputs": {"input": rows.tolist()}})
    response = await result(client, invocation_id)
    assert response.status_code == 200, response.text
    assert response.headers["x-fngate-state"] == "done"
    np.testing.assert_allclose(
        response.json()["outputs"]["probabilities"], synchronous.json()["outputs"]["probabilities"], rtol=1e-6
    )

    v2 = {
        "id": "r-18",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [3, 16], "data": rows.ravel().tolist()}],
    }
    invocation_id = await submit(client, "/v2/models/classifier/infer", v2)
    response = await result(client, invocation_id)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model_name"] == "classifier"
    assert body["id"] == "r-18"
    assert body["outputs"][0]["name"] == "probabilities"
    assert body["outputs"][0]["shape"] == [3, 4]


async def test_long_poll_waits_for_the_result(client: httpx.AsyncClient) -> None:
    invocation_id = await submit(client, "/v1/functions/slow")
    pending = await client.get(f"/v1/invocations/{invocation_id}")
    assert pending.status_code == 202
    assert pending.json()["state"] in ("queued", "running")
    assert pending.json()["id"] == invocation_id
    waited = await client.get(f"/v1/invocations/{invocation_id}", params={"wait": 30})
    assert waited.status_code == 200, waited.text
    assert waited.json()["outputs"]["y"] == [[1.0, 2.0]]


async def test_unknown_and_foreign_ids_are_not_found(
    client: httpx.AsyncClient, deployment: Deployment
) -> None:
    assert (await client.get(f"/v1/invocations/{'0' * 32}")).status_code == 404
    assert (await client.get("/v1/invocations/not-an-id")).status_code == 404
    invocation_id = await submit(client, "/v1/functions/echo")
    assert (await result(client, invocation_id)).status_code == 200
    # Another key learns nothing of it; an admin reads it.
    foreign = await client.get(f"/v1/invocations/{invocation_id}", headers=bearer(deployment.other))
    assert foreign.status_code == 404
    assert "outputs" not in foreign.text
    assert (
        await client.delete(f"/v1/invocations/{invocation_id}", headers=bearer(deployment.other))
    ).status_code == 404
    admin = await client.get(f"/v1/invocations/{invocation_id}", headers=bearer(deployment.admin))
    assert admin.status_code == 200
    assert (
        await client.get(f"/v1/invocations/{invocation_id}", headers={"Authorization": ""})
    ).status_code == 401


@on_cluster_too
async def test_idempotent_resubmission_returns_the_first_invocation(client: httpx.AsyncClient) -> None:
    first = await submit(client, "/v1/functions/echo", **{"Idempotency-Key": "order-18"})
    again = await client.post(
        "/v1/functions/echo", json=ROW, headers={"Prefer": "respond-async", "Idempotency-Key": "order-18"}
    )
    assert again.status_code == 202
    assert again.json()["id"] == first
    assert again.headers["x-fngate-idempotent-replay"] == "true"
    assert await submit(client, "/v1/functions/echo", **{"Idempotency-Key": "order-19"}) != first
    assert (await result(client, first)).status_code == 200

    # The same key with another body, or to another function, is a mistake the client hears of.
    for path, body in (("/v1/functions/echo", {"inputs": {"x": [[9.0, 9.0]]}}), ("/v1/functions/brief", ROW)):
        reused = await client.post(
            path, json=body, headers={"Prefer": "respond-async", "Idempotency-Key": "order-18"}
        )
        assert reused.status_code == 422, reused.text
        assert reused.json()["code"] == "invalid_argument"
        assert "'order-18'" in reused.json()["error"]


@on_cluster_too
async def test_submissions_count_against_the_keys_rate(
    client: httpx.AsyncClient, deployment: Deployment
) -> None:
    redis = clients.connect_sync(deployment.redis_url)
    try:
        slow_key, _ = apikeys.create(redis, ["invoke"], rps=0.01, burst=1)
    finally:
        redis.close()
    headers = {**bearer(slow_key), "Prefer": "respond-async"}
    deadline = time.monotonic() + 10
    while (first := await client.post("/v1/functions/echo", json=ROW, headers=headers)).status_code == 401:
        assert time.monotonic() < deadline, "the gateway never saw the new key"
        await asyncio.sleep(0.2)  # the gateways reload keys every auth_refresh_s
    assert first.status_code == 202, first.text
    refused = await client.post("/v1/functions/echo", json=ROW, headers=headers)
    assert refused.status_code == 429
    assert "retry-after" in refused.headers
    # One bucket for both: a synchronous invocation with the key is refused too.
    synchronous = await client.post("/v1/functions/echo", json=ROW, headers=bearer(slow_key))
    assert synchronous.status_code == 429 and synchronous.json()["code"] == "rate_limited"


@on_cluster_too
async def test_cancel_before_it_starts(client: httpx.AsyncClient, deployment: Deployment) -> None:
    invocation_id = await submit(client, "/v1/functions/idle")
    queue = clients.connect_sync(deployment.redis_url)
    try:
        assert queue.xlen(keys.invocations("idle", keys.ASYNC)) >= 1
        cancelled = await client.delete(f"/v1/invocations/{invocation_id}")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["state"] == "cancelled"
        # No runner can ever read it: it left the queue.
        assert queue.xlen(keys.invocations("idle", keys.ASYNC)) == 0
    finally:
        queue.close()
    gone = await client.get(f"/v1/invocations/{invocation_id}")
    assert gone.status_code == 410
    assert gone.json()["state"] == "cancelled"
    assert (await client.delete(f"/v1/invocations/{invocation_id}")).status_code == 200  # again: the same

    done = await submit(client, "/v1/functions/echo")
    assert (await result(client, done)).status_code == 200
    late = await client.delete(f"/v1/invocations/{done}")
    assert late.status_code == 409
    assert late.json()["state"] == "done"


async def test_a_result_expires(client: httpx.AsyncClient) -> None:
    """`lapse` has no runner, async_timeout_s 1 and result_ttl_s 1: past its deadline it reads as
    deadline_exceeded, and then it is gone."""
    invocation_id = await submit(client, "/v1/functions/lapse")
    assert (await client.get(f"/v1/invocations/{invocation_id}")).status_code == 202
    deadline = time.monotonic() + 30
    seen = []
    while time.monotonic() < deadline:
        response = await client.get(f"/v1/invocations/{invocation_id}")
        if not seen or seen[-1] != response.status_code:
            seen.append(response.status_code)
        if response.status_code == 404:
            break
        await asyncio.sleep(0.2)
    assert seen[-2:] == [504, 404], seen


async def test_a_result_is_kept_its_ttl_after_it_is_done(client: httpx.AsyncClient) -> None:
    """`brief` keeps results 1 s with a deadline 10 minutes away: once done, the result is gone
    soon after, not 10 minutes later."""
    invocation_id = await submit(client, "/v1/functions/brief")
    assert (await result(client, invocation_id)).status_code == 200
    deadline = time.monotonic() + 30
    while (response := await client.get(f"/v1/invocations/{invocation_id}")).status_code == 200:
        assert time.monotonic() < deadline, "the result outlived its result_ttl_s"
        await asyncio.sleep(0.2)
    assert response.status_code == 404


@on_cluster_too
async def test_a_result_fetched_with_delete_is_dropped(
    client: httpx.AsyncClient, deployment: Deployment
) -> None:
    """GET ?delete=true answers the result, then it is gone (404), and its bytes leave the key's
    quota at once; a pending one is answered 202 and kept; a foreign key drops nothing."""
    pending = await submit(client, "/v1/functions/kept")
    response = await client.get(f"/v1/invocations/{pending}", params={"delete": "true"})
    assert response.status_code == 202
    assert (await client.get(f"/v1/invocations/{pending}")).status_code == 202
    assert (await client.get(f"/v1/invocations/{pending}", params={"delete": "yes"})).status_code == 400

    invocation_id = await submit(client, "/v1/functions/echo")
    assert (await result(client, invocation_id)).status_code == 200
    redis = clients.connect_sync(deployment.redis_url)
    try:
        quota = keys.result_quota(apikeys.key_id(deployment.user) or "")
        charged = int(redis.hget(quota, "total") or 0)
        assert charged > 0
        foreign = await client.get(
            f"/v1/invocations/{invocation_id}", params={"delete": "true"}, headers=bearer(deployment.other)
        )
        assert foreign.status_code == 404
        fetched = await client.get(f"/v1/invocations/{invocation_id}", params={"delete": "true"})
        assert fetched.status_code == 200
        assert fetched.json()["outputs"]["y"] == [[1.0, 2.0]]
        assert (await client.get(f"/v1/invocations/{invocation_id}")).status_code == 404
        assert int(redis.hget(quota, "total") or 0) < charged
    finally:
        redis.close()


@on_cluster_too
async def test_a_cached_answer_is_the_result_at_once(
    client: httpx.AsyncClient, deployment: Deployment
) -> None:
    """A submission the response cache can answer is done when it is accepted, and queues
    nothing; an asynchronous invocation's answer is cached for the next, synchronous or not."""
    row = {"inputs": {"x": [[5.0, 6.0]]}}
    first = await client.post("/v1/functions/cached", json=row)
    assert first.status_code == 200, first.text
    accepted = await client.post("/v1/functions/cached", json=row, headers={"Prefer": "respond-async"})
    assert accepted.status_code == 202
    assert accepted.json()["state"] == "done"
    fetched = await client.get(f"/v1/invocations/{accepted.json()['id']}")  # no wait: it is there
    assert fetched.status_code == 200
    assert fetched.headers["x-fngate-state"] == "done"
    assert fetched.json()["outputs"] == first.json()["outputs"]
    redis = clients.connect_sync(deployment.redis_url)
    try:
        assert redis.xlen(keys.invocations("cached", keys.ASYNC)) == 0
    finally:
        redis.close()

    other = {"inputs": {"x": [[7.0, 8.0]]}}
    assert (await result(client, await submit(client, "/v1/functions/cached", other))).status_code == 200
    repeated = await client.post("/v1/functions/cached", json=other)
    assert repeated.status_code == 200
    assert repeated.headers["x-fngate-cache"] == "hit"


async def test_metrics_count_every_level(client: httpx.AsyncClient, deployment: Deployment) -> None:
    """`parked` has no runner: what waits at its asynchronous level shows in the queue gauges."""
    for _ in range(2):
        await submit(client, "/v1/functions/parked")
    metrics = await client.get("/metrics", headers=bearer(deployment.admin))
    assert metrics.status_code == 200
    assert 'fngate_queue_depth{function="parked",level="async"} 2.0' in metrics.text
    assert 'fngate_queue_depth{function="parked",level="sync"} 0.0' in metrics.text


class CallbackReceiver:
    """A plain ASGI server on loopback that fails the first `failures` POSTs with a 500."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[tuple[dict[str, str], bytes]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.calls.append(({k.decode(): v.decode() for k, v in scope["headers"]}, body))
        status = 500 if len(self.calls) <= self.failures else 204
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
async def callback_receiver(request: pytest.FixtureRequest) -> AsyncIterator[tuple[CallbackReceiver, str]]:
    """A receiver that fails twice before it accepts (or `failures` times, by indirect parameter)."""
    app = CallbackReceiver(failures=getattr(request, "param", 2))
    sock = free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 (uvicorn offers no event)
        await asyncio.sleep(0.01)
    yield app, f"http://127.0.0.1:{port}/hook"
    server.should_exit = True
    await asyncio.wait_for(task, 10)
    sock.close()


async def test_callback_retried_until_accepted_and_signed(
    client: httpx.AsyncClient, callback_receiver: tuple[CallbackReceiver, str]
) -> None:
    receiver, url = callback_receiver
    invocation_id = await submit(client, "/v1/functions/echo", **{"X-Callback-Url": url})
    headers, body = (await calls(receiver, 3))[-1]
    assert headers["x-fngate-invocation"] == invocation_id
    assert headers["x-fngate-state"] == "done"
    stamp, mac = (part.split("=", 1)[1] for part in headers["x-fngate-signature"].split(","))
    expected = hmac.new(SECRET.encode(), f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(mac, expected)
    fetched = await result(client, invocation_id)
    assert fetched.content == body  # the callback carries what GET answers
    # Every attempt is on the invocation.
    deadline = time.monotonic() + 10
    while True:
        state = (await client.get(f"/v1/invocations/{invocation_id}", params={"view": "state"})).json()
        attempts = state["callback"]["attempts"]
        if len(attempts) == 3 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert [attempt["outcome"] for attempt in attempts] == ["retrying", "retrying", "delivered"]
    assert all(set(attempt) == {"attempt", "at_ms", "outcome"} for attempt in attempts)
    assert url not in str(state)  # the state shows attempts, not where they went nor what it answered


async def calls(receiver: CallbackReceiver, count: int) -> list[tuple[dict[str, str], bytes]]:
    """The receiver's calls once it has `count` of them (bounded)."""
    deadline = time.monotonic() + 60
    while len(receiver.calls) < count and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    assert len(receiver.calls) == count
    return receiver.calls


@pytest.mark.parametrize("callback_receiver", [0], indirect=True)
async def test_callback_of_an_invocation_that_expired_in_the_queue(
    client: httpx.AsyncClient, callback_receiver: tuple[CallbackReceiver, str]
) -> None:
    """`crowded` runs one invocation at a time, each for 1.5 s, and gives asynchronous ones 1 s:
    the second never runs, and its callback says so with the 504 that GET answers."""
    receiver, url = callback_receiver
    await submit(client, "/v1/functions/crowded")
    invocation_id = await submit(client, "/v1/functions/crowded", **{"X-Callback-Url": url})
    [(headers, body)] = await calls(receiver, 1)
    assert headers["x-fngate-invocation"] == invocation_id
    assert headers["x-fngate-state"] == "failed"
    assert headers["x-fngate-status"] == "504"
    assert json.loads(body)["code"] == "deadline_exceeded"
    fetched = await result(client, invocation_id)
    assert fetched.status_code == 504
    assert fetched.content == body


class SlowReceiver:
    """A receiver on loopback that reads each callback, then sends its status line one byte a
    second (for at most a minute): it holds every attempt for as long as the sender lets it."""

    def __init__(self) -> None:
        self.accepted = 0
        self.ended = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await reader.readuntil(b"\r\n\r\n")
            for byte in (b"HTTP/1.1 204 No Content\r\n" + b"X: " + b"y" * 60)[:60]:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(1.0)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.ended += 1
            writer.close()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/slow"
        finally:
            server.close()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await server.wait_closed()


@pytest.mark.parametrize("callback_receiver", [0], indirect=True)
async def test_slow_receivers_hold_only_their_own_tenants_callbacks(
    client: httpx.AsyncClient, deployment: Deployment, callback_receiver: tuple[CallbackReceiver, str]
) -> None:
    """40 callbacks of one key to a receiver that trickles its answer take that key's turns at
    every gateway; another key's callback is delivered at once, while every slow attempt is still
    held (each ends at its deadline, 10 s). Before, 16 such receivers held every callback of the
    gateway, for as long as they trickled."""
    receiver, url = callback_receiver
    slow = SlowReceiver()
    async with (
        slow.serving() as slow_url,
        httpx.AsyncClient(base_url=deployment.base, timeout=30, headers=bearer(deployment.other)) as other,
    ):
        for _ in range(40):
            await submit(other, "/v1/functions/echo", **{"X-Callback-Url": slow_url})
        deadline = time.monotonic() + 30
        while slow.accepted < 4 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        assert slow.accepted >= 4  # they hold their attempts
        invocation_id = await submit(client, "/v1/functions/echo", **{"X-Callback-Url": url})
        [(headers, _body)] = await calls(receiver, 1)
        assert headers["x-fngate-invocation"] == invocation_id
        assert slow.ended == 0, "the other key's callback waited for a slow attempt to end"
        assert slow.accepted <= 8 * len(deployment.gateways)  # one key's turns at each gateway


async def test_sync_served_ahead_of_an_async_backlog(
    client: httpx.AsyncClient, deployment: Deployment
) -> None:
    """With 12 asynchronous and 2 synchronous invocations of `ticket` (max_batch_size 4) waiting,
    the runner's first batch holds both synchronous ones and fills its 2 other slots from the
    backlog; the backlog drains after."""
    backlog = [await submit(client, "/v1/functions/ticket") for _ in range(12)]
    synchronous = [asyncio.create_task(client.post("/v1/functions/ticket", json=ROW)) for _ in range(2)]
    queue = clients.connect_sync(deployment.redis_url)
    try:
        deadline = time.monotonic() + 20
        while queue.xlen(keys.invocations("ticket")) < 2 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    finally:
        queue.close()
    deployment.runner("ticket")
    answers = await asyncio.gather(*synchronous)
    assert [answer.status_code for answer in answers] == [200, 200]
    assert [answer.json()["outputs"]["y"][0][0] for answer in answers] == [0.0, 0.0]
    tickets = []
    for invocation_id in backlog:
        response = await result(client, invocation_id)
        assert response.status_code == 200, response.text
        tickets.append(response.json()["outputs"]["y"][0][0])
    assert tickets.count(0.0) == 2  # the slots the synchronous ones left in the first batch
    assert max(collections.Counter(tickets).values()) <= 4


async def test_another_gateway_serves_the_result(client: httpx.AsyncClient, deployment: Deployment) -> None:
    """Accepted by a gateway that then dies; computed after; fetched through another."""
    accepting = deployment.gateway()
    await wait_http(accepting)
    invocation_id = await submit(client, "/v1/functions/relay", base=accepting)
    process = deployment.gateways.pop(accepting)
    process.kill()
    process.wait(timeout=10)
    deployment.runner("relay")
    response = await result(client, invocation_id)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"]["y"] == [[1.0, 2.0]]


async def test_cli_submits_and_fetches(deployment: Deployment) -> None:
    await wait_http(deployment.base)

    def fngate(*argv: str) -> subprocess.CompletedProcess[str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("FNGATE_")}
        env["FNGATE_API_KEY"] = deployment.user
        return subprocess.run(
            [sys.executable, "-m", "fngate.cli.main", *argv, "--gateway", deployment.base],
            capture_output=True, text=True, timeout=120, cwd=ROOT, check=False, env=env,
        )  # fmt: skip

    submitted = await asyncio.to_thread(fngate, "invoke", "echo", '{"x": [[3.0, 4.0]]}', "--async")
    assert submitted.returncode == 0, submitted.stderr
    invocation_id = submitted.stdout.strip()
    fetched = await asyncio.to_thread(fngate, "result", invocation_id, "--wait", "--timeout-s", "60")
    assert fetched.returncode == 0, fetched.stderr
    assert json.loads(fetched.stdout)["outputs"]["y"] == [[3.0, 4.0]]
    unknown = await asyncio.to_thread(fngate, "result", "0" * 32)
    assert unknown.returncode == 2
    assert "404" in unknown.stderr


async def test_claimed_and_dead_lettered_at_the_async_level(
    client: httpx.AsyncClient, deployment: Deployment
) -> None:
    """What a runner that died left unacknowledged at the asynchronous level is claimed and run by
    another; one that ran too often (every runner that ran it died) is dead-lettered and fails with
    model_failed."""
    survivor = await submit(client, "/v1/functions/held")
    poisoned = await submit(client, "/v1/functions/held")
    stream = keys.invocations("held", keys.ASYNC)
    redis = clients.connect_sync(deployment.redis_url)
    try:
        with contextlib.suppress(ResponseError):  # BUSYGROUP: a runner made it
            redis.xgroup_create(stream, keys.RUNNER_GROUP, id="0", mkstream=True)
        # A runner that read both and died (nothing of ours runs here: a client of the group).
        read: Any = redis.xreadgroup(keys.RUNNER_GROUP, "dead-runner", {stream: ">"}, count=10)
        entries = [entry_id for entry_id, _ in read[0][1]]
        assert len(entries) == 2
        for _ in range(4):  # both delivered over and over: that alone counts for nothing
            redis.xclaim(stream, keys.RUNNER_GROUP, "dead-runner", 0, entries)
        # The second ran alone twice besides its first delivery, its runner dying each time
        # (runner.reclaim notes each such run): three runs, max_deliveries.
        redis.hset(entry_runs(stream), entries[1].decode(), 2)
        deployment.runner("held", FNGATE_CLAIM_IDLE_MS="200")
        ran = await result(client, survivor)
        assert ran.status_code == 200, ran.text
        assert ran.json()["outputs"]["y"] == [[1.0, 2.0]]
        failed = await result(client, poisoned)
        assert failed.status_code == 500
        assert failed.json()["code"] == "model_failed"
        assert failed.headers["x-fngate-state"] == "failed"
        assert redis.xlen(keys.dead_letters("held")) == 1
    finally:
        redis.close()


async def test_a_submission_wakes_a_pool_at_zero(
    client: httpx.AsyncClient, deployment: Deployment, tmp_path: Path
) -> None:
    """The local scaler of `fngate up`, for the pool `woken` alone (no runner of it yet): an
    asynchronous submission starts one, which runs it."""
    redis = aioredis.from_url(deployment.redis_url)
    source = function_source(str(deployment.repo), redis)

    async def pools() -> dict[str, PoolSpec]:
        return {name: spec for name, spec in pool_specs(await source()).items() if name == "woken"}

    env = child_env(deployment.redis_url, deployment.repo, FNGATE_RESCAN_S="0.5")
    scaler = LocalScaler(redis, pools, env, 30.0, tmp_path, poll_s=0.2)
    stopping = asyncio.Event()
    scaling = asyncio.create_task(scaler.run(stopping))
    try:
        await asyncio.sleep(0.5)  # a first look at the pools: nothing to start
        assert [count for _at, pool, count in scaler.timeline if pool == "woken"] == []
        invocation_id = await submit(client, "/v1/functions/woken")
        response = await result(client, invocation_id)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"]["y"] == [[1.0, 2.0]]
        assert [count for _at, pool, count in scaler.timeline if pool == "woken"][:1] == [1]
    finally:
        stopping.set()
        await asyncio.wait_for(scaling, 60)
        await redis.aclose()


@on_cluster_too
@pytest.mark.parametrize("callback_receiver", [0], indirect=True)
async def test_a_pipeline_answers_asynchronously_like_a_function(
    client: httpx.AsyncClient, callback_receiver: tuple[CallbackReceiver, str]
) -> None:
    """`chain` (echo, then echo again): 202 and a Location, the result in both shapes, a callback
    carrying what GET answers, and an Idempotency-Key that answers the first invocation again."""
    receiver, url = callback_receiver
    body = {"inputs": {"x": [[5.0, 6.0]]}}
    headers = {"X-Callback-Url": url, "Idempotency-Key": "chain-1"}
    invocation_id = await submit(client, "/v1/functions/chain", body, **headers)
    again = await client.post(
        "/v1/functions/chain", json=body, headers={"Prefer": "respond-async", **headers}
    )
    assert again.status_code == 202 and again.json()["id"] == invocation_id
    assert again.headers["x-fngate-idempotent-replay"] == "true"
    response = await result(client, invocation_id)
    assert response.status_code == 200, response.text
    assert response.headers["x-fngate-state"] == "done"
    assert response.json()["outputs"]["y"] == [[5.0, 6.0]]
    [(callback_headers, callback_body)] = await calls(receiver, 1)
    assert callback_headers["x-fngate-invocation"] == invocation_id
    assert callback_headers["x-fngate-state"] == "done"
    assert callback_body == response.content

    v2 = {"id": "p-18", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [7, 8]}]}
    response = await result(client, await submit(client, "/v2/models/chain/infer", v2))
    assert response.status_code == 200, response.text
    doc = response.json()
    assert (doc["model_name"], doc["id"]) == ("chain", "p-18")
    assert doc["outputs"][0]["name"] == "y" and doc["outputs"][0]["data"] == [7.0, 8.0]


@on_cluster_too
async def test_a_pipeline_cancelled_before_its_first_steps_start(
    client: httpx.AsyncClient, deployment: Deployment
) -> None:
    """`waiting` starts with two steps whose functions have no runner: both wait at the
    asynchronous level (synchronous traffic of those functions goes first), and a cancellation
    takes both out of their queues (on a cluster, each in its function's slot)."""
    invocation_id = await submit(client, "/v1/functions/waiting")
    streams = [keys.invocations(name, keys.ASYNC) for name in ("dormant", "resting")]
    queue = clients.connect_sync(deployment.redis_url)
    try:
        assert [queue.xlen(stream) for stream in streams] == [1, 1]
        assert queue.xlen(keys.invocations("dormant")) == 0  # nothing at the synchronous level
        pending = await client.get(f"/v1/invocations/{invocation_id}")
        assert pending.status_code == 202 and pending.json()["state"] == "queued"
        cancelled = await client.delete(f"/v1/invocations/{invocation_id}")
        assert cancelled.status_code == 200, cancelled.text
        assert [queue.xlen(stream) for stream in streams] == [0, 0]
    finally:
        queue.close()
    gone = await client.get(f"/v1/invocations/{invocation_id}")
    assert gone.status_code == 410


@on_cluster_too
async def test_a_pipeline_whose_other_first_step_runs_is_not_cancelled(
    client: httpx.AsyncClient, deployment: Deployment
) -> None:
    """`straddle` starts with a step no runner serves (`unheard`) and one that a runner takes
    (`slow`, 1.5 s a batch): once the second is taken, a cancellation is too late (409 'running'),
    and the first stays queued, its pipeline still pending."""
    invocation_id = await submit(client, "/v1/functions/straddle")
    waiting, taken = (keys.invocations(name, keys.ASYNC) for name in ("unheard", "slow"))
    queue = clients.connect_sync(deployment.redis_url)
    try:
        deadline = time.monotonic() + 30
        while queue.xlen(taken) > 0 and queue.xpending(taken, keys.RUNNER_GROUP)["pending"] == 0:
            assert time.monotonic() < deadline, "no runner took the step of `slow`"
            await asyncio.sleep(0.05)
        late = await client.delete(f"/v1/invocations/{invocation_id}")
        assert late.status_code == 409, late.text
        assert late.json()["state"] == "running"
        assert queue.xlen(waiting) == 1
    finally:
        queue.close()
    pending = await client.get(f"/v1/invocations/{invocation_id}")
    assert pending.status_code == 202 and pending.json()["state"] in ("queued", "running")


@pytest.mark.parametrize("callback_receiver", [0], indirect=True)
async def test_a_pipelines_failing_step_and_its_deadline_reach_the_callback(
    client: httpx.AsyncClient, callback_receiver: tuple[CallbackReceiver, str]
) -> None:
    """`doomed` fails at its second step; `overdue` has async_timeout_s 1 and its second step takes
    1.5 s, so its third would start after the deadline and is not run (its first step is quick: a
    pipeline whose first step alone could not make the deadline is refused at submission). Each
    callback carries the error naming the step, as GET answers it."""
    receiver, url = callback_receiver
    warm = await client.post("/v1/functions/slow", json=ROW)  # loaded now: `wait` starts at once
    assert warm.status_code == 200, warm.text
    doomed = await submit(client, "/v1/functions/doomed", **{"X-Callback-Url": url})
    overdue = await submit(client, "/v1/functions/overdue", **{"X-Callback-Url": url})
    delivered = {
        headers["x-fngate-invocation"]: (headers, body) for headers, body in await calls(receiver, 2)
    }
    expected = {
        doomed: ("500", "model_failed", "check", "refuse"),
        overdue: ("504", "deadline_exceeded", "then", "echo"),
    }
    for invocation_id, (status, code, step, function) in expected.items():
        headers, body = delivered[invocation_id]
        assert (headers["x-fngate-state"], headers["x-fngate-status"]) == ("failed", status)
        error = json.loads(body)
        assert error["code"] == code
        assert error["error"].startswith(f"step '{step}' ({function} v1): "), error
        fetched = await result(client, invocation_id)
        assert str(fetched.status_code) == status
        assert fetched.content == body
