"""A gateway stopped by SIGTERM answers what its keep-alive clients send while it stops, with
Connection: close, instead of closing idle connections under them (a request already on its way
then met a reset)."""

from __future__ import annotations

import concurrent.futures
import http.client
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.conftest import ROOT, child_env, free_socket

CLIENTS = 8


def test_keep_alive_clients_are_answered_then_closed_at_shutdown(
    redis_url: str, repo: Path, tmp_path: Path
) -> None:
    sock = free_socket()
    port = sock.getsockname()[1]
    env = child_env(redis_url, repo, FNGATE_AUTH="false", FNGATE_SERVER="uvicorn")
    with open(tmp_path / "gateway.log", "wb") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway"],
            env={**env, "FNGATE_BIND": f"fd://{sock.fileno()}"},
            pass_fds=[sock.fileno()],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    sock.close()
    try:
        wait_live(port)
        sent = [0] * CLIENTS
        busy = threading.Barrier(CLIENTS + 1)

        def client(index: int) -> str:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                while True:
                    connection.request("GET", "/v2/health/live")
                    response = connection.getresponse()
                    response.read()
                    sent[index] += 1
                    if sent[index] == 50:
                        busy.wait(timeout=30)
                    if response.getheader("connection", "").lower() == "close":
                        return "closed"
            except (OSError, http.client.HTTPException) as exc:
                return f"{type(exc).__name__} after {sent[index]} requests"
            finally:
                connection.close()

        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            outcomes = [pool.submit(client, index) for index in range(CLIENTS)]
            busy.wait(timeout=30)  # every client is sending on its kept-alive connection
            time.sleep(0.05)
            gateway.send_signal(signal.SIGTERM)
            assert [outcome.result(timeout=30) for outcome in outcomes] == ["closed"] * CLIENTS
        assert gateway.wait(timeout=30) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait(timeout=10)


def wait_live(port: int, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            connection.request("GET", "/v2/health/live")
            if connection.getresponse().status == 200:
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            connection.close()
