"""KEDA cannot run here, but what it asks Redis can: the rendered ScaledObject's redis-streams
triggers, queried as KEDA 2.x queries them (keda_scaler), against a real Redis before a deploy,
after it, under load from real runner processes, after the queue drains, and after cancels,
expiries and dead letters. None may fail (KEDA scales nothing while a trigger fails), idle must
mean zero runners, a backlog the pool's maximum, a busy runner with nothing waiting one runner, not
two, and anything queued at least one runner, whatever was deleted from the stream before."""

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
from keda_scaler import NIL_LAG, Decision, Trigger, decide

from fngate import k8s, keys
from fngate.manifest import FunctionManifest, load_manifest
from tests.conftest import free_socket

CROWD = ROOT / "tests" / "functions" / "crowd"
"""A Python function (y = 2x) with max_batch_size 4 and max_replicas 3, PROBE_SLEEP_S per batch."""
CALLS = 24
BATCH_S = 0.5
IDLE = {"length-crowd": 0, "lag-crowd": 0, "length-crowd-async": 0, "lag-crowd-async": 0}
"""Every trigger, the asynchronous level's included, at zero."""


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
    command = [sys.executable, "-m", "fngate.cli.main", "deploy", str(manifest_file), "--repo", str(repo)]
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


def test_no_trigger_fails_before_a_deploy(client: redis.Redis, crowd: FunctionManifest) -> None:
    assert scaled_object(crowd, deployed=()) is None  # and no pool before it is listed as deployed
    # Were it rendered, KEDA's queries against a Redis that has never seen the function: no stream,
    # no group. None fails (XLEN and the lag of a missing stream are 0), so the pool could go to zero.
    rendered = scaled_object(crowd, deployed=("crowd",))
    assert rendered is not None
    assert decide(rendered, client) == Decision(IDLE, 0)


@dataclasses.dataclass
class Run:
    """One pass from deploy through load to drain: the ScaledObject and KEDA's view at each step."""

    scaled_object: dict[str, Any]
    after_deploy: Decision
    idle_runner: Decision
    under_load: list[Decision]
    drained: Decision
    held: list[tuple[int, int]]
    """Under load, the length and lag of crowd's stream read together (one MULTI): KEDA reads them
    one after the other, so a decision's pair can straddle a batch being read."""


@dataclasses.dataclass
class Deployed:
    repo: Path
    scaled_object: dict[str, Any]


@pytest.fixture
def deployed(crowd: FunctionManifest, redis_url: str, tmp_path: Path) -> Deployed:
    """crowd deployed (`fngate deploy`) to a folder repository, and its rendered ScaledObject."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(CROWD, tmp_path / "crowd")
    deploy(tmp_path / "crowd" / "function.yaml", repo, redis_url)
    rendered = scaled_object(crowd, deployed=("crowd",))
    assert rendered is not None
    return Deployed(repo, rendered)


@pytest.fixture
def run(
    client: redis.Redis,
    deployed: Deployed,
    gateway_process: Callable[..., str],
    runner_process: Callable[..., subprocess.Popen[bytes]],
) -> Run:
    repo, rendered = deployed.repo, deployed.scaled_object
    # Deployed, no runner yet: KEDA's queries against what `fngate deploy` made.
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
    held: list[tuple[int, int]] = []
    length = next(
        Trigger.from_object(trigger)
        for trigger in rendered["spec"]["triggers"]
        if trigger["name"] == "length-crowd"
    )
    with concurrent.futures.ThreadPoolExecutor(CALLS) as pool:
        calls = [pool.submit(invoke, gateway, float(row)) for row in range(CALLS)]
        while not all(call.done() for call in calls):
            under_load.append(decide(rendered, client))
            held.append(length_and_lag(client, length.stream))
            time.sleep(0.05)
        assert [call.result() for call in calls] == [200] * CALLS

    wait_for(lambda: decide(rendered, client).replicas == 0, 30, "the queue to drain")
    return Run(rendered, after_deploy, idle_runner, under_load, decide(rendered, client), held)


def length_and_lag(client: redis.Redis, stream: str) -> tuple[int, int]:
    """The stream's length and its runners' group's lag, at one instant."""
    with client.pipeline(transaction=True) as pipe:
        pipe.xlen(stream)
        pipe.xinfo_groups(stream)
        count, groups = pipe.execute()
    lag = next(
        (
            int(group.get("lag") or 0)
            for group in groups
            if group["name"] in (keys.RUNNER_GROUP, keys.RUNNER_GROUP.encode())
        ),
        0,
    )
    return int(count), lag


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
    # Runners hold entries read ahead: the length counts them beside the lag.
    assert any(count["length-crowd"] > max(count["lag-crowd"], 0) for count in counts), counts
    # Drained: nothing waits, nothing is pending, the pool goes back to zero.
    assert run.drained == Decision(IDLE, 0)


