"""The measurements of a GPU device run (scripts/gpu_check.py runs each in a process of its own and
keeps the JSON line it prints last), each usable alone:

    python -m bench.gpu python-function --work DIR [--seconds S]   functions/gpu-mlp through the
        runner (its own process, the idle unload) against the same code called directly
    python -m bench.gpu providers --work DIR [--seconds S]   the wide MLP and a convolution model on
        onnxruntime's CUDA provider through the runner's backend against a bare session.run
    python -m bench.gpu tensorrt-fallback --work DIR   accelerator: tensorrt without TensorRT
    python -m bench.gpu up --work DIR [--seconds S]   functions/gpu-mlp through `fngate up` (needs
        redis-server), bench/loadgen.py at 1, 16 and 64 connections
    python -m bench.gpu config NAME --work DIR   one TensorRT timing of the wide model
    python -m bench.gpu cold --work DIR --engines DIR --store DIR   one TensorRT cold start

Each exits 0 when what it measured ran where it was to (a GPU), else 1, its figures printed either way.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from bench.models import CONV_CLASSES, CONV_INPUT, conv, wide, write_function
from fngate.errors import FunctionError
from fngate.manifest import FunctionManifest, load_manifest
from runner import gpu

ROOT = Path(__file__).resolve().parent.parent
GPU_FUNCTION = ROOT / "functions" / "gpu-mlp"
FEATURES = 512
FUNCTION_BATCHES = (1, 4, 16, 64, 256, 1024)
PROVIDER_BATCHES = (1, 32, 256, 1024)
TENSORRT_BATCHES = (1, 32)
CONCURRENCIES = (1, 16, 64)
CONFIGS = {  # name: accelerator, precision, the device it must run on
    "tensorrt-fp16": ("tensorrt", "fp16", "TensorrtExecutionProvider"),
}
UNLOAD_WAIT_S = 10.0
Tensors = dict[str, np.ndarray[Any, Any]]


def timing(call: Callable[[Tensors], object], inputs: Sequence[Tensors], seconds: float) -> dict[str, float]:
    """Rows per second and latency percentiles of `call` over `inputs` (one batch size), after
    one call of each to warm up."""
    for item in inputs:
        call(item)
    rows = len(next(iter(inputs[0].values())))
    latencies: list[int] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds and len(latencies) < 5000:
        t0 = time.perf_counter_ns()
        call(inputs[len(latencies) % len(inputs)])
        latencies.append(time.perf_counter_ns() - t0)
    elapsed = time.perf_counter() - started
    array = np.asarray(latencies) / 1e6
    return {
        "rows_per_s": round(len(latencies) * rows / elapsed, 1),
        "p50_ms": round(float(np.percentile(array, 50)), 4),
        "p90_ms": round(float(np.percentile(array, 90)), 4),
        "runs": len(latencies),
    }


def random_batches(shape: Sequence[int], batch: int, count: int = 4) -> list[Tensors]:
    rng = np.random.default_rng(batch)
    return [{"input": rng.standard_normal((batch, *shape), dtype=np.float32)} for _ in range(count)]


def memory(pid: int | None = None) -> dict[str, Any] | None:
    """NVML's view of GPU 0: the device's use and this process's (or `pid`'s), in MiB."""
    reading = gpu.read_memory(0, pid)
    if reading is None:
        return None
    own = reading.process_bytes
    return {
        "device_used_mib": reading.device_used_bytes // gpu.MIB,
        "process_mib": None if own is None else own // gpu.MIB,
    }


# ---------------------------------------------------------------- the GPU Python function


def python_function(work: Path, seconds: float) -> dict[str, Any]:
    """functions/gpu-mlp loaded by the runner's LoadedModels (its model.py in a process of its own,
    given the GPU), batches through that process against the same Model called in this one, then
    unloaded by the runner's idle watch: the process ends and NVML no longer counts its memory."""
    from runner.sandbox import load_model

    folder = work / "functions" / "gpu-mlp"
    shutil.copytree(GPU_FUNCTION, folder, dirs_exist_ok=True)
    manifest_path = folder / "function.yaml"
    data = yaml.safe_load(manifest_path.read_text())
    data["scaling"]["idle_unload_s"] = 1
    manifest_path.write_text(yaml.safe_dump(data, sort_keys=False))
    direct = load_model(folder / "model.py", folder)
    result: dict[str, Any] = {"direct_device": direct.device, "memory_before_load": memory()}
    asyncio.run(_through_the_runner(folder.parent, direct, seconds, result))
    return result


