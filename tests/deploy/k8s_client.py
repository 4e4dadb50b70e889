"""The Kubernetes test's client, run inside the cluster's network namespace (`fgk8s ns`): the only
place the gateway's pod and Service addresses exist. Standard library only; every call is bounded.

  k8s_client.py invoke URL             one invocation: its status, milliseconds, Server-Timing, when sent
  k8s_client.py load URL STOP MAX_S N  N clients invoking until the file STOP exists (or MAX_S):
                                       statuses counted, each invocation retried on a refused
                                       connection (a gateway pod going away) until it is answered

The API key is FNGATE_API_KEY. Prints one JSON object."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BODY = json.dumps({"inputs": {"input": [[0.25] * 16]}}).encode()
TIMEOUT_S = 120


def post(url: str) -> tuple[int, bytes, str]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {os.environ['FNGATE_API_KEY']}"}
    request = urllib.request.Request(url, data=BODY, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, response.read(), response.headers.get("Server-Timing", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), ""


def invoke(url: str) -> dict[str, object]:
    sent = time.time()
    status, body, timing = post(url)
    took_ms = (time.time() - sent) * 1000
    phases = {}
    for part in filter(None, (item.strip() for item in timing.split(","))):
        name, _, duration = part.partition(";dur=")
        phases[name] = float(duration)
    if status == 200:
        probabilities = json.loads(body)["outputs"]["probabilities"][0]
        assert len(probabilities) == 4 and abs(sum(probabilities) - 1) < 1e-3, probabilities
    return {
        "status": status,
        "sent": sent,
        "ms": round(took_ms, 1),
        "timing": phases,
        "body": body[:300].decode(),
    }


def load(url: str, stop: Path, max_s: float, clients: int) -> dict[str, object]:
    """Each client invokes in a loop; an invocation whose connection fails (no gateway behind the
    Service for a moment) is sent again, and counted once, by its final status (0: never answered).
    Each client counts on its own; the counts are added at the end."""
    deadline = time.monotonic() + max_s

    def client() -> collections.Counter[str]:
        counted: collections.Counter[str] = collections.Counter()
        while not stop.exists() and time.monotonic() < deadline:
            status = 0
            while time.monotonic() < deadline:
                try:
                    status = post(url)[0]
                    break
                except OSError:  # refused or reset: the invocation is sent again
                    counted["connection_retries"] += 1
                    time.sleep(0.1)
            counted[str(status)] += 1
        return counted

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        total = sum(
            (future.result() for future in [pool.submit(client) for _ in range(clients)]),
            collections.Counter(),
        )
    retried = total.pop("connection_retries", 0)
    return {"statuses": dict(total), "connection_retries": retried, "s": round(time.monotonic() - started, 1)}


if __name__ == "__main__":
    command, address = sys.argv[1], sys.argv[2]
    if command == "invoke":
        print(json.dumps(invoke(address)))
    elif command == "load":
        print(json.dumps(load(address, Path(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))))
    else:
        sys.exit(f"unknown command {command}")
