"""The suite keeps to itself. In the README's order (`fngate up`, then `scripts/test` with the up
still running and FNGATE_API_KEY exported) the suite must neither read that up's state folder nor
send anything to its processes: it has a home and a state folder of its own (tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

from fngate import keys
from fngate.process import stop_processes
from fngate.up.state import read_up, state_dir
from tests.conftest import ROOT, SUITE_VARIABLES_KEPT, free_port
from tests.e2e.deployments import cli, scale_function

UP_TIMEOUT_S = 60
INNER = [
    "tests/test_isolation.py::test_the_suite_has_its_own_home",
    "tests/fngate/cli/test_main.py::test_invoke_sends_ups_admin_key_to_ups_gateway_only",
]
"""Tests that read what a running up leaves (its state, FNGATE_API_KEY): run inside a user's setting."""


async def test_the_suite_has_its_own_home(suite_home: Path, tmp_path: Path, redis_url: str) -> None:
    # The CLI as the suite runs it finds no fngate up: a deploy points its curl lines at the default
    # gateway, with no warning about another up's repository.
    manifest = scale_function(tmp_path / "scale", "scale", 2.0)
    done = await cli("deploy", str(manifest), "--repo", str(tmp_path / "repo"), "--redis", redis_url)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr
    assert "curl -s -X POST http://127.0.0.1:8000/v1/functions/scale" in done.stdout
    assert os.environ["HOME"] == str(suite_home)
    assert state_dir() == suite_home / ".local" / "state" / "fngate"
    assert read_up(state_dir()) is None
    assert {name for name in os.environ if name.startswith("FNGATE_")} <= SUITE_VARIABLES_KEPT


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of a folder but Redis's own data, with its contents."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and "redis" not in path.relative_to(folder).parts
    }


def test_a_users_running_up_is_invisible_to_the_suite(tmp_path: Path) -> None:
    # A short home: the up's Redis socket lies in its state folder, and a unix socket's path has
    # at most 107 bytes (tmp_path under pytest-xdist is long).
    user = Path(tempfile.mkdtemp(prefix="fngate-user-"))
    shutil.copytree(ROOT / "functions", user / "functions", ignore=shutil.ignore_patterns("__pycache__"))
    environ = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("FNGATE_", "XDG_STATE_HOME", "XDG_CONFIG_HOME"))
    }
    environ["HOME"] = str(user)
    port = free_port()
    command = [sys.executable, "-m", "fngate.cli.main", "up", "--repo", str(user / "functions")]
    command += ["--port", str(port), "--metrics-port", str(free_port()), "--grpc-port", "0"]
    command += ["--gateway-workers", "1"]
    command += ["--no-standby-runner"]
    with (tmp_path / "up.log").open("wb") as log:
        up = subprocess.Popen(
            command, env=environ, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    folder = user / ".local" / "state" / "fngate"
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while read_up(folder) is None or not _ready(f"http://127.0.0.1:{port}"):
            assert up.poll() is None and time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.1)
        state = read_up(folder)
        assert state is not None
        before = snapshot(folder), snapshot(user / "functions")
        client = redis.Redis.from_url(state.redis_url)
        control = client.xlen(keys.control())

        inner = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *INNER],
            env={
                **environ,
                "FNGATE_API_KEY": (folder / "admin.key").read_text().strip(),  # as the README has it
            },
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert inner.returncode == 0, inner.stdout[-6000:] + inner.stderr[-2000:]
        assert (snapshot(folder), snapshot(user / "functions")) == before
        assert client.xlen(keys.control()) == control  # no deploy, load or removal reached it
        assert read_up(folder) == state and up.poll() is None
        client.close()
    finally:
        stop_processes([up], timeout_s=60)
        shutil.rmtree(user, ignore_errors=True)


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v2/health/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
