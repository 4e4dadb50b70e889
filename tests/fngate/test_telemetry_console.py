"""On a terminal the gateway logs plain lines and an access log; elsewhere JSON lines. With
OTEL_TRACES_EXPORTER=console its spans are written out, with no collector."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import ROOT, child_env, free_socket


def read_until(fd: int, wanted: str, timeout_s: float = 30) -> str:
    seen = b""
    deadline = time.monotonic() + timeout_s
    while wanted.encode() not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
    return seen.decode(errors="replace")


def test_gateway_on_a_terminal_logs_lines_and_an_access_log(redis_url: str, repo: Path) -> None:
    sock = free_socket()
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway"],
        env=child_env(redis_url, repo, FNGATE_BIND=f"fd://{sock.fileno()}"),
        pass_fds=[sock.fileno()],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=secondary,
    )
    os.close(secondary)
    try:
        started = read_until(primary, "serving")
        assert " INFO    gateway  " in started, started
        assert not started.lstrip().startswith("{"), started
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v2/health/live"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
        logged = read_until(primary, "/v2/health/live")
        line = next((line for line in logged.splitlines() if '"GET /v2/health/live' in line), "")
        assert " 200" in line, logged
    finally:
        process.terminate()
        deadline = time.monotonic() + 15
        while process.poll() is None and time.monotonic() < deadline:
            read_until(primary, "\0", 0.2)  # keep the terminal drained, or its writes block
        if process.poll() is None:
            process.kill()
        process.wait(timeout=5)
        os.close(primary)
        sock.close()


def test_gateway_elsewhere_logs_json_and_writes_console_spans(
    redis_url: str, repo: Path, tmp_path: Path
) -> None:
    sock = free_socket()
    log = tmp_path / "gateway.log"
    env = child_env(redis_url, repo, FNGATE_BIND=f"fd://{sock.fileno()}", OTEL_TRACES_EXPORTER="console")
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway"],
            env=env,
            pass_fds=[sock.fileno()],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    try:
        deadline = time.monotonic() + 30
        while "serving" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        first = log.read_text().splitlines()[0]
        assert json.loads(first)["service"] == "gateway"
        # With no collector, OTEL_TRACES_EXPORTER=console writes each span as it ends.
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/functions/classifier"
        request = urllib.request.Request(url, data=b'{"inputs": {"nope": [[1]]}}', method="POST")
        with contextlib.suppress(urllib.error.HTTPError):  # a 400 is traced like any request
            urllib.request.urlopen(request, timeout=10).close()
        while '"trace_id"' not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        text = log.read_text()
        assert '"trace_id"' in text and '"name": "POST /v1/functions/' in text, text[-3000:]
        assert '"kind": "SpanKind.SERVER"' in text
    finally:
        process.terminate()
        process.wait(timeout=15)
        sock.close()
