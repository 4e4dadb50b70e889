"""Admission by deadline, measured: `fngate up` serving one function on one runner that answers one
invocation at a time in about 40 ms, driven open-loop (Poisson arrivals, seeded) at half, once and
twice what it answers closed-loop, each invocation with a deadline of 200, 500 or 1,000 ms drawn at
random; the same arrivals with admission on and off (FNGATE_DEADLINE_ADMISSION).

For each rate and mode: goodput (answers within their deadline per second), what was refused, what
timed out, p99 of the answered; and of the invocations refused with admission on, the share that
missed their deadline in the run without it (what admission refused that could not have made it).

    python -m bench.admission [--seconds 15] [--out docs/benchmarks/admission.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

STEADY = """
import time


class Model:
    def __init__(self, directory):
        pass

    def infer(self, inputs):
        time.sleep(0.04)
        return {"y": inputs["x"] * 2}
"""

MANIFEST = """
name: steady
model: {backend: python, path: model.py}
inputs: [{name: x, datatype: FP32, shape: [-1, 2]}]
outputs: [{name: y, datatype: FP32, shape: [-1, 2]}]
batching: {max_batch_size: 1, max_queue_delay_us: 0, timeout_ms: 5000, max_queue_size: 5000}
scaling: {max_replicas: 1}
"""

DEADLINES_MS = (200, 500, 1000)
Result = tuple[int, float, int]
"""(status, seconds to the answer, the invocation's deadline in ms)"""


def write_function(folder: Path) -> None:
    """The function `steady` in `folder` (its own folder, made here)."""
    folder.mkdir(parents=True)
    (folder / "function.yaml").write_text(MANIFEST)
    (folder / "model.py").write_text(STEADY)


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
    return port


class Up:
    """`fngate up` on loopback, without keys, with admission on or off."""

    def __init__(self, repo: Path, state: Path, admission: bool) -> None:
        self.port = free_port()
        env = {**os.environ, "FNGATE_DEADLINE_ADMISSION": str(admission).lower()}
        command = [sys.executable, "-m", "fngate.cli.main", "up", "--repo", str(repo), "--no-auth"]
        command += ["--port", str(self.port), "--grpc-port", "0", "--metrics-port", "0"]
        command += ["--state-dir", str(state)]
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def body(deadline_ms: int) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}],
        "parameters": {"timeout_ms": deadline_ms},
    }


