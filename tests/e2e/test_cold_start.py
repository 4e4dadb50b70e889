"""Cold starts (docs/cold-start.md): the loading rule (invocations that arrive while their model
loads wait for the load, up to its load_timeout_s, before their own deadline starts, so the first
invocation of a function whose load outlasts its timeout_ms is answered under default settings), a
standby runner, `fngate deploy --warm`, and runners that prefetch a version deployed while they run."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis as sync_redis
import redis.asyncio as aioredis
from tritonclient.grpc import service_pb2

from fngate import apikeys, keys
from fngate.registry import LOADING, read_runners
from fngate.up.scaler import LocalScaler
from runner.lifecycle import PREFETCH_MIN_BYTES
from tests.conftest import ROOT, child_env, free_port, wait_http
from tests.e2e.deployments import cli, runner_env, scale_function
from tests.e2e.test_scale_to_zero import scaler, wait_until
from tests.s3 import Bucket

__all__ = ["scaler"]

ROW = [1.0, 2.0, 3.0, 4.0]


async def test_invocations_that_arrive_while_the_model_loads_are_answered(
    serve_gateway: Callable[..., Any], scaler: Callable[..., Any]
) -> None:
    base = await serve_gateway()
    await scaler()
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        # No runner yet: the pool wakes, the runner starts and the model loads for 3 s, three
        # times the function's timeout_ms; every invocation queued meanwhile is answered.
        first = await asyncio.gather(
            *(client.post("/v1/functions/slowload", json={"inputs": {"x": [ROW]}}) for _ in range(3))
        )
        for response in first:
            assert response.status_code == 200, response.text
            assert response.json()["outputs"]["y"] == [[2.0, 4.0, 6.0, 8.0]]

        # The wait is bounded: with load_timeout_s (0.5 s) shorter than the load, the deadline
        # starts at the bound and passes before the model is ready.
        late = await client.post("/v1/functions/impatient", json={"inputs": {"x": [ROW]}})
        assert late.status_code == 504, late.text
        assert late.json()["code"] == "deadline_exceeded"
        assert "load_timeout_s" in late.json()["error"]


@pytest.fixture
async def standby_scaler(scaler: Callable[..., Any]) -> LocalScaler:
    """The local scaler of `fngate up`, with its standby runner, in this event loop."""
    found: LocalScaler = await scaler(idle_shutdown_s=30.0, standby=True)
    return found


async def runner_pids(redis: aioredis.Redis) -> set[int]:
    """Runners with a live heartbeat (their names end in -{pid}-{suffix})."""
    names = await redis.zrange(keys.runners(), 0, -1)
    return {int(name.decode().rsplit("-", 2)[-2]) for name in names}


async def test_a_standby_runner_serves_the_next_pool_that_wakes_and_is_replaced(
    serve_gateway: Callable[..., Any], standby_scaler: LocalScaler, redis: aioredis.Redis
) -> None:
    base = await serve_gateway()

    async def standing_by() -> bool:
        return standby_scaler.standby_pid is not None

    await wait_until(standing_by, 30, "the standby runner to start")
    standby = standby_scaler.standby_pid
    assert standby not in await runner_pids(redis)  # no pool, no heartbeat: it waits
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        response = await client.post("/v1/functions/brief", json={"inputs": {"input": [[0.5] * 16]}})
        assert response.status_code == 200, response.text
    assert standby in await runner_pids(redis)  # it serves the pool that woke

    async def replaced() -> bool:
        return standby_scaler.standby_pid not in (None, standby)

    await wait_until(replaced, 30, "the next standby runner to start")


async def test_no_standby_runner_starts_while_a_model_loads(
    serve_gateway: Callable[..., Any], standby_scaler: LocalScaler, redis: aioredis.Redis
) -> None:
    """The next standby's imports would take CPU from the cold start it follows: it waits until no
    runner reports a model LOADING."""
    base = await serve_gateway()

    async def standing_by() -> bool:
        return standby_scaler.standby_pid is not None

    await wait_until(standing_by, 30, "the standby runner to start")
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        call = asyncio.create_task(client.post("/v1/functions/slowload", json={"inputs": {"x": [ROW]}}))
        seen_loading = 0
        while not call.done():  # the model loads for 3 s on the runner that was the standby
            views = await read_runners(redis)
            if any(state.state == LOADING for view in views for state in view.models.values()):
                seen_loading += 1
                assert standby_scaler.standby_pid is None, "a standby started during the load"
            await asyncio.sleep(0.1)
        response = await call
        assert response.status_code == 200, response.text
    assert seen_loading >= 5
    await wait_until(standing_by, 30, "the next standby runner, after the load")


@pytest.mark.parametrize("standby", [False, True], ids=["started", "standby"])
async def test_a_runner_started_past_the_deadline_answers_what_its_gateway_waits_for(
    gateway_process: Callable[..., str], scaler: Callable[..., Any], redis: aioredis.Redis, standby: bool
) -> None:
    """The scaler reads a wake only after the invocation's deadline (1 s): its loop, this test's, is
    held. The gateway heard a scaler listen, so it waits on past the deadline for the start; the
    runner started (or the standby handed the pool) counts the invocation's wait from its queueing,
    which the gateway recorded with the wake, and answers it instead of expiring it."""
    base = gateway_process()
    await wait_http(base)
    found: LocalScaler = await scaler(idle_shutdown_s=30.0, standby=standby)

    async def listening() -> bool:
        [(_, subscribers)] = await redis.pubsub_numsub(keys.wake_channel())
        return bool(subscribers) and (not standby or found.standby_pid is not None)

    await wait_until(listening, 30, "the scaler to listen for wakes")
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        sent = thread.submit(
            httpx.post, f"{base}/v1/functions/slowload", json={"inputs": {"x": [ROW]}}, timeout=60
        )
        time.sleep(1.5)  # noqa: ASYNC251 (holds the scaler's loop, this one, past the timeout_ms)
        response = await asyncio.wrap_future(sent)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"]["y"] == [[2.0, 4.0, 6.0, 8.0]]


async def test_deploy_warm_has_a_runner_load_the_new_version(
    redis_url: str,
    redis: aioredis.Redis,
    runner_process: Callable[..., Any],
    gateway_process: Callable[..., str],
    tmp_path: Path,
) -> None:
    repository = tmp_path / "repository"
    runner_process(FNGATE_REPO=str(repository), FNGATE_RESCAN_S="30")
    manifest = scale_function(tmp_path / "scale", "scale", 2.0)
    deployed = await cli("deploy", str(manifest), "--repo", str(repository), "--redis", redis_url, "--warm")
    assert deployed.returncode == 0, deployed.stderr
    assert "scale version 1 is loaded" in deployed.stdout
    listed = await cli("ls", "--repo", str(repository), "--redis", redis_url)
    assert listed.returncode == 0, listed.stderr
    assert "READY" in next(line for line in listed.stdout.splitlines() if line.startswith("scale "))

    # Through a gateway's API: the load is model control, for an admin key.
    base = gateway_process(FNGATE_REPO=str(repository), FNGATE_AUTH="true", FNGATE_AUTH_REFRESH_S="0.2")
    await wait_http(base)
    with sync_redis.Redis.from_url(redis_url) as client:
        key, _ = apikeys.create(client, ["deploy", "admin"])
    env = {"FNGATE_API_KEY": key}
    again = await cli("deploy", str(manifest), "--gateway", base, "--warm", env=env)
    assert again.returncode == 0, again.stderr
    assert "scale is loaded" in again.stdout


async def test_a_runner_prefetches_a_version_deployed_while_it_runs(
    s3: Bucket, redis_url: str, redis: aioredis.Redis, runner_process: Callable[..., Any], tmp_path: Path
) -> None:
    artifacts = tmp_path / "artifacts"
    runner_process(**runner_env(s3.repo, artifacts, s3.env))

    async def serving() -> bool:
        return bool(await runner_pids(redis))

    await wait_until(serving, 30, "the runner to start")
    manifest = scale_function(tmp_path / "scale", "scale", 3.0)
    weights = os.urandom(PREFETCH_MIN_BYTES)  # large enough to be worth fetching ahead
    (manifest.parent / "weights.bin").write_bytes(weights)
    deployed = await cli("deploy", str(manifest), "--repo", s3.repo, "--redis", redis_url)
    assert deployed.returncode == 0, deployed.stderr

    async def fetched() -> bool:
        return (artifacts / "blobs" / hashlib.sha256(weights).hexdigest()).is_file()

    await wait_until(fetched, 30, "the new version's files in the runner's artifact cache")
    assert s3.server.count("GET", s3.key("scale", "1", "factor.txt")) == 1  # before any invocation


def test_a_standby_runner_of_an_s3_repository_prepares_boto3_and_waits_for_its_pool(
    s3: Bucket, redis_url: str, repo: Path
) -> None:
    """A standby runner loads boto3's S3 model while it waits (the repository is the same for any
    pool), and still waits for its assignment: without one it leaves cleanly."""
    env = child_env(redis_url, repo, **s3.env, FNGATE_REPO=s3.repo, PYTHONPROFILEIMPORTTIME="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "runner", "--standby"],
        env=env,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        # -X importtime's lines (on stderr) show what it imported before it reads its stdin.
        _, errors = process.communicate(b"", timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, errors.decode()[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in errors.decode().splitlines() if "|" in line}
    assert "botocore.client" in imported and "boto3" in imported


def phases(timing: str | None) -> dict[str, float]:
    """A Server-Timing value's phases, in order, in milliseconds."""
    assert timing, "no Server-Timing on an answer that paid a cold start"
    return {name: float(ms) for name, ms in re.findall(r"(\w+);dur=([\d.]+)", timing)}


