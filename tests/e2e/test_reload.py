"""Live reload: `fngate up --reload` reloads a function whose files change in the repository folder,
make before break (every invocation meanwhile is answered), shows a change that does not load and
keeps the old files serving; the repository extension's `load` of a loaded, changed function
reloads it the same way."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from fngate.process import stop_processes
from tests.conftest import free_socket, wait_http
from tests.e2e import deployments
from tests.e2e.deployments import ROW, scale_function

BROKEN = "raise RuntimeError('not today')\n"


def free_port() -> int:
    with free_socket() as sock:
        port: int = sock.getsockname()[1]
    return port


async def answered(client: httpx.AsyncClient) -> float:
    """The factor the function multiplied by."""
    response = await client.post("/v1/functions/scale", json={"inputs": {"x": [ROW]}})
    assert response.status_code == 200, response.text
    return float(response.json()["outputs"]["y"][0][0]) / ROW[0]


async def until_factor(
    client: httpx.AsyncClient, factor: float, answers: list[float], timeout_s: float = 30
) -> None:
    deadline = time.monotonic() + timeout_s
    while not answers or answers[-1] != factor:
        assert time.monotonic() < deadline, answers[-20:]
        answers.append(await answered(client))


def start_up(repo: Path, port: int, tmp_path: Path) -> subprocess.Popen[bytes]:
    return deployments.start_up(repo, port, tmp_path, "--reload", environ={"FNGATE_RESCAN_S": "0.3"})


async def test_up_reload_reloads_a_changed_function_and_keeps_a_broken_one_serving(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    scale_function(repo / "scale", "scale", 2.0)
    port = free_port()
    log = tmp_path / "up.log"
    up = start_up(repo, port, tmp_path)
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_http(base, timeout_s=60)
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            answers = [await answered(client)]  # loads it: a runner has it from now on
            assert answers == [2.0]
            (repo / "scale" / "factor.txt").write_text("3.0\n")
            await until_factor(client, 3.0, answers)  # every answer meanwhile was a 200
            assert sorted(answers) == answers  # the old files until the new ones were ready
            model = repo / "scale" / "model.py"
            working = model.read_text()
            model.write_text(BROKEN + working)
            deadline = time.monotonic() + 30
            while "the files loaded before serve on" not in log.read_text():  # said by fngate up
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                assert await answered(client) == 3.0  # served on, from the files that loaded
            assert "not today" in log.read_text()
            model.write_text(working)
            (repo / "scale" / "factor.txt").write_text("4.0\n")
            await until_factor(client, 4.0, answers)
    finally:
        stop_processes([up], timeout_s=60)


async def test_load_of_a_loaded_changed_function_reloads_it(
    redis: aioredis.Redis,
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    scale_function(repo / "scale", "scale", 2.0)
    base = await serve_gateway(repo=str(repo))
    await inprocess_runner(repo=str(repo))
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert await answered(client) == 2.0
        (repo / "scale" / "factor.txt").write_text("5.0\n")
        assert await answered(client) == 2.0  # no reload until asked: Triton's explicit mode
        loaded = await client.post("/v2/repository/models/scale/load")
        assert loaded.status_code == 200, loaded.text
        assert await answered(client) == 5.0
        model = repo / "scale" / "model.py"
        model.write_text(BROKEN + model.read_text())
        refused = await client.post("/v2/repository/models/scale/load")
        assert refused.status_code == 503, refused.text
        assert "reload-failed" in refused.json()["error"] and "not today" in refused.json()["error"]
        assert await answered(client) == 5.0  # the files that loaded serve on
