"""Fixtures of the gateway's tests that run it as a process of its own."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, child_env, free_socket


@pytest.fixture
def gateway_with_pid(redis_url: str, repo: Path, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Factory: `python -m gateway` on a socket bound here; returns (base URL, process)."""
    started: list[tuple[subprocess.Popen[bytes], socket.socket]] = []

    def start(**env: str) -> tuple[str, subprocess.Popen[bytes]]:
        sock = free_socket()
        with open(tmp_path / f"gateway-{len(started)}.log", "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "gateway"],
                env=child_env(
                    redis_url, repo, **{"FNGATE_AUTH": "false", "FNGATE_BIND": f"fd://{sock.fileno()}", **env}
                ),
                pass_fds=[sock.fileno()],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        started.append((process, sock))
        return f"http://127.0.0.1:{sock.getsockname()[1]}", process

    yield start
    for process, sock in started:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:  # a gateway that does not stop is a failure, never a leftover
            process.kill()
            process.wait()
            raise
        finally:
            sock.close()
