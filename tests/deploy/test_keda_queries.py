"""KEDA cannot run here, but what it asks Redis can: the rendered ScaledObject's redis-streams
triggers, queried as KEDA 2.x queries them (keda_scaler), against a real Redis before a deploy,
after it, under load from real runner processes, and after the queue drains. None may fail (KEDA
scales nothing while a trigger fails), idle must mean zero runners, a backlog the pool's maximum,
and a busy runner with nothing waiting one runner, not two."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from deploy_files import ROOT
from keda_scaler import Decision, Trigger, decide

from fngate import keys
from fngate.manifest import FunctionManifest, load_manifest
from fngate.tools import k8s
from tests.conftest import free_socket

CROWD = ROOT / "tests" / "functions" / "crowd"
"""A Python function (y = 2x) with max_batch_size 4 and max_replicas 3, PROBE_SLEEP_S per batch."""
CALLS = 24
BATCH_S = 0.5


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    found = redis.Redis.from_url(redis_url)
    found.flushall()
    yield found
    found.close()


@pytest.fixture
def crowd() -> FunctionManifest:
    return load_manifest(CROWD / "function.yaml")


def scaled_object(manifest: FunctionManifest, deployed: tuple[str, ...]) -> dict[str, Any] | None:
    objects = k8s.render([manifest], k8s.Options(deployed=deployed, redis_tls=False))
    return next((obj for obj in objects if obj["kind"] == "ScaledObject"), None)


def deploy(manifest_file: Path, repo: Path, redis_url: str) -> None:
    command = [sys.executable, "-m", "fngate.tools.cli", "deploy", str(manifest_file), "--repo", str(repo)]
    done = subprocess.run(
        [*command, "--redis", redis_url],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def test_a_function_never_deployed_gets_no_trigger_since_its_pending_query_fails(
    client: redis.Redis, crowd: FunctionManifest
) -> None:
    assert scaled_object(crowd, deployed=()) is None
    # What KEDA would have met: XPENDING fails while the group does not exist (NOGROUP), so the
    # pool would never scale to zero; the lag query alone copes (0 for a stream not made yet).
    rendered = scaled_object(crowd, deployed=("crowd",))
    assert rendered is not None
    triggers = {t.lag_mode: t for t in map(Trigger.from_object, rendered["spec"]["triggers"])}
    assert triggers[True].count(client) == 0
    with pytest.raises(redis.ResponseError, match="NOGROUP"):
        triggers[False].count(client)


@dataclasses.dataclass
class Run:
    """One pass from deploy through load to drain: the ScaledObject and KEDA's view at each step."""

    scaled_object: dict[str, Any]
    after_deploy: Decision
    idle_runner: Decision
    under_load: list[Decision]
    drained: Decision


@pytest.fixture
def run(
    client: redis.Redis,
    crowd: FunctionManifest,
    redis_url: str,
    tmp_path: Path,
    gateway_process: Callable[..., str],
    runner_process: Callable[..., subprocess.Popen[bytes]],
) -> Run:
    repo = tmp_path / "repo"
    repo.mkdir()
    source = tmp_path / "crowd"
    shutil.copytree(CROWD, source)
    rendered = scaled_object(crowd, deployed=("crowd",))
    assert rendered is not None

    # Deployed, no runner yet: KEDA's queries against what `fngate deploy` made.
    deploy(source / "function.yaml", repo, redis_url)
    after_deploy = decide(rendered, client)  # raises where KEDA would see an error

    # One runner up, nothing queued: it must be ready (Redis answers, it consumes) with no model
    # loaded, or a rollout (and Helm's wait) would never finish.
    status = free_socket()
    status_port = status.getsockname()[1]
    status.close()
    env = {"FNGATE_REPO": str(repo), "FNGATE_POOL": "crowd", "FNGATE_STATUS_PORT": str(status_port)}
    runner_process(**env, PROBE_SLEEP_S=str(BATCH_S))
    wait_for(lambda: bool(client.zcard(keys.runners())), 30, "the runner's heartbeat")
    wait_for(lambda: ready(status_port), 30, "the runner's readiness")
    idle_runner = decide(rendered, client)

    # Load: more than one runner's read-ahead at once, through a real gateway.
    gateway = gateway_process(FNGATE_REPO=str(repo))
    wait_for(lambda: live(gateway), 30, "the gateway")
    under_load: list[Decision] = []
    with concurrent.futures.ThreadPoolExecutor(CALLS) as pool:
        calls = [pool.submit(invoke, gateway, float(row)) for row in range(CALLS)]
        while not all(call.done() for call in calls):
            under_load.append(decide(rendered, client))
            time.sleep(0.05)
        assert [call.result() for call in calls] == [200] * CALLS

    wait_for(lambda: decide(rendered, client).replicas == 0, 30, "the queue to drain")
    return Run(rendered, after_deploy, idle_runner, under_load, decide(rendered, client))


IDLE = {"lag-crowd": 0, "pending-crowd": 0, "lag-crowd-async": 0, "pending-crowd-async": 0}
"""Every trigger, the asynchronous level's included, at zero."""


def test_keda_queries_from_deploy_through_load_to_drain(run: Run, crowd: FunctionManifest) -> None:
    spec = run.scaled_object["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 3)
    lag_target, _ = k8s.targets(crowd, k8s.Options())
    # No trigger failed at any step (decide raises); idle means zero runners.
    assert run.after_deploy == Decision(IDLE, 0)
    assert run.idle_runner.replicas == 0
    counts = [sample.counts for sample in run.under_load]
    # Under backlog the pool asks for its maximum: the lag alone is more than two runners' worth.
    assert max(count["lag-crowd"] for count in counts) > 2 * lag_target, counts
    assert any(sample.replicas == spec["maxReplicaCount"] for sample in run.under_load), counts
    assert any(count["pending-crowd"] > 0 for count in counts), counts
    # Drained: nothing waits, nothing is pending, the pool goes back to zero.
    assert run.drained == Decision(IDLE, 0)


def test_a_busy_runner_counts_as_one_runner(run: Run, crowd: FunctionManifest) -> None:
    _, pending_target = k8s.targets(crowd, k8s.Options())
    held = max(sample.counts["pending-crowd"] for sample in run.under_load)
    assert math.ceil(held / pending_target) <= 1, f"one runner held {held} entries pending"


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def live(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v2/health/live", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def invoke(base: str, value: float) -> int:
    body = {"inputs": {"x": [[value, 0.0, 0.0, 0.0]]}}
    return httpx.post(f"{base}/v1/functions/crowd", json=body, timeout=60).status_code
