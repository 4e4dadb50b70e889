"""Deploying to S3 (moto's server, reached over HTTP) and serving from it: versions, a canary
split, pinning, unload and reload, bad artifacts, the artifact cache across a runner restart,
removal with invocations still queued."""

from __future__ import annotations

import asyncio
import collections
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis

from fngate import keys
from tests.e2e.deployments import ROOT, ROW, cli, index, invoke, runner_env, scale_function, wait_index
from tests.s3 import Bucket

CANARY_CALLS = 400


async def deploy(s3: Bucket, redis_url: str, manifest: Path) -> subprocess.CompletedProcess[str]:
    return await cli("deploy", str(manifest), "--repo", s3.repo, "--redis", redis_url)


def answered_by(response: httpx.Response, factors: dict[str, float]) -> str:
    """The version a /v1 response names, after checking that this version's model computed it."""
    assert response.status_code == 200, response.text
    body = response.json()
    version: str = body["version"]
    np.testing.assert_allclose(body["outputs"]["y"], [[value * factors[version] for value in ROW]])
    return version


async def test_deploy_canary_pin_unload_reload(
    s3: Bucket,
    redis_url: str,
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    tmp_path: Path,
) -> None:
    base = await serve_gateway(repo=s3.repo, catalog_refresh_s=0.2)
    runner_process(**runner_env(s3.repo, tmp_path / "artifacts", s3.env))
    factors = {"1": 2.0, "2": 3.0}

    first = await deploy(s3, redis_url, scale_function(tmp_path / "v1", "scale", factors["1"]))
    assert first.returncode == 0, first.stderr
    assert "deployed scale version 1" in first.stdout
    assert (
        "curl -s -X POST http://127.0.0.1:8000/v1/functions/scale "
        '-H "Authorization: Bearer $FNGATE_API_KEY" -d \'{"inputs":{"x":[[0.0,0.0]]}}\'' in first.stdout
    )
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert answered_by(await invoke(client, "/v1/functions/scale"), factors) == "1"

        canary = {"policy": "latest", "latest": 2, "traffic": {"1": 90, "2": 10}}
        second = await deploy(s3, redis_url, scale_function(tmp_path / "v2", "scale", factors["2"], canary))
        assert second.returncode == 0, second.stderr
        assert "deployed scale version 2" in second.stdout
        # Version 1 is loaded, so the runner loads version 2 beside it before traffic moves.
        await wait_index(client, {("scale", "1"): "READY", ("scale", "2"): "READY"})
        await invoke(client, "/v2/models/scale/versions/2/infer")  # the gateway knows version 2

        limit = asyncio.Semaphore(16)

        async def call() -> str:
            async with limit:
                return answered_by(await invoke(client, "/v1/functions/scale"), factors)

        seen = collections.Counter(await asyncio.gather(*(call() for _ in range(CANARY_CALLS))))
        assert set(seen) == {"1", "2"}
        # 10% of 400 is 40 with a standard deviation of 6: five of them either side.
        assert 10 <= seen["2"] <= 70, seen

        for version in ("1", "2"):
            pinned = await invoke(client, f"/v2/models/scale/versions/{version}/infer")
            assert pinned.status_code == 200, pinned.text
            assert pinned.json()["model_version"] == version
            assert pinned.json()["outputs"][0]["data"] == [value * factors[version] for value in ROW]
        assert (await invoke(client, "/v2/models/scale/versions/3/infer", wait_s=0)).status_code == 404

        unloaded = await client.post("/v2/repository/models/scale/unload")
        assert unloaded.status_code == 200, unloaded.text
        entries = await index(client)
        for version in ("1", "2"):
            assert entries[("scale", version)]["state"] == "UNAVAILABLE"
            assert entries[("scale", version)]["reason"] == "unloaded"

        # Explicitly unloaded: not ready, and invocations are refused until a load.
        assert (await client.get("/v2/models/scale/ready")).status_code == 400
        refused = await invoke(client, "/v1/functions/scale")
        assert refused.status_code == 503
        assert "unloaded" in refused.json()["error"]

        loaded = await client.post("/v2/repository/models/scale/load")
        assert loaded.status_code == 200, loaded.text
        assert await wait_index(client, {("scale", "1"): "READY", ("scale", "2"): "READY"})
        assert (await client.get("/v2/models/scale/ready")).status_code == 200
        answered_by(await invoke(client, "/v1/functions/scale"), factors)


DAMAGES = ["corrupt", "truncated", "missing", "denied", "down"]
MESSAGES = {
    "corrupt": "does not match",
    "truncated": "bytes where the deploy recorded",
    "missing": "is missing from the repository",
    "denied": "access denied",
    "down": "S3 is unavailable",
}


