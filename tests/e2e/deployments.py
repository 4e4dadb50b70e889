"""Helpers of the deploy tests: a small Python function whose answer shows which version ran, the
CLI run as users run it, and waits on the model repository index."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
SCALE_MODEL = '''"""y = x * the number in factor.txt: each version of a test function answers differently."""

from pathlib import Path

import numpy as np


class Model:
    def __init__(self, directory: Path) -> None:
        self.factor = np.float32((directory / "factor.txt").read_text())

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": inputs["x"] * self.factor}
'''
ROW = [1.0, 2.0]


def scale_function(folder: Path, name: str, factor: float, versions: Mapping[str, Any] | None = None) -> Path:
    """A function folder; returns its manifest's path."""
    folder.mkdir(parents=True)
    manifest: dict[str, Any] = {
        "name": name,
        "model": {"backend": "python", "path": "model.py"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        "batching": {"max_batch_size": 16, "max_queue_delay_us": 0, "timeout_ms": 20000},
    }
    if versions is not None:
        manifest["versions"] = dict(versions)
    (folder / "function.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    (folder / "model.py").write_text(SCALE_MODEL)
    (folder / "factor.txt").write_text(f"{factor}\n")
    return folder / "function.yaml"


def start_up(
    repo: Path, port: int, tmp_path: Path, *extra: str, environ: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`fngate up` on `repo` as a process of its own (its output in tmp_path/up.log): one gateway
    worker, no gRPC, metrics or standby runner, no auth; `extra` flags and `environ` settings added
    (the caller's FNGATE_ settings left out)."""
    command = [sys.executable, "-m", "fngate.cli.main", "up", "--repo", str(repo), "--port", str(port)]
    command += ["--metrics-port", "0", "--state-dir", str(tmp_path / "state"), "--gateway-workers", "1"]
    command += ["--no-standby-runner", "--no-auth", "--grpc-port", "0", *extra]
    env = {key: value for key, value in os.environ.items() if not key.startswith("FNGATE_")}
    with (tmp_path / "up.log").open("wb") as output:
        return subprocess.Popen(
            command,
            env={**env, **(environ or {})},
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


async def cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`fngate ARGS` in a process of its own (AWS settings from this process's environment)."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("FNGATE_")}
    environment.update(env or {})
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "fngate.cli.main", *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=120,
    )


async def invoke(
    client: httpx.AsyncClient, path: str, rows: list[list[float]] | None = None, wait_s: float = 15
) -> httpx.Response:
    """POST a /v1 or V2 body; while the gateway does not know the function yet (404), retry."""
    data = rows or [ROW]
    if path.startswith("/v1/"):
        body: dict[str, Any] = {"inputs": {"x": data}}
    else:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(data), 2], "data": data}]}
    deadline = time.monotonic() + wait_s
    while True:
        response = await client.post(path, json=body)
        if response.status_code != 404 or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.1)


async def index(client: httpx.AsyncClient) -> dict[tuple[str, str], dict[str, str]]:
    response = await client.post("/v2/repository/index")
    assert response.status_code == 200, response.text
    return {(entry["name"], entry["version"]): entry for entry in response.json()}


async def wait_index(
    client: httpx.AsyncClient, expected: Mapping[tuple[str, str], str], timeout_s: float = 30
) -> dict[tuple[str, str], dict[str, str]]:
    """Poll the repository index until each (name, version) has the expected state."""
    deadline = time.monotonic() + timeout_s
    while True:
        entries = await index(client)
        if all(entries.get(key, {}).get("state") == state for key, state in expected.items()):
            return entries
        if time.monotonic() > deadline:
            raise AssertionError(f"index never showed {dict(expected)}: {entries}")
        await asyncio.sleep(0.1)


def runner_env(repo: str, artifact_dir: Path, aws: Mapping[str, str] | None = None) -> dict[str, str]:
    return {
        **(aws or {}),
        "FNGATE_REPO": repo,
        "FNGATE_ARTIFACT_DIR": str(artifact_dir),
        "FNGATE_RESCAN_S": "0.3",
        "FNGATE_HEARTBEAT_S": "0.5",
        "FNGATE_RETIRE_AFTER_S": "1",
    }
