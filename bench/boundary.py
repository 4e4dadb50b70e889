"""`python -m bench.boundary`: what the process boundary of a Python function costs per batch. The
tiny model (FP32 [-1, 16] times 2) as `backend: python`, in a process of its own, against the same
`Model` called in this process; batches of 1, 256 (16 KiB) and 4096 rows."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fngate.manifest import parse_manifest
from runner.backends.python import PythonBackend
from runner.sandbox import load_model

MODEL = """
class Model:
    def __init__(self, directory):
        pass

    def infer(self, inputs):
        return {"output": inputs["input"] * 2}
"""
ECHO = "import os\nwhile os.write(1, os.read(0, 1)): pass\n"
"""The floor: one byte to a process and back through two pipes, the least any child costs."""
Arrays = dict[str, np.ndarray[Any, Any]]


def latencies_us(
    call: Callable[[Arrays], Arrays], x: np.ndarray[Any, Any], seconds: float
) -> np.ndarray[Any, Any]:
    for _ in range(50):
        call({"input": x})
    samples: list[int] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        t0 = time.perf_counter_ns()
        call({"input": x})
        samples.append(time.perf_counter_ns() - t0)
    return np.asarray(samples) / 1000


def pipe_round_trip_us(seconds: float) -> float:
    echo = subprocess.Popen([sys.executable, "-c", ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert echo.stdin is not None and echo.stdout is not None
    out, back = echo.stdin.fileno(), echo.stdout.fileno()

    def ping(_inputs: Arrays) -> Arrays:
        os.write(out, b"x")
        os.read(back, 1)
        return {}

    try:
        return float(np.percentile(latencies_us(ping, np.zeros(1), seconds), 50))
    finally:
        echo.stdin.close()
        echo.wait()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.boundary")
    parser.add_argument("--seconds", type=float, default=3.0, help="per batch size and side")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        (directory / "model.py").write_text(MODEL)
        manifest = parse_manifest(
            {
                "name": "tiny",
                "model": {"backend": "python", "path": "model.py"},
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}],
                "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 16]}],
            },
            "tiny.yaml",
        )
        print(
            f"pipe round trip (the floor on this machine now): p50 {pipe_round_trip_us(args.seconds):.1f} us"
        )
        child = PythonBackend(manifest, directory)
        model = load_model(directory / "model.py", directory)
        print(
            f"{'rows':>6} {'bytes':>8} {'in process p50 us':>18} {'child p50 us':>13} {'child p99 us':>13}"
            f" {'boundary p50 us':>16}"
        )
        try:
            for rows in (1, 256, 4096):
                x = np.random.default_rng(rows).standard_normal((rows, 16), dtype=np.float32)
                local = latencies_us(model.infer, x, args.seconds)
                remote = latencies_us(lambda inputs: child.run(inputs, ["output"]), x, args.seconds)
                local_p50, remote_p50 = float(np.percentile(local, 50)), float(np.percentile(remote, 50))
                print(
                    f"{rows:>6} {x.nbytes:>8} {local_p50:>18.1f} {remote_p50:>13.1f} "
                    f"{float(np.percentile(remote, 99)):>13.1f} {remote_p50 - local_p50:>16.1f}"
                )
        finally:
            child.close()


if __name__ == "__main__":
    main()