@pytest.mark.parametrize("damage", DAMAGES)
async def test_bad_artifact_makes_only_its_function_unavailable(
    damage: str,
    s3: Bucket,
    redis_url: str,
    redis: aioredis.Redis,
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    tmp_path: Path,
) -> None:
    base = await serve_gateway(repo=s3.repo, catalog_refresh_s=0.2)
    runner_process(**runner_env(s3.repo, tmp_path / "artifacts", s3.env))
    for name, factor in (("good", 2.0), ("bad", 5.0)):
        result = await deploy(s3, redis_url, scale_function(tmp_path / name, name, factor))
        assert result.returncode == 0, result.stderr
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await invoke(client, "/v1/functions/good")).status_code == 200

        # factor.txt is the one file of "bad" that the artifact cache does not hold already.
        client_s3, key = s3.client(), s3.key("bad", "1", "factor.txt")
        original = client_s3.get_object(Bucket=s3.name, Key=key)["Body"].read()
        if damage == "corrupt":
            client_s3.put_object(Bucket=s3.name, Key=key, Body=original.replace(b"5", b"6"))
        elif damage == "truncated":
            client_s3.put_object(Bucket=s3.name, Key=key, Body=original[: len(original) // 2])
        elif damage == "missing":
            client_s3.delete_object(Bucket=s3.name, Key=key)
        else:
            s3.server.fault = 403 if damage == "denied" else 503

        response = await invoke(client, "/v1/functions/bad")
        assert response.status_code == 503, response.text
        assert "Retry-After" in response.headers
        assert MESSAGES[damage] in response.json()["error"]
        state = (await index(client))[("bad", "1")]
        assert state["state"] == "UNAVAILABLE"
        assert state["reason"].startswith("load-failed: ") and MESSAGES[damage] in state["reason"]
        s3.server.fault = None
        assert (await invoke(client, "/v1/functions/good")).status_code == 200  # still served

        client_s3.put_object(Bucket=s3.name, Key=key, Body=original)
        loaded = await client.post("/v2/repository/models/bad/load")  # a load request retries at once
        assert loaded.status_code == 200, loaded.text
        assert (await invoke(client, "/v1/functions/bad")).status_code == 200
        assert (await client.post("/v2/repository/models/nope/load")).status_code == 404


async def test_nothing_is_uploaded_for_a_manifest_that_fails_validation(
    s3: Bucket, redis_url: str, redis: aioredis.Redis, tmp_path: Path
) -> None:
    broken = scale_function(tmp_path / "broken", "broken", 2.0)
    broken.write_text(broken.read_text().replace("backend: python", "backend: tensorflow"))
    result = await deploy(s3, redis_url, broken)
    assert result.returncode == 2
    assert "model.backend" in result.stderr and "nothing was uploaded" in result.stderr

    stray = scale_function(tmp_path / "stray", "stray", 2.0, {"traffic": {"1": 50, "7": 50}})
    result = await deploy(s3, redis_url, stray)
    assert result.returncode == 2
    assert "versions ['7'] are not served" in result.stderr

    modelless = scale_function(tmp_path / "modelless", "modelless", 2.0)
    (modelless.parent / "model.py").unlink()
    result = await deploy(s3, redis_url, modelless)
    assert result.returncode == 2  # the user's mistake, like the two above
    assert "model.py does not exist" in result.stderr
    writes = [(method, path) for method, path in s3.server.requests if method in ("PUT", "POST", "DELETE")]
    assert writes == [("PUT", f"/{s3.name}")]  # the bucket, made by the fixture


async def test_artifact_cache_survives_a_runner_restart(
    s3: Bucket,
    redis_url: str,
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    tmp_path: Path,
) -> None:
    function = tmp_path / "classifier"
    shutil.copytree(ROOT / "functions" / "classifier", function)
    result = await deploy(s3, redis_url, function / "function.yaml")
    assert result.returncode == 0, result.stderr
    base = await serve_gateway(repo=s3.repo, catalog_refresh_s=0.2)
    env = runner_env(s3.repo, tmp_path / "artifacts", s3.env)
    body = {"inputs": {"input": [[0.1 * i for i in range(16)]]}}
    model_key = s3.key("classifier", "1", "model.onnx")
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        first = runner_process(**env)
        assert (await client.post("/v1/functions/classifier", json=body)).status_code == 200
        assert s3.server.count("GET", model_key) == 1
        first.terminate()
        assert await asyncio.to_thread(first.wait, 30) == 0

        runner_process(**env)
        response = await client.post("/v1/functions/classifier", json=body)
        assert response.status_code == 200, response.text
        assert s3.server.count("GET", model_key) == 1  # the restarted runner read its cache


async def test_removing_a_function_answers_its_queued_invocations(
    s3: Bucket, redis_url: str, redis: aioredis.Redis, serve_gateway: Callable[..., Any], tmp_path: Path
) -> None:
    result = await deploy(s3, redis_url, scale_function(tmp_path / "doomed", "doomed", 2.0))
    assert result.returncode == 0, result.stderr
    base = await serve_gateway(repo=s3.repo, catalog_refresh_s=0.2)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for _ in range(100):
            if (await client.get("/v2/models/doomed")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        body = {"inputs": {"x": [ROW]}}
        queued = asyncio.create_task(client.post("/v1/functions/doomed", json=body))  # no runner: it waits
        for _ in range(200):
            if await redis.exists(keys.invocations("doomed")) and await redis.xlen(
                keys.invocations("doomed")
            ):
                break
            await asyncio.sleep(0.05)
        listed = await cli("ls", "--repo", s3.repo, "--redis", redis_url)
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.split("\n")[1].split() == [
            "doomed",
            "1",
            "yes",
            "100%",
            "UNAVAILABLE",
            "not-loaded",
        ]

        removed = await cli(
            "rm", "doomed", "--repo", s3.repo, "--redis", redis_url, "--grace-s", "0.3", "--yes"
        )
        assert removed.returncode == 0, removed.stderr
        assert "answered 1 queued invocation with not_found" in removed.stdout
        response = await queued
        assert response.status_code == 404
        assert response.json()["error"] == "function 'doomed' was removed"
        await asyncio.sleep(0.5)
        assert (await invoke(client, "/v1/functions/doomed", wait_s=0)).status_code == 404
    listed = await cli("ls", "--repo", s3.repo, "--redis", redis_url)
    assert "doomed" not in listed.stdout
    assert not s3.client().list_objects_v2(Bucket=s3.name, Prefix="prod/doomed/").get("Contents")
