"""A local folder as the repository: deploy, a new version rolled out without a failed
invocation (make before break), `fngate ls`, `fngate rm`."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from tests.e2e.deployments import ROOT, cli, index, invoke, runner_env, scale_function, wait_index


async def test_deploy_roll_out_list_and_remove_in_a_folder(
    redis_url: str,
    redis: aioredis.Redis,
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    base = await serve_gateway(repo=str(repo), catalog_refresh_s=0.2)
    runner_process(**runner_env(str(repo), tmp_path / "artifacts"))
    flags = ("--repo", str(repo), "--redis", redis_url)

    first = await cli("deploy", str(scale_function(tmp_path / "v1", "scale", 2.0)), *flags)
    assert first.returncode == 0, first.stderr
    assert "deployed scale version 1 (digest " in first.stdout and f"to {repo}/scale/1/" in first.stdout
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        response = await invoke(client, "/v1/functions/scale")
        assert response.status_code == 200 and response.json()["version"] == "1"

        answers: list[tuple[int, str]] = []
        rolled_out = asyncio.Event()

        async def traffic() -> None:
            while not rolled_out.is_set():
                response = await client.post("/v1/functions/scale", json={"inputs": {"x": [[1.0, 2.0]]}})
                answers.append((response.status_code, response.json().get("version", response.text)))
                if answers[-1][1] == "2" and len(answers) > 5:
                    rolled_out.set()

        during = asyncio.create_task(traffic())
        second = await cli("deploy", str(scale_function(tmp_path / "v2", "scale", 3.0)), *flags)
        assert second.returncode == 0, second.stderr
        await asyncio.wait_for(during, 30)
        assert {status for status, _ in answers} == {200}, answers
        versions = [version for _, version in answers]
        assert versions == sorted(versions)  # version 1 until version 2 was ready, then version 2

        entries = await wait_index(client, {("scale", "2"): "READY", ("scale", "1"): "UNAVAILABLE"})
        assert entries[("scale", "1")]["reason"] == "retired"

        listed = await cli("ls", *flags)
        assert listed.returncode == 0, listed.stderr
        functions, runners = listed.stdout.split("\n\n")
        rows = [line.split() for line in functions.splitlines()]
        assert rows[0] == ["FUNCTION", "VERSION", "SERVED", "TRAFFIC", "STATE", "REASON"]
        assert rows[1:] == [
            ["scale", "1", "no", "-", "UNAVAILABLE", "retired"],
            ["scale", "2", "yes", "100%", "READY"],
        ]
        runner_rows = [line.split() for line in runners.splitlines()]
        assert runner_rows[0] == ["RUNNER", "POOL", "LOADED", "IDLE"]
        assert [row[2] for row in runner_rows[1:]] == ["scale/2"]  # the retired version is gone

        unloaded = await client.post("/v2/repository/models/scale/unload")  # explicit: 503 until a load
        assert unloaded.status_code == 200, unloaded.text
        removed = await cli("rm", "scale", *flags, "--grace-s", "0.2", "--yes")
        assert removed.returncode == 0, removed.stderr
        assert not (repo / "scale").exists()
        # Whether the gateway or the runner notices first, the answer is the same.
        assert (await invoke(client, "/v1/functions/scale", wait_s=0)).status_code == 404

        # Deployed again under the same name, it is a new function: the old unload does not hold it.
        again = await cli("deploy", str(scale_function(tmp_path / "v3", "scale", 4.0)), *flags)
        assert again.returncode == 0, again.stderr
        response = await invoke(client, "/v1/functions/scale")
        assert response.status_code == 200, response.text


async def test_an_example_folder_is_not_deployed_over(tmp_path: Path, redis_url: str) -> None:
    shutil.copytree(ROOT / "functions", tmp_path / "functions")
    manifest = tmp_path / "functions" / "classifier" / "function.yaml"
    result = await cli("deploy", str(manifest), "--repo", str(tmp_path / "functions"), "--redis", redis_url)
    assert result.returncode == 2  # a user error
    assert "holds an unversioned function" in result.stderr
    assert sorted(path.name for path in (tmp_path / "functions" / "classifier").iterdir()) == [
        "build.py",
        "function.yaml",
        "model.onnx",
    ]


async def test_traffic_rollback_and_a_removal_that_would_break_a_pipeline(
    redis_url: str,
    redis: aioredis.Redis,
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    base = await serve_gateway(repo=str(repo), catalog_refresh_s=0.2)
    await inprocess_runner(repo=str(repo), rescan_s=0.3, heartbeat_s=0.5, retire_after_s=1)
    flags = ("--repo", str(repo), "--redis", redis_url)
    for number, factor in ((1, 2.0), (2, 3.0)):
        deployed = await cli("deploy", str(scale_function(tmp_path / f"v{number}", "scale", factor)), *flags)
        assert deployed.returncode == 0, deployed.stderr
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        first = await invoke(client, "/v1/functions/scale")  # loads version 2, the one served
        assert first.status_code == 200 and first.json()["version"] == "2", first.text
        answers: list[tuple[int, str]] = []

        async def traffic() -> None:
            """Until version 1 has answered a few times."""
            while [version for _, version in answers[-3:]] != ["1"] * 3:
                response = await client.post("/v1/functions/scale", json={"inputs": {"x": [[1.0, 2.0]]}})
                answers.append((response.status_code, response.json().get("version", response.text)))

        during = asyncio.create_task(traffic())
        # Back to version 1: loaded beside version 2 (it is loaded) before the traffic moves.
        rolled = await cli("rollback", "scale", *flags)
        assert rolled.returncode == 0, rolled.stderr
        assert "scale: traffic version 1: 100% (was version 2: 100%); serving versions 1" in rolled.stdout
        assert "versions 1 loaded (" in rolled.stdout
        await asyncio.wait_for(during, 30)
        assert {status for status, _ in answers} == {200}, answers
        versions = [version for _, version in answers]
        assert versions == sorted(versions, reverse=True)  # version 2 until version 1 took over
        # A split over stored versions, through the deploy API this time.
        split = await cli("traffic", "scale", "1=50", "2=50", "--gateway", base, env={"FNGATE_API_KEY": "-"})
        assert split.returncode == 0, split.stderr
        await asyncio.sleep(0.5)  # the gateway's next catalog refresh
        seen = {(await invoke(client, "/v1/functions/scale")).json()["version"] for _ in range(40)}
        assert seen == {"1", "2"}
        unknown = await cli("traffic", "scale", "7=100", *flags)
        assert unknown.returncode == 2 and "no stored versions ['7']" in unknown.stderr

        pipeline = tmp_path / "scaled" / "function.yaml"
        pipeline.parent.mkdir()
        pipeline.write_text(SCALED)
        assert (await cli("deploy", str(pipeline), *flags)).returncode == 0
        asked = await cli("rm", "scale", *flags)  # not a terminal: it needs --yes
        assert asked.returncode == 2 and "pass --yes" in asked.stderr
        refused = await cli("rm", "scale", *flags, "--yes")
        assert refused.returncode == 2, refused.stderr
        assert "is a step of pipeline scaled (version 1)" in refused.stderr
        assert (await invoke(client, "/v1/functions/scaled")).status_code == 200
        # The next deploy hands routing back to its manifest's policy (latest: version 3).
        third = await cli("deploy", str(scale_function(tmp_path / "v3", "scale", 4.0)), *flags)
        assert third.returncode == 0, third.stderr
        assert "serving versions 3; traffic version 3: 100%" in third.stdout


SCALED = """name: scaled
inputs: [{name: x, datatype: FP32, shape: [-1, 2]}]
outputs: [{name: y, datatype: FP32, shape: [-1, 2]}]
batching: {max_batch_size: 16, timeout_ms: 20000}
pipeline:
  steps:
    - {name: once, function: scale, inputs: {x: request.x}}
  outputs: {y: once.y}
