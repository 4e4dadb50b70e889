"""Device timings for scripts/gpu_check.sh (run from the repository root on a GPU machine):

    python scripts/gpu_check.py timing --out DIR --work DIR   the wide benchmark model on CPU, CUDA,
                                                              TensorRT fp16 (onnxruntime) and a native
                                                              fp16 .plan, batch 1 and 32; two cold
                                                              starts, without and with a stored engine
    python scripts/gpu_check.py cold --work DIR --engines DIR --store DIR   (one cold start, a child)
    python scripts/gpu_check.py environment                   versions, the GPU, the providers

Writes DIR/timing.json and DIR/timing.md; exits 1 when any configuration did not run where asked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from bench.models import wide, write_function  # noqa: E402
from fngate.manifest import FunctionManifest, load_manifest  # noqa: E402
from runner.backends import Backend  # noqa: E402
from runner.backends.engine_cache import FolderEngineStore  # noqa: E402
from runner.backends.onnx import OnnxBackend  # noqa: E402
from runner.backends.providers import Acceleration  # noqa: E402

FEATURES = 512
BATCHES = (1, 32)
CONFIGS = [  # name, accelerator, precision, the device it must run on
    ("cpu", "cpu", "fp32", "CPUExecutionProvider"),
    ("cuda", "cuda", "fp32", "CUDAExecutionProvider"),
    ("tensorrt-fp16", "tensorrt", "fp16", "TensorrtExecutionProvider"),
]


def function(work: Path, accelerator: str = "cpu", precision: str = "fp32") -> tuple[FunctionManifest, Path]:
    """The benchmark's wide MLP as a function folder with this accelerator (built once per folder)."""
    folder = work / f"wide-{accelerator}-{precision}"
    if not (folder / "wide" / "function.yaml").is_file():
        write_function(folder, "wide", wide(), FEATURES, max_batch_size=32, preferred_batch_sizes=[32])
        path = folder / "wide" / "function.yaml"
        data = yaml.safe_load(path.read_text())
        data["model"].update(accelerator=accelerator, precision=precision)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_manifest(folder / "wide" / "function.yaml"), folder / "wide"


def measure(backend: Backend, batch: int, seconds: float) -> dict[str, float]:
    rng = np.random.default_rng(batch)
    inputs = [{"input": rng.standard_normal((batch, FEATURES), dtype=np.float32)} for _ in range(8)]
    for item in inputs:
        backend.run(item, ["output"])
    latencies = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds and len(latencies) < 5000:
        t0 = time.perf_counter_ns()
        backend.run(inputs[len(latencies) % len(inputs)], ["output"])
        latencies.append(time.perf_counter_ns() - t0)
    elapsed = time.perf_counter() - started
    array = np.asarray(latencies) / 1e6
    return {
        "p50_ms": round(float(np.percentile(array, 50)), 4),
        "p90_ms": round(float(np.percentile(array, 90)), 4),
        "rows_per_s": round(len(latencies) * batch / elapsed, 1),
        "runs": len(latencies),
    }


