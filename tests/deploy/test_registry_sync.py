"""Deploying from a workstation that cannot reach the cluster's Redis: `fngate deploy --no-registry`
writes the S3 repository only, and the rendered registry-sync job (`fngate ls --sync` as the
deployer, inside the cluster) records the function and makes its stream and runner group."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from deploy_files import ROOT

from fngate import k8s, keys
from tests.e2e.deployments import scale_function
from tests.s3 import Bucket

UNREACHABLE = "redis://127.0.0.1:9/0"  # discard: nothing listens


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    found = redis.Redis.from_url(redis_url)
    found.flushall()
    yield found
    found.close()


def fngate(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("FNGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "fngate.cli.main", *args],
        capture_output=True,
        text=True,
        env=environment | env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )


def sync_job_env(s3: Bucket, redis_url: str) -> tuple[list[str], dict[str, str]]:
    """The registry-sync job's arguments and environment as rendered, its Secret filled in."""
    objects = k8s.render([], k8s.Options(repo=s3.repo))
    cron = next(obj for obj in objects if obj["metadata"]["name"] == k8s.SYNC_JOB)
    (container,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item["value"] for item in container["env"] if "value" in item}
    secrets = {item["name"] for item in container["env"] if "valueFrom" in item}
    assert secrets == {"FNGATE_REDIS_URL"}
    return container["args"], env | {"FNGATE_REDIS_URL": redis_url} | s3.env


def groups(client: redis.Redis, function: str) -> list[str]:
    try:
        found = client.xinfo_groups(keys.invocations(function))
    except redis.ResponseError:
        return []
    return [group["name"].decode() for group in found]


def test_upload_from_a_workstation_then_sync_inside_the_cluster(
    s3: Bucket, redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    manifest = scale_function(tmp_path / "scale", "scale", 2.0)
    uploaded = fngate(
        "deploy", str(manifest), "--repo", s3.repo, "--redis", UNREACHABLE, "--no-registry", env=s3.env
    )
    assert uploaded.returncode == 0, uploaded.stderr
    assert "uploaded scale version 1" in uploaded.stdout and "fngate ls --sync" in uploaded.stdout
    assert s3.client().list_objects_v2(Bucket=s3.name, Prefix=s3.key("scale", "1"))["KeyCount"] > 0
    assert not client.hexists(keys.registry(), "scale")  # nothing recorded yet: no runner would see it

    args, env = sync_job_env(s3, redis_url)
    synced = fngate(*args, env=env)
    assert synced.returncode == 0, synced.stderr
    assert "scale" in synced.stdout
    assert client.hexists(keys.registry(), "scale")
    assert groups(client, "scale") == [keys.RUNNER_GROUP]  # KEDA's XPENDING answers from now on

    # Run again (a schedule, a second try): nothing changes, nothing fails (BUSYGROUP is fine).
    again = fngate(*args, env=env)
    assert again.returncode == 0, again.stderr
    assert groups(client, "scale") == [keys.RUNNER_GROUP]


def test_sync_fails_visibly_when_redis_is_unreachable(s3: Bucket, tmp_path: Path) -> None:
    manifest = scale_function(tmp_path / "scale", "scale", 2.0)
    assert fngate("deploy", str(manifest), "--repo", s3.repo, "--no-registry", env=s3.env).returncode == 0
    done = fngate("ls", "--sync", "--repo", s3.repo, "--redis", UNREACHABLE, env=s3.env)
    assert done.returncode == 1  # a Job that did nothing must not report success
    assert "unreachable" in done.stderr


def test_deploy_with_the_registry_in_reach_makes_the_group_at_once(
    s3: Bucket, redis_url: str, client: redis.Redis, tmp_path: Path
) -> None:
    manifest = scale_function(tmp_path / "scale", "scale", 2.0)
    done = fngate("deploy", str(manifest), "--repo", s3.repo, "--redis", redis_url, env=s3.env)
    assert done.returncode == 0, done.stderr
    assert client.hexists(keys.registry(), "scale")
    assert groups(client, "scale") == [keys.RUNNER_GROUP]