async def _through_the_runner(repo: Path, direct: Any, seconds: float, result: dict[str, Any]) -> None:
    from fngate.repository import FolderRepository
    from runner.backends.providers import Acceleration
    from runner.idle import watch
    from runner.models import LoadedModels

    record = FolderRepository(repo).get("gpu-mlp")
    models = LoadedModels(1, accel=Acceleration())
    models.offer({"gpu-mlp": record})
    (version,) = record.versions
    loaded = await models.get(record.versions[version])
    backend: Any = loaded.backend
    pid = backend.pid
    result |= {
        "device": backend.device,
        "fallback_reason": backend.fallback_reason,
        "device_memory_mib": backend.device_memory_bytes // gpu.MIB,
        "memory_after_load": memory(pid),
    }

    def through_runner(batch: Tensors) -> object:
        return backend.run(batch, ["output"])

    difference = 0.0
    for rows in (1, 7, 1024):
        batch = random_batches((256,), rows, 1)[0]
        got = through_runner(batch)
        assert isinstance(got, dict)
        difference = max(difference, float(np.max(np.abs(got["output"] - direct.infer(batch)["output"]))))
    result["max_abs_diff_runner_vs_direct"] = difference
    result["batches"] = {
        str(rows): {
            "runner": await asyncio.to_thread(timing, through_runner, random_batches((256,), rows), seconds),
            "direct": timing(direct.infer, random_batches((256,), rows), seconds),
        }
        for rows in FUNCTION_BATCHES
    }
    stopping = asyncio.Event()
    started = time.monotonic()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(watch(models, lambda: False, stopping, 0, interval_s=0.1))
        ended = await asyncio.to_thread(process_ends, pid, started + 5 + UNLOAD_WAIT_S)
        stopping.set()
    result |= {
        "idle_unloaded": not models.loaded,
        "process_ended_after_s": round(ended - started, 2) if ended is not None else None,
        "memory_after_unload": memory(pid),
    }
    models.close()


def process_ends(pid: int, deadline: float) -> float | None:
    """When (time.monotonic()) the process `pid` was seen gone, or None if it outlived `deadline`."""
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return time.monotonic()
        time.sleep(0.05)
    return None


# ---------------------------------------------------------------- onnxruntime's CUDA provider