def time_config(
    work: Path, name: str, accelerator: str, precision: str, wanted: str, seconds: float
) -> dict[str, Any]:
    manifest, folder = function(work, accelerator, precision)
    threads = min(os.cpu_count() or 1, 16)
    acceleration = Acceleration(engine_dir=work / "engines" / name, require=True)
    result: dict[str, Any] = {"name": name, "wanted": wanted, "threads": threads}
    started = time.perf_counter()
    try:
        backend = OnnxBackend(manifest, folder, threads, acceleration)
    except Exception as exc:
        return {**result, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    result["load_s"] = round(time.perf_counter() - started, 3)
    result["device"] = backend.device
    result["device_memory_bytes"] = backend.device_memory_bytes
    result["ok"] = backend.device == wanted
    try:
        result["batches"] = {str(batch): measure(backend, batch, seconds) for batch in BATCHES}
        result["max_abs_diff_vs_cpu"] = max_difference(backend, work)
    finally:
        backend.close()
    return result


def time_native(work: Path, seconds: float) -> dict[str, Any]:
    """The same model as a native fp16 .plan through the tensorrt backend."""
    from runner.backends.tensorrt import TensorRTBackend, build_plan

    manifest, folder = function(work, "cpu", "fp32")
    plan = folder / "model.plan"
    result: dict[str, Any] = {"name": "tensorrt-native-fp16", "wanted": "TensorRT"}
    started = time.perf_counter()
    try:
        build_plan(manifest, folder / "model.onnx", plan, fp16=True)
        result["build_s"] = round(time.perf_counter() - started, 3)
        native = manifest.model_copy(
            update={"model": manifest.model.model_copy(update={"backend": "tensorrt", "path": "model.plan"})}
        )
        started = time.perf_counter()
        backend = TensorRTBackend(native, folder)
    except Exception as exc:
        return {**result, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    result |= {"load_s": round(time.perf_counter() - started, 3), "device": backend.device, "ok": True}
    result["device_memory_bytes"] = backend.device_memory_bytes
    try:
        result["batches"] = {str(batch): measure(backend, batch, seconds) for batch in BATCHES}
        result["max_abs_diff_vs_cpu"] = max_difference(backend, work)
    finally:
        backend.close()
    return result


def max_difference(backend: Backend, work: Path) -> float:
    manifest, folder = function(work)
    reference = OnnxBackend(manifest, folder, 4)
    batch = {"input": np.random.default_rng(7).standard_normal((32, FEATURES), dtype=np.float32)}
    try:
        expected = reference.run(batch, ["output"])["output"]
    finally:
        reference.close()
    return round(float(np.max(np.abs(backend.run(batch, ["output"])["output"] - expected))), 5)


def cold_starts(work: Path) -> list[dict[str, Any]]:
    """Two new processes load the TensorRT fp16 function: the first builds and stores the engine,
    the second (with an empty local cache, as on a new pod) downloads it."""
    store = work / "cold-store"
    runs = []
    for label in ("without a stored engine", "with the stored engine"):
        engines = work / f"cold-engines-{len(runs)}"
        command = [
            sys.executable,
            __file__,
            "cold",
            "--work",
            str(work),
            "--engines",
            str(engines),
            "--store",
            str(store),
        ]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=150, check=False)
        wall_s = round(time.perf_counter() - started, 3)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        said = [line for line in done.stderr.splitlines() if line.strip()]
        answer = (
            json.loads(lines[-1]) if lines else {"error": said[-1] if said else f"exit {done.returncode}"}
        )
        runs.append({"run": label, "wall_s": wall_s, "exit": done.returncode, **answer})
    return runs


def cold(work: Path, engines: Path, store: Path) -> None:
    from prometheus_client import REGISTRY

    manifest, folder = function(work, "tensorrt", "fp16")
    started = time.perf_counter()
    backend = OnnxBackend(manifest, folder, 1, Acceleration(engines, FolderEngineStore(store), require=True))
    backend.run({"input": np.zeros((1, FEATURES), dtype=np.float32)}, ["output"])
    load_s = round(time.perf_counter() - started, 3)
    labels = {"function": "wide"}
    events = {
        event: REGISTRY.get_sample_value("fngate_engine_cache_events_total", {**labels, "event": event})
        for event in ("local", "downloaded", "miss", "mismatch", "uploaded", "upload_failed")
    }
    print(
        json.dumps(
            {
                "load_and_first_answer_s": load_s,
                "device": backend.device,
                "events": {k: v for k, v in events.items() if v},
            }
        )
    )
    backend.close()


def report(results: dict[str, Any]) -> str:
    lines = [
        "| configuration | device | load s | batch 1 p50 ms | batch 32 p50 ms | batch 32 rows/s "
        "| max abs diff vs CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for item in results["configs"]:
        if not item.get("batches"):
            lines.append(f"| {item['name']} | not run: {item.get('error', item.get('device'))} | | | | | |")
            continue
        one, many = item["batches"]["1"], item["batches"]["32"]
        lines.append(
            f"| {item['name']} | {item['device']} | {item['load_s']} | {one['p50_ms']} | {many['p50_ms']} | "
            f"{many['rows_per_s']} | {item.get('max_abs_diff_vs_cpu', '')} |"
        )
    lines += [
        "",
        "| cold start (new process, TensorRT fp16) | wall s | load + first answer s | engine cache |",
        "|---|---|---|---|",
    ]
    for run in results["cold_starts"]:
        first = run.get("load_and_first_answer_s", run.get("error", ""))
        lines.append(f"| {run['run']} | {run['wall_s']} | {first} | {run.get('events', '')} |")
    return "\n".join(lines) + "\n"


def timing(out: Path, work: Path, seconds: float) -> int:
    results: dict[str, Any] = {"configs": [], "cold_starts": []}
    for name, accelerator, precision, wanted in CONFIGS:
        results["configs"].append(time_config(work, name, accelerator, precision, wanted, seconds))
        print(json.dumps(results["configs"][-1]), flush=True)
    results["configs"].append(time_native(work, seconds))
    print(json.dumps(results["configs"][-1]), flush=True)
    results["cold_starts"] = cold_starts(work)
    print(json.dumps(results["cold_starts"]), flush=True)
    (out / "timing.json").write_text(json.dumps(results, indent=2))
    (out / "timing.md").write_text(report(results))
    failed = [item["name"] for item in results["configs"] if not item.get("ok")]
    failed += [run["run"] for run in results["cold_starts"] if run["exit"] != 0]
    if failed:
        print(f"gpu_check: did not run as asked: {failed}", file=sys.stderr)
    return 1 if failed else 0


def environment() -> None:
    """What this machine offers fngate, as the runner sees it."""
    import importlib.metadata

    from runner import gpu
    from runner.backends.providers import probe

    for name in (
        "onnxruntime",
        "onnxruntime-gpu",
        "tensorrt-cu13",
        "tensorrt",
        "cuda-bindings",
        "nvidia-ml-py",
    ):
        try:
            print(f"{name}: {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"{name}: not installed")
    print(f"python: {sys.version.split()[0]} ({sys.executable})")
    print(f"gpu: {gpu.find_device(0)}")
    print(f"runner's view: {probe(0)}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    timing_parser = commands.add_parser("timing")
    timing_parser.add_argument("--out", type=Path, required=True)
    timing_parser.add_argument("--work", type=Path, required=True)
    timing_parser.add_argument("--seconds", type=float, default=1.5)
    commands.add_parser("environment")
    cold_parser = commands.add_parser("cold")
    for name in ("--work", "--engines", "--store"):
        cold_parser.add_argument(name, type=Path, required=True)
    arguments = parser.parse_args()
    if arguments.command == "environment":
        environment()
        return 0
    if arguments.command == "cold":
        cold(arguments.work, arguments.engines, arguments.store)
        return 0
    arguments.out.mkdir(parents=True, exist_ok=True)
    arguments.work.mkdir(parents=True, exist_ok=True)
    return timing(arguments.out, arguments.work, arguments.seconds)


if __name__ == "__main__":
    sys.exit(main())