def test_a_busy_runner_counts_as_one_runner(run: Run, crowd: FunctionManifest) -> None:
    # The idle runner held nothing; under load, the instants where nothing waited undelivered (lag
    # 0) measure what busy runners hold: the length then asks for one runner per busy runner at most.
    _, length_target = k8s.targets(crowd, k8s.Options())
    held = [count for count, lag in run.held if lag == 0]
    assert held, "no sample with the backlog delivered"
    assert max(math.ceil(count / length_target) for count in held) <= 1, held


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


def test_cancels_expiries_and_dead_letters_never_leave_work_at_zero_runners(
    client: redis.Redis,
    deployed: Deployed,
    gateway_process: Callable[..., str],
    runner_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    """With no runner, each way an entry leaves its stream ahead of the runners' group (a cancel)
    or behind it (an expired invocation answered, an undecodable entry dead-lettered) must leave
    KEDA's queries asking for a runner as long as anything waits, and for none once it is done."""
    repo, rendered = deployed.repo, deployed.scaled_object
    gateway = gateway_process(FNGATE_REPO=str(repo))
    wait_for(lambda: live(gateway), 30, "the gateway")
    sync, queued = keys.levels("crowd")[0], keys.levels("crowd")[-1]

    # Five asynchronous invocations; the third is cancelled while queued (XDEL ahead of the group).
    ids = [submit_async(gateway, float(row)) for row in range(5)]
    assert httpx.delete(f"{gateway}/v1/invocations/{ids[2]}", timeout=10).status_code == 200
    cancelled = decide(rendered, client)
    assert cancelled.counts["length-crowd-async"] == 4
    # Redis cannot compute the lag across the deleted entry and KEDA reads its nil as -1; a pending
    # trigger would read 0: neither is active, and a pool watched by those two alone stays at zero.
    assert cancelled.counts["lag-crowd-async"] == NIL_LAG
    pending = Trigger("pending", queued, keys.RUNNER_GROUP, 8, 0, "pending")
    assert not pending.is_active(pending.count(client))
    assert cancelled.replicas >= 1

    # Sync invocations that expire unanswered (their entries stay for a runner to answer 504), and
    # an entry no runner can decode (dead-lettered when read).
    for row in range(3):
        body = {"inputs": {"x": [[float(row), 0.0, 0.0, 0.0]]}, "timeout_ms": 50}
        assert httpx.post(f"{gateway}/v1/functions/crowd", json=body, timeout=10).status_code == 504
    client.xadd(sync, {b"h": b"not json", b"b": b""})
    waiting = decide(rendered, client)
    assert waiting.counts["length-crowd"] == 4 and waiting.replicas >= 1

    # A runner answers all of it; then nothing is asked for, and the runner stops (KEDA's zero).
    runner = runner_process(FNGATE_REPO=str(repo), FNGATE_POOL="crowd", PROBE_SLEEP_S="0")
    wait_for(lambda: decide(rendered, client).replicas == 0, 60, "the runner to drain the queue")
    assert client.xlen(keys.dead_letters("crowd")) == 1
    states = [httpx.get(f"{gateway}/v1/invocations/{id_}?view=state", timeout=10).json() for id_ in ids]
    assert [state["state"] for state in states] == ["done", "done", "cancelled", "done", "done"]
    runner.terminate()
    assert runner.wait(timeout=60) == 0

    # After all those deletions, a new invocation wakes the pool again.
    submit_async(gateway, 9.0)
    assert decide(rendered, client).replicas >= 1


def submit_async(base: str, value: float) -> str:
    body = {"inputs": {"x": [[value, 0.0, 0.0, 0.0]]}}
    response = httpx.post(
        f"{base}/v1/functions/crowd", json=body, headers={"Prefer": "respond-async"}, timeout=10
    )
    assert response.status_code == 202, response.text
    return str(response.json()["id"])
