"""Scenario B, the memory budget (docs/memory.md): one runner with a 1 GiB budget serves four
functions of about 400 MB each in turn (round robin, then one hot and three cold), its resident
memory sampled from /proc every 100 ms; then the same with the budget off. Scenario I: `wide` with
`instances: 2` against 1 in one runner at 16 and 64 connections (throughput and p99).
`python -m bench.memory [--only B,I]`.

The functions are ONNX models whose weights are one large initializer that every run reads (a
Gather whose index depends on the input, so that onnxruntime cannot fold it away); they answer y = x.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

from bench import loadgen
from bench.deployment import Deployment, deployment
from bench.models import wide, write_function
from runner.budget import MIB, peak_rss_bytes, reset_peak_rss, rss_bytes

Row = dict[str, Any]
ROW = [1.0, 2.0, 3.0, 4.0]


def build_weights_model(path: Path, weight_bytes: int) -> None:
    """An ONNX model holding `weight_bytes` of FP32 weights, all of them resident once loaded."""
    weights = np.arange(max(weight_bytes // 4, 1), dtype=np.float32)
    weights[0] = 0.0  # the element every run reads: y = x + 0
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
        helper.make_node("Mul", ["top", "zero"], ["none"]),
        helper.make_node("Cast", ["none"], ["index"], to=TensorProto.INT64),
        helper.make_node("Gather", ["w", "index"], ["picked"]),
        helper.make_node("Add", ["x", "picked"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(weights, "w"), numpy_helper.from_array(np.array(0, np.float32), "zero")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="fngate")
    model.ir_version = 8
    onnx.save(model, str(path))


def write_weights_function(folder: Path, name: str, weight_bytes: int, **model: Any) -> Path:
    """A function folder `folder/name` serving such a model; `model` adds keys to its model."""
    target = folder / name
    target.mkdir(parents=True, exist_ok=True)
    build_weights_model(target / "model.onnx", weight_bytes)
    manifest = {
        "name": name,
        "model": {"backend": "onnxruntime", "path": "model.onnx", **model},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
        "batching": {"max_batch_size": 8, "timeout_ms": 60_000},
        "scaling": {"idle_unload_s": 3600},
    }
    (target / "function.yaml").write_text(yaml.safe_dump(manifest), encoding="utf-8")
    return target


class PeakSampler:
    """A process's resident memory read from /proc every `interval_s` in a thread; `peak()` since
    the last `reset()`."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self._pid = pid
        self._interval_s = interval_s
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._peak = max(self._peak, rss_bytes(self._pid))

    def reset(self) -> None:
        reset_peak_rss(self._pid)
        self._peak = rss_bytes(self._pid)

    def peak(self) -> int:
        return max(self._peak, rss_bytes(self._pid))

    def kernel_peak(self) -> int:
        """The kernel's own peak (VmHWM) since `reset`: no sample can miss it."""
        return peak_rss_bytes(self._pid)


async def invoke_in_turn(base: str, order: list[str]) -> list[tuple[str, int, float]]:
    """Each function of `order` once, one after the other: (name, status, seconds)."""
    done = []
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        for name in order:
            started = time.perf_counter()
            response = await client.post(f"/v1/functions/{name}", json={"inputs": {"x": [ROW]}})
            done.append((name, response.status_code, time.perf_counter() - started))
    return done


def evictions(runner_log: Path) -> int:
    return runner_log.read_text(encoding="utf-8", errors="replace").count("(evicted to make room")