"""


async def test_the_curl_lines_a_deploy_prints_work(
    redis_url: str,
    redis: aioredis.Redis,
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    tmp_path: Path,
) -> None:
    import redis as sync_redis

    from fngate import apikeys

    repo = tmp_path / "repo"
    repo.mkdir()
    client = sync_redis.Redis.from_url(redis_url)
    key, _ = apikeys.admin_key(client, tmp_path / "admin.key")
    client.close()
    base = await serve_gateway(repo=str(repo), catalog_refresh_s=0.2, auth=True)
    await inprocess_runner(repo=str(repo))
    flags = ("--repo", str(repo), "--redis", redis_url, "--gateway", base)
    deployed = await cli("deploy", str(scale_function(tmp_path / "v1", "scale", 2.0)), *flags)
    assert deployed.returncode == 0, deployed.stderr
    lines = [line.strip() for line in deployed.stdout.splitlines() if line.strip().startswith("curl ")]
    assert len(lines) == 2 and "/v2/models/scale/versions/1/infer" in lines[1], deployed.stdout
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as http:
        assert (await invoke(http, "/v1/functions/scale")).status_code == 200  # the gateway knows it
    for line in lines:
        done = await asyncio.to_thread(
            subprocess.run,
            ["bash", "-c", line.replace("curl -s", "curl -s --fail-with-body", 1)],
            env={**os.environ, "FNGATE_API_KEY": key},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, (line, done.stdout, done.stderr)
        assert "outputs" in done.stdout, done.stdout
    # A version the policy does not serve gets no pinned line that would answer 404.
    pinned = {"policy": "specific", "specific": ["1"]}
    second = await cli("deploy", str(scale_function(tmp_path / "v2", "scale", 3.0, pinned)), *flags)
    assert second.returncode == 0, second.stderr
    assert "/versions/2/infer" not in second.stdout
    assert "version 2 is stored, not served" in second.stdout


async def test_an_unload_confirmed_leaves_no_version_loading(
    redis_url: str, serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path
) -> None:
    """A runner that looks for new versions all the time (rescan_s 10 ms) unloads two versions served
    side by side, five times over: once the unload is answered, neither is loaded nor loading (a pass
    between the two versions' unloads used to load the first again beside the second)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    base = await serve_gateway(repo=str(repo), catalog_refresh_s=0.2)
    await inprocess_runner(repo=str(repo), rescan_s=0.01, heartbeat_s=0.5)
    flags = ("--repo", str(repo), "--redis", redis_url)
    split = {"policy": "latest", "latest": 2, "traffic": {"1": 50, "2": 50}}
    for number, factor, versions in ((1, 2.0, None), (2, 3.0, split)):
        folder = tmp_path / f"v{number}"
        deployed = await cli("deploy", str(scale_function(folder, "scale", factor, versions)), *flags)
        assert deployed.returncode == 0, deployed.stderr
    both = {("scale", "1"): "READY", ("scale", "2"): "READY"}
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await invoke(client, "/v1/functions/scale")).status_code == 200
        for _ in range(5):
            loaded = await client.post("/v2/repository/models/scale/load")
            assert loaded.status_code == 200, loaded.text
            await wait_index(client, both)
            unloaded = await client.post("/v2/repository/models/scale/unload")
            assert unloaded.status_code == 200, unloaded.text
            entries = await index(client)
            assert {entries[key]["state"] for key in both} == {"UNAVAILABLE"}, entries