def adds_up(found: dict[str, float], took_ms: float) -> None:
    """The phases run from the queue entry's time to the batch's end: never more than the client
    waited, and all of it but the way in and out, which on a loaded machine the client's own
    scheduling can stretch by a few hundred ms (once seen: 265 ms of 4,868 in a full CI run)."""
    assert list(found) == ["start", "queue", "fetch", "load", "exec"], found
    total = sum(found.values())
    assert 0.9 * took_ms <= total <= 1.02 * took_ms, (found, took_ms)


async def test_an_answer_that_paid_a_cold_start_says_what_it_waited_for(
    serve_gateway: Callable[..., Any], scaler: Callable[..., Any]
) -> None:
    """From a folder, no runner up: the pool wakes one and the model loads for 3 s. The answer's
    Server-Timing names each phase it waited for, and they add up to the latency the client measured
    (adds_up); a warm answer has none."""
    base = await serve_gateway()
    await scaler()
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        began = time.perf_counter()
        cold = await client.post("/v1/functions/slowload", json={"inputs": {"x": [ROW]}})
        took_ms = (time.perf_counter() - began) * 1000
        assert cold.status_code == 200, cold.text
        found = phases(cold.headers.get("server-timing"))
        adds_up(found, took_ms)
        assert found["start"] > 0 and found["load"] >= 2900, found  # its model takes 3 s to load
        warm = await client.post("/v1/functions/slowload", json={"inputs": {"x": [ROW]}})
        assert warm.status_code == 200 and "server-timing" not in warm.headers