def run(deployed: Deployment, names: list[str], budget_bytes: int, record: Callable[[Row], None]) -> None:
    """Both orders against one runner with the budget, then against one without."""
    rounds = 3
    orders = {
        "round-robin": names * rounds,
        "hot+cold": [item for cold in names[1:] * rounds for item in (names[0], cold)],
    }
    base = deployed.start_gateway(workers=1)
    for budget in (budget_bytes, 0):
        env = {"FNGATE_MEMORY_BUDGET_BYTES": str(budget)} if budget else {"FNGATE_MEMORY_BUDGET": "false"}
        log = deployed.logs / f"runner-{len(deployed.runners)}.log"
        runner = deployed.start_runner(FNGATE_LOG_LEVEL="INFO", **env)
        time.sleep(2.0)  # its imports: the baseline is the runner before any model
        start_rss = rss_bytes(runner.pid)
        with PeakSampler(runner.pid) as sampler:
            for order, sequence in orders.items():
                before = evictions(log)
                sampler.reset()
                results = asyncio.run(invoke_in_turn(base, sequence))
                times = [seconds for _name, _status, seconds in results]
                record(
                    {
                        "scenario": "B",
                        "budget_mib": round(budget / MIB) if budget else "off",
                        "order": order,
                        "invocations": len(results),
                        "answered": sum(status == 200 for _name, status, _s in results),
                        "evictions": evictions(log) - before,
                        "runner_start_mib": round(start_rss / MIB),
                        "peak_rss_mib": round(sampler.peak() / MIB),
                        "peak_over_start_mib": round((sampler.peak() - start_rss) / MIB),
                        "vmhwm_over_start_mib": round((sampler.kernel_peak() - start_rss) / MIB),
                        "median_s": round(float(np.median(times)), 3),
                        "max_s": round(max(times), 3),
                    }
                )
        deployed.stop_runners()


def instances(deployed: Deployment, record: Callable[[Row], None], measure_s: float = 8.0) -> None:
    """wide (max 64 rows a batch) with one instance and with two, one runner each, through one gateway."""
    from bench.__main__ import requests_for  # the benchmark's own request builder

    for count in (1, 2):
        name = f"wide-{count}"
        folder = write_function(deployed.repo, name, wide(), 512, max_batch_size=64, max_queue_delay_us=0)
        manifest = yaml.safe_load((folder / "function.yaml").read_text(encoding="utf-8"))
        manifest["model"]["instances"] = count
        (folder / "function.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False), encoding="utf-8")
    base = deployed.start_gateway(workers=1)
    port = int(base.rsplit(":", 1)[1])
    for count in (1, 2):
        name = f"wide-{count}"
        deployed.start_runner(FNGATE_FUNCTIONS=f'["{name}"]')
        requests, _inputs = requests_for(name, 512, 512, binary=True, seed=count)
        # The runner's start and load, before anything is measured.
        httpx.post(f"{base}/v1/functions/{name}", json={"inputs": {"input": [[0.0] * 512]}}, timeout=120)
        for concurrency in (16, 64):
            result = asyncio.run(loadgen.run("127.0.0.1", port, requests, concurrency, 2.0, measure_s))
            record(
                {
                    "scenario": "I",
                    "function": "wide",
                    "instances": count,
                    "concurrency": concurrency,
                    "throughput_rps": round(result.throughput),
                    "p50_ms": round(result.percentile_ms(50), 2),
                    "p99_ms": round(result.percentile_ms(99), 2),
                    "errors": result.errors,
                }
            )
        deployed.stop_runners()


def show(row: Row) -> None:
    print("  " + " ".join(f"{key}={value}" for key, value in row.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    parser.add_argument("--model-mb", type=int, default=400, help="each function's weights (MB)")
    parser.add_argument("--budget-mib", type=int, default=1024, help="the runner's memory budget (MiB)")
    parser.add_argument("--only", default="B,I", help="comma-separated scenarios: B (budget), I (instances)")
    args = parser.parse_args()
    only = set(args.only.split(","))
    names = [f"weights-{letter}" for letter in "abcd"]
    with tempfile.TemporaryDirectory(prefix="fngate-memory-") as folder:
        repo = Path(folder) / "repo"
        if "B" in only:
            for name in names:
                write_weights_function(repo, name, args.model_mb * 1000 * 1000)
            with deployment(repo, Path(folder) / "logs") as deployed:
                run(deployed, names, args.budget_mib * MIB, show)
        if "I" in only:
            with deployment(Path(folder) / "wide-repo", Path(folder) / "logs-wide") as deployed:
                instances(deployed, show)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