async def ready(client: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            answer = await client.post("/v2/models/steady/infer", json=body(5000))
            if answer.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("fngate up did not answer within 120 s")


async def capacity(client: httpx.AsyncClient, seconds: float) -> float:
    """Answers a second, closed loop with 8 callers."""
    answered = 0
    stop = time.monotonic() + seconds

    async def caller() -> None:
        nonlocal answered
        while time.monotonic() < stop:
            if (await client.post("/v2/models/steady/infer", json=body(5000))).status_code == 200:
                answered += 1

    await asyncio.gather(*(caller() for _ in range(8)))
    return answered / seconds


async def drive(client: httpx.AsyncClient, rate: float, seconds: float, seed: int) -> list[Result]:
    """Poisson arrivals at `rate` a second for `seconds`; each with its deadline, drawn by `seed`."""
    draw = random.Random(seed)
    arrivals = []
    at = 0.0
    while True:
        at += draw.expovariate(rate)
        if at >= seconds:
            break
        arrivals.append((at, draw.choice(DEADLINES_MS)))

    async def one(offset: float, deadline_ms: int, start: float) -> Result:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        sent = time.perf_counter()
        try:
            answer = await client.post("/v2/models/steady/infer", json=body(deadline_ms))
            status = answer.status_code
        except httpx.HTTPError:
            status = 0
        return status, time.perf_counter() - sent, deadline_ms

    start = time.perf_counter()
    return list(await asyncio.gather(*(one(offset, deadline, start) for offset, deadline in arrivals)))


def summary(results: list[Result], seconds: float) -> dict[str, Any]:
    answered = sorted(took for status, took, _ in results if status == 200)
    in_time = sum(1 for status, took, deadline in results if status == 200 and took * 1000 <= deadline)
    return {
        "sent": len(results),
        "goodput": in_time / seconds,
        "refused": sum(1 for status, _, _ in results if status == 503),
        "timed_out": sum(1 for status, _, _ in results if status == 504),
        "p99_ms": answered[int(0.99 * (len(answered) - 1))] * 1000 if answered else 0.0,
    }


def would_have_missed(on: list[Result], off: list[Result]) -> tuple[int, int]:
    """Of the arrivals refused with admission on, how many missed their deadline without it."""
    refused = [index for index, (status, _, _) in enumerate(on) if status == 503]
    missed = sum(
        1 for index in refused if not (off[index][0] == 200 and off[index][1] * 1000 <= off[index][2])
    )
    return missed, len(refused)


def decision_us() -> float:
    """What the estimate costs a call (gateway.dispatch.estimated_wait_ms), in µs."""
    from gateway.dispatch import estimated_wait_ms

    count = 200_000
    began = time.perf_counter()
    for index in range(count):
        estimated_wait_ms(index % 50, 0.001, (10_000.0, 0.0, 1), 1)
    return (time.perf_counter() - began) / count * 1e6


async def run(seconds: float) -> str:
    work = Path(tempfile.mkdtemp(prefix="fngate-admission-"))
    try:
        write_function(work / "repo" / "steady")
        runs: dict[bool, dict[int, list[Result]]] = {}
        rates: list[int] = []
        measured = 0.0
        for admission in (True, False):
            up = Up(work / "repo", work / f"state-{admission}", admission)
            try:
                limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
                async with httpx.AsyncClient(base_url=up.base, timeout=30, limits=limits) as client:
                    await ready(client)
                    if not rates:
                        measured = await capacity(client, 5.0)
                        rates = [round(measured * share) for share in (0.5, 1.0, 2.0)]
                    print(f"admission {'on' if admission else 'off'}: rates {rates}", file=sys.stderr)
                    runs[admission] = {}
                    for rate in rates:
                        await asyncio.sleep(2)  # the queue empties between rates
                        runs[admission][rate] = await drive(client, rate, seconds, seed=rate)
            finally:
                up.stop()
        lines = [
            "# Admission by deadline, measured",
            "",
            f"`python -m bench.admission --seconds {seconds:g}` on this machine: one function that "
            "answers one invocation at a time on one runner (about 40 ms each; "
            f"{measured:.0f} answers a second closed-loop with 8 callers), Poisson arrivals at half, "
            "once and twice that, deadlines of 200, 500 or 1,000 ms drawn at random, the same "
            "arrivals with admission on and off.",
            "",
            "| rate (req/s) | admission | sent | goodput (in time/s) | refused (503) | timed out (504) "
            "| p99 answered (ms) | refused that missed without it |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for rate in rates:
            for admission in (True, False):
                row = summary(runs[admission][rate], seconds)
                share = ""
                if admission:
                    missed, refused = would_have_missed(runs[True][rate], runs[False][rate])
                    share = f"{missed} of {refused}" + (f" ({missed / refused:.0%})" if refused else "")
                lines.append(
                    f"| {rate} | {'on' if admission else 'off'} | {row['sent']} | {row['goodput']:.1f} "
                    f"| {row['refused']} | {row['timed_out']} | {row['p99_ms']:.0f} | {share} |"
                )
        lines += ["", f"The decision costs about {decision_us():.2f} µs a call (the estimate alone).", ""]
        return "\n".join(lines)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="each rate's run (default 30)")
    parser.add_argument("--out", type=Path, help="write the table to this file too")
    args = parser.parse_args()
    report = asyncio.run(run(args.seconds))
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