async def test_a_cold_start_from_s3_is_in_an_rpcs_trailing_metadata(
    s3: Bucket,
    redis_url: str,
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """From S3 over gRPC: a call queued before any runner runs, its function's 24 MiB of files
    fetched by the runner that starts: the phases are in the RPC's trailing metadata, the fetch
    among them, and add up to the client's latency (adds_up)."""
    manifest = scale_function(tmp_path / "weighty", "weighty", 2.0)
    (manifest.parent / "weights.bin").write_bytes(os.urandom(24 * 2**20))
    deployed = await cli("deploy", str(manifest), "--repo", s3.repo, "--redis", redis_url)
    assert deployed.returncode == 0, deployed.stderr
    port = free_port()
    await serve_gateway(repo=s3.repo, grpc_port=port, catalog_refresh_s=0.2)
    request = service_pb2.ModelInferRequest(model_name="weighty")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    request.raw_input_contents.append(struct.pack("<2f", 1.0, 2.0))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            service_pb2.ModelInferRequest.SerializeToString,
            service_pb2.ModelInferResponse.FromString,
        )
        began = time.perf_counter()
        call = infer(request, timeout=60)
        await asyncio.sleep(0.5)  # queued, and no runner yet
        runner_process(**runner_env(s3.repo, tmp_path / "artifacts", s3.env))
        answer = await call
        took_ms = (time.perf_counter() - began) * 1000
        trailing = dict(await call.trailing_metadata() or ())
    assert struct.unpack("<2f", answer.raw_output_contents[0]) == (2.0, 4.0)
    found = phases(trailing.get("server-timing"))
    adds_up(found, took_ms)
    assert found["start"] >= 400 and found["fetch"] > 0, found
