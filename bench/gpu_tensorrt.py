"""The TensorRT measurements of a device run (python -m bench.gpu config|cold): the wide MLP on
onnxruntime's TensorRT provider and as a native .plan, and cold starts with and without a stored
engine. They need TensorRT, which the borrowed GPU machine lacks (docs/gpu.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.gpu import FEATURES, random_batches, timing
from bench.models import wide, write_function
from fngate.manifest import load_manifest

TENSORRT_BATCHES = (1, 32)
CONFIGS = {  # name: accelerator, precision, the device it must run on
    "tensorrt-fp16": ("tensorrt", "fp16", "TensorrtExecutionProvider"),
}


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
