"""A standalone gateway or runner whose Redis is down when it starts: it retries at most about a
second apart (as README's Guarantees say), logs the outage once rather than every retry, and a
SIGTERM or SIGINT ends it at once."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fngate.process import module_command, stop_processes
from tests.conftest import ROOT, child_env

WATCH_S = 4.0
MAX_GAP_S = 1.5
"""The documented 1 s between retries, with room for a busy machine."""
STOP_S = 5.0


class RefusingRedis:
    """A unix socket that accepts every connection and closes it at once (a Redis that is not
    there yet), recording when each attempt came."""

    def __init__(self, path: Path) -> None:
        self.url = f"unix://{path}"
        self.attempts: list[float] = []
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(str(path))
        self._server.listen(16)
        self._server.settimeout(0.2)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.attempts.append(time.monotonic())
            connection.close()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._server.close()


@pytest.fixture
def refusing(tmp_path: Path) -> Iterator[list[RefusingRedis]]:
    made: list[RefusingRedis] = []
    yield made
    for server in made:
        server.close()


def test_signals_end_a_gateway_and_a_runner_whose_redis_is_down(
    refusing: list[RefusingRedis], tmp_path: Path, repo: Path
) -> None:
    started: list[tuple[str, subprocess.Popen[bytes], RefusingRedis, int, Path]] = []
    for module, sig in (("gateway", signal.SIGTERM), ("runner", signal.SIGINT)):
        redis = RefusingRedis(tmp_path / f"{module}.sock")
        refusing.append(redis)
        log = tmp_path / f"{module}.log"
        with log.open("wb") as output:
            process = subprocess.Popen(
                module_command(module),
                env=child_env(redis.url, repo, FNGATE_AUTH="false", FNGATE_PORT="0"),
                cwd=ROOT,
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        started.append((module, process, redis, sig, log))
    try:
        deadline = time.monotonic() + 60
        while not all(redis.attempts for _, _, redis, _, _ in started):  # imports done, retrying
            assert time.monotonic() < deadline and all(p.poll() is None for _, p, *_ in started)
            time.sleep(0.05)
        time.sleep(WATCH_S)
        for module, process, redis, sig, log in started:
            assert process.poll() is None, log.read_text()  # a Redis that is down never ends it
            gaps = [
                later - earlier for earlier, later in zip(redis.attempts, redis.attempts[1:], strict=False)
            ]
            assert len(gaps) >= 3 and max(gaps) < MAX_GAP_S, (module, gaps)
            text = log.read_text()
            assert text.count("redis unavailable") == 1, text  # the outage is said once
            process.send_signal(sig)
        for module, process, _redis, _sig, log in started:
            try:
                code = process.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{module} ignored its signal:\n{log.read_text()}")
            assert code == 0, log.read_text()
    finally:
        stop_processes([process for _, process, *_ in started], timeout_s=5)