def onnx_functions(work: Path, accelerator: str) -> dict[str, tuple[FunctionManifest, Path, tuple[int, ...]]]:
    """The wide MLP and the convolution model as function folders asking for `accelerator`."""
    found: dict[str, tuple[FunctionManifest, Path, tuple[int, ...]]] = {}
    for name, model, shapes in (
        ("wide", wide(), ((FEATURES,), (FEATURES,))),
        ("conv", conv(), (CONV_INPUT, (CONV_CLASSES,))),
    ):
        folder = work / accelerator / name
        if not (folder / "function.yaml").is_file():
            write_function(
                work / accelerator,
                name,
                model,
                0,
                shapes=shapes,
                max_batch_size=1024,
                preferred_batch_sizes=[256],
            )
            data = yaml.safe_load((folder / "function.yaml").read_text())
            data["model"]["accelerator"] = accelerator
            (folder / "function.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        found[name] = (load_manifest(folder / "function.yaml"), folder, shapes[0])
    return found


def providers(work: Path, seconds: float) -> dict[str, Any]:
    """Each model on the CUDA provider through the runner's OnnxBackend and through a bare
    onnxruntime session on the same provider, at batch 1 to 1024, their answers against the CPU's,
    and NVML's memory before the load, after it and after the unload."""
    import onnxruntime as ort

    from runner.backends.onnx import OnnxBackend
    from runner.backends.providers import Acceleration

    result: dict[str, Any] = {"onnxruntime": ort.__version__, "providers": ort.get_available_providers()}
    for name, (manifest, folder, shape) in onnx_functions(work, "cuda").items():
        item: dict[str, Any] = {"memory_before_load": memory()}
        try:
            backend = OnnxBackend(manifest, folder, 1, Acceleration(engine_dir=work / "engines"))
        except FunctionError as exc:
            result[name] = {**item, "error": exc.message}
            continue
        item |= {
            "device": backend.device,
            "fallback_reason": backend.fallback_reason,
            "device_memory_mib": backend.device_memory_bytes // gpu.MIB,
            "memory_after_load": memory(),
        }
        model = str(folder / "model.onnx")
        bare = ort.InferenceSession(model, providers=[("CUDAExecutionProvider", {})])
        cpu = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        item["bare_session_providers"] = bare.get_providers()
        check = random_batches(shape, 32, 1)[0]
        difference = np.abs(backend.run(check, ["output"])["output"] - cpu.run(None, check)[0])
        item["max_abs_diff_vs_cpu"] = float(np.max(difference))
        ways: dict[str, Callable[[Tensors], object]] = {
            "runner": functools.partial(backend.run, outputs=["output"]),
            "bare": functools.partial(bare.run, None),
        }
        item["batches"] = {
            str(rows): {way: timing(call, random_batches(shape, rows), seconds) for way, call in ways.items()}
            for rows in PROVIDER_BATCHES
        }
        ways.clear()
        del bare, cpu
        backend.close()
        item["memory_after_unload"] = memory()
        result[name] = item
    return result


def tensorrt_fallback(work: Path) -> dict[str, Any]:
    """accelerator: tensorrt where onnxruntime-gpu has no TensorRT to load: the model runs on CUDA
    with the reason, and a runner that requires the accelerator refuses it."""
    from runner.backends.onnx import OnnxBackend
    from runner.backends.providers import Acceleration

    manifest, folder, _shape = onnx_functions(work, "tensorrt")["wide"]
    backend = OnnxBackend(manifest, folder, 1, Acceleration(engine_dir=work / "engines"))
    result: dict[str, Any] = {"device": backend.device, "fallback_reason": backend.fallback_reason}
    backend.close()
    try:
        OnnxBackend(manifest, folder, 1, Acceleration(engine_dir=work / "engines", require=True)).close()
        result["refused"] = None
    except FunctionError as exc:
        result["refused"] = exc.message
    return result


# ---------------------------------------------------------------- through fngate up


def up(work: Path, seconds: float) -> dict[str, Any]:
    """functions/gpu-mlp served by `fngate up` (its private Redis, gateway, the local scaler's
    runner), driven by bench/loadgen.py over loopback, every 50th answer checked against the same
    model called here."""
    from bench import loadgen
    from bench.__main__ import checker, requests_for, wait_live
    from bench.coldstart import fngate_up
    from runner.sandbox import load_model

    repo = work / "up-repo"
    shutil.copytree(GPU_FUNCTION, repo / "gpu-mlp", dirs_exist_ok=True)
    direct = load_model(GPU_FUNCTION / "model.py", GPU_FUNCTION)
    result: dict[str, Any] = {"direct_device": direct.device, "concurrency": {}}
    env = {key: value for key, value in os.environ.items() if not key.startswith("FNGATE_")}
    with fngate_up(None, str(repo), False, env, work / "logs", wait_live, name="gpu") as (url, log):
        port = int(url.rsplit(":", 1)[1])
        started = time.perf_counter()  # the first invocation starts a runner and loads the model
        first = httpx.post(
            f"{url}/v1/functions/gpu-mlp", json={"inputs": {"input": [[0.0] * 256]}}, timeout=120
        )
        result["first_invocation"] = {
            "status": first.status_code,
            "s": round(time.perf_counter() - started, 3),
        }
        for concurrency in CONCURRENCIES:
            requests, inputs = requests_for("gpu-mlp", 256, 2000, True, concurrency)
            check = checker(inputs, 256, lambda x: direct.infer({"input": x})["output"])
            done = asyncio.run(
                loadgen.run("127.0.0.1", port, requests, concurrency, seconds / 3, seconds, check)
            )
            result["concurrency"][str(concurrency)] = {
                "req_per_s": round(done.throughput, 1),
                "p50_ms": round(done.percentile_ms(50), 3),
                "p99_ms": round(done.percentile_ms(99), 3),
                "errors": done.errors,
                "error_sample": done.error_sample[:200],
                "checked": done.checked,
            }
        result["runner_said"] = [
            line for line in log.read_text(errors="replace").splitlines() if "gpu-mlp runs" in line
        ]
    return result


# ---------------------------------------------------------------- TensorRT (needs tensorrt)


def wide_function(work: Path, accelerator: str = "cpu", precision: str = "fp32") -> tuple[Any, Path]:
    """The benchmark's wide MLP as a function folder with this accelerator (built once per folder)."""
    folder = work / f"wide-{accelerator}-{precision}"
    if not (folder / "wide" / "function.yaml").is_file():
        write_function(folder, "wide", wide(), FEATURES, max_batch_size=32, preferred_batch_sizes=[32])
        path = folder / "wide" / "function.yaml"
        data = yaml.safe_load(path.read_text())
        data["model"].update(accelerator=accelerator, precision=precision)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_manifest(folder / "wide" / "function.yaml"), folder / "wide"


def max_difference(backend: Any, work: Path) -> float:
    from runner.backends.onnx import OnnxBackend

    manifest, folder = wide_function(work)
    reference = OnnxBackend(manifest, folder, 4)
    batch = {"input": np.random.default_rng(7).standard_normal((32, FEATURES), dtype=np.float32)}
    try:
        expected = reference.run(batch, ["output"])["output"]
    finally:
        reference.close()
    return round(float(np.max(np.abs(backend.run(batch, ["output"])["output"] - expected))), 5)


def time_config(work: Path, name: str, seconds: float) -> dict[str, Any]:
    """One TensorRT configuration, loaded and timed in this process."""
    result: dict[str, Any] = {"name": name}
    try:
        started = time.perf_counter()
        if name == "tensorrt-native-fp16":
            backend = native_backend(work, result)
        else:
            from runner.backends.onnx import OnnxBackend
            from runner.backends.providers import Acceleration

            accelerator, precision, wanted = CONFIGS[name]
            manifest, folder = wide_function(work, accelerator, precision)
            acceleration = Acceleration(engine_dir=work / "engines" / name, require=True)
            result["wanted"] = wanted
            backend = OnnxBackend(manifest, folder, min(os.cpu_count() or 1, 16), acceleration)
        result |= {"load_s": round(time.perf_counter() - started, 3), "device": backend.device}
        result["device_memory_bytes"] = backend.device_memory_bytes
        result["fallback_reason"] = getattr(backend, "fallback_reason", None)
        try:
            result["batches"] = {
                str(rows): timing(
                    lambda batch: backend.run(batch, ["output"]), random_batches((FEATURES,), rows), seconds
                )
                for rows in TENSORRT_BATCHES
            }
            result["max_abs_diff_vs_cpu"] = max_difference(backend, work)
        finally:
            backend.close()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


def native_backend(work: Path, result: dict[str, Any]) -> Any:
    """The same model as a native fp16 .plan through the tensorrt backend (built here first)."""
    from runner.backends.tensorrt import TensorRTBackend, build_plan

    manifest, folder = wide_function(work, "cpu", "fp32")
    result["wanted"] = "TensorRT"
    started = time.perf_counter()
    build_plan(manifest, folder / "model.onnx", folder / "model.plan", fp16=True)
    result["build_s"] = round(time.perf_counter() - started, 3)
    native = manifest.model_copy(
        update={"model_spec": manifest.model.model_copy(update={"backend": "tensorrt", "path": "model.plan"})}
    )
    return TensorRTBackend(native, folder)


def cold(work: Path, engines: Path, store: Path) -> dict[str, Any]:
    """One cold start in this new process: the TensorRT fp16 function, its engine cache in `store`."""
    from prometheus_client import REGISTRY

    from runner.backends.engine_cache import FolderEngineStore
    from runner.backends.onnx import OnnxBackend
    from runner.backends.providers import Acceleration

    manifest, folder = wide_function(work, "tensorrt", "fp16")
    started = time.perf_counter()
    try:
        accel = Acceleration(engines, FolderEngineStore(store), require=True)
        backend = OnnxBackend(manifest, folder, 1, accel)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    backend.run({"input": np.zeros((1, FEATURES), dtype=np.float32)}, ["output"])
    load_s = round(time.perf_counter() - started, 3)
    events = {
        event: REGISTRY.get_sample_value(
            "fngate_engine_cache_events_total", {"function": "wide", "event": event}
        )
        for event in ("local", "downloaded", "miss", "mismatch", "stale", "uploaded", "upload_failed")
    }
    backend.close()
    return {
        "load_and_first_answer_s": load_s,
        "device": backend.device,
        "events": {k: v for k, v in events.items() if v},
    }


# ---------------------------------------------------------------- the command line


def on_gpu(name: str, result: dict[str, Any]) -> bool:
    """Whether a measurement ran where it was to: on the GPU."""
    if "error" in result:
        return False
    if name == "python-function":
        return bool(result.get("device") == "python:cuda" and result.get("process_ended_after_s") is not None)
    if name == "providers":
        models = [result.get(model, {}) for model in ("wide", "conv")]
        return all(model.get("device") == "CUDAExecutionProvider" for model in models)
    if name == "tensorrt-fallback":
        return result.get("device") == "CUDAExecutionProvider" and bool(result.get("refused"))
    if name == "up":
        figures = result.get("concurrency", {}).values()
        return (
            bool(figures)
            and all(item["errors"] == 0 for item in figures)
            and result["direct_device"] == "cuda"
        )
    if name == "cold":
        return result.get("device") == "TensorrtExecutionProvider"
    return result.get("device") == result.get("wanted")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("python-function", "providers", "tensorrt-fallback", "up", "config", "cold"):
        command = commands.add_parser(name)
        command.add_argument("--work", type=Path, required=True)
        command.add_argument("--seconds", type=float, default=1.0)
        if name == "config":
            command.add_argument("name", choices=[*CONFIGS, "tensorrt-native-fp16"])
        if name == "cold":
            command.add_argument("--engines", type=Path, required=True)
            command.add_argument("--store", type=Path, required=True)
    arguments = parser.parse_args(argv)
    work: Path = arguments.work
    work.mkdir(parents=True, exist_ok=True)
    try:
        if arguments.command == "python-function":
            result = python_function(work, arguments.seconds)
        elif arguments.command == "providers":
            result = providers(work, arguments.seconds)
        elif arguments.command == "tensorrt-fallback":
            result = tensorrt_fallback(work)
        elif arguments.command == "up":
            result = up(work, arguments.seconds)
        elif arguments.command == "config":
            result = time_config(work, arguments.name, arguments.seconds)
        else:
            result = cold(work, arguments.engines, arguments.store)
    except Exception as exc:  # a measurement that breaks says how, as its result
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result, default=str), flush=True)
    return 0 if on_gpu(arguments.command, result) else 1


if __name__ == "__main__":
    sys.exit(main())
