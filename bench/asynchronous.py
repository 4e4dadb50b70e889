"""`python -m bench.asynchronous`: what an asynchronous invocation costs against a synchronous one.
One gateway process and one runner (the example classifier, one row), one client at a time:
a synchronous call; a submission alone (202); a submission then a long-poll for its result (the
asynchronous round trip); and the fetch of a result already done. Opt-in: not in `python -m bench`."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.deployment import deployment

ROOT = Path(__file__).resolve().parent.parent
BODY = {"inputs": {"input": [[0.5] * 16]}}
ASYNC = {"Prefer": "respond-async"}


def sample_us(calls: dict[str, Callable[[], None]], seconds: float) -> dict[str, np.ndarray[Any, Any]]:
    """Latencies of each call, interleaved (one of each per round), so that every scenario sees the
    same load: on a shared machine that load moves."""
    for call in calls.values():
        for _ in range(20):
            call()
    samples: dict[str, list[int]] = {name: [] for name in calls}
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for name, call in calls.items():
            t0 = time.perf_counter_ns()
            call()
            samples[name].append(time.perf_counter_ns() - t0)
    return {name: np.asarray(values) / 1000 for name, values in samples.items()}


def scenarios(client: httpx.Client) -> dict[str, Callable[[], None]]:
    def synchronous() -> None:
        assert client.post("/v1/functions/classifier", json=BODY).status_code == 200

    def submit() -> str:
        response = client.post("/v1/functions/classifier", json=BODY, headers=ASYNC)
        assert response.status_code == 202, response.text
        invocation_id: str = response.json()["id"]
        return invocation_id

    def submit_and_wait() -> None:
        invocation_id = submit()
        response = client.get(f"/v1/invocations/{invocation_id}", params={"wait": 10})
        assert response.status_code == 200, response.text

    done = submit()
    while client.get(f"/v1/invocations/{done}", params={"wait": 10}).status_code != 200:
        pass

    def submit_only() -> None:
        submit()

    def fetch_done() -> None:
        assert client.get(f"/v1/invocations/{done}").status_code == 200

    return {
        "synchronous call": synchronous,
        "async submit (202)": submit_only,
        "async submit + long-poll result": submit_and_wait,
        "fetch of a done result": fetch_done,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="in all (default 20)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs, deployment(ROOT / "functions", Path(logs)) as deployed:
        url = deployed.start_gateway(workers=1)
        deployed.start_runner(FNGATE_FUNCTIONS='["classifier"]')
        with httpx.Client(base_url=url, timeout=30) as client:
            deadline = time.monotonic() + 60
            while client.post("/v1/functions/classifier", json=BODY).status_code != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError("the runner did not answer within 60 s")
            print(f"{'scenario':<34} {'n':>6} {'p50 µs':>9} {'p90 µs':>9} {'p99 µs':>9}")
            for name, us in sample_us(scenarios(client), args.seconds).items():
                p50, p90, p99 = np.percentile(us, [50, 90, 99])
                print(f"{name:<34} {len(us):>6} {p50:>9.0f} {p90:>9.0f} {p99:>9.0f}")


if __name__ == "__main__":
    main()
