"""A local folder as the repository: deploy, a new version rolled out without a failed
invocation (make before break), `fngate ls`, `fngate rm`."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from tests.e2e.deployments import ROOT, cli, invoke, runner_env, scale_function, wait_index


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
        removed = await cli("rm", "scale", *flags, "--grace-s", "0.2")
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
