"""Fixtures of the gateway's tests that run it as a process of its own."""

from __future__ import annotations

import contextlib
import itertools
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, child_env, free_socket


@contextlib.contextmanager
def running_gateway(
    redis_url: str, repo: Path, log_path: Path, grpc_socket: socket.socket | None = None, **env: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`python -m gateway` on an HTTP socket bound here (and `grpc_socket`, if given, for gRPC),
    auth off unless `FNGATE_AUTH="true"`: (base URL, process); stopped at the end of the block."""
    sock = free_socket()
    fds = [sock.fileno()]
    if grpc_socket is not None:
        fds.append(grpc_socket.fileno())
        env = {"FNGATE_GRPC_BIND": f"fd://{grpc_socket.fileno()}", **env}
    try:
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "gateway"],
                env=child_env(
                    redis_url, repo, **{"FNGATE_AUTH": "false", "FNGATE_BIND": f"fd://{sock.fileno()}", **env}
                ),
                pass_fds=fds,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}", process
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:  # a gateway that does not stop is a failure, never a leftover
                process.kill()
                process.wait()
                raise
    finally:
        sock.close()


@pytest.fixture
def gateway_with_pid(redis_url: str, repo: Path, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Factory: `python -m gateway` on a socket bound here; returns (base URL, process)."""
    with contextlib.ExitStack() as started:
        count = itertools.count()

        def start(**env: str) -> tuple[str, subprocess.Popen[bytes]]:
            log_path = tmp_path / f"gateway-{next(count)}.log"
            return started.enter_context(running_gateway(redis_url, repo, log_path, **env))

        yield start
