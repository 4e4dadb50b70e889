"""The measurements of a GPU device run (scripts/gpu_check.py runs each in a process of its own and
keeps the JSON line it prints last), each usable alone:

    python -m bench.gpu environment --work DIR   versions, the GPU, onnxruntime's CUDA build, what
        its providers link, what the runner preloads and where each CUDA library was found
    python -m bench.gpu python-function --work DIR [--seconds S]   functions/gpu-mlp through the
        runner (its own process, the idle unload) against the same code called directly
    python -m bench.gpu providers --work DIR [--seconds S]   the wide MLP and a convolution model on
        onnxruntime's CUDA provider through the runner's backend against a bare session.run
    python -m bench.gpu tensorrt-fallback --work DIR   accelerator: tensorrt without TensorRT
    python -m bench.gpu up --work DIR [--seconds S]   functions/gpu-mlp through `fngate up` (needs
        redis-server), bench/loadgen.py at 1, 16 and 64 connections
    python -m bench.gpu serving --work DIR [--seconds S]   gpu-mlp (CuPy) and torch-mlp (torch) under
        `fngate up`: cold starts and their phases, both at once, batch 1 to 1024, the device's memory
        back to its baseline after the idle unload, and a GPU memory budget's evictions
    python -m bench.gpu config NAME --work DIR   one TensorRT timing of the wide model (bench/gpu_tensorrt.py)
    python -m bench.gpu cold --work DIR --engines DIR --store DIR   one TensorRT cold start

Each exits 0 when what it measured ran where it was to (a GPU), else 1, its figures printed either way.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.metadata
import json
import os
import shutil
import subprocess
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
from fngate.tensors import Tensors
from runner import gpu

ROOT = Path(__file__).resolve().parent.parent
GPU_FUNCTION = ROOT / "functions" / "gpu-mlp"
FEATURES = 512
FUNCTION_BATCHES = (1, 4, 16, 64, 256, 1024)
PROVIDER_BATCHES = (1, 32, 256, 1024)
CONCURRENCIES = (1, 16, 64)
UNLOAD_WAIT_S = 10.0


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


# ---------------------------------------------------------------- environment


CUDA_LIBRARIES = (
    "libcudart.so.13",
    "libcublas.so.13",
    "libcublasLt.so.13",
    "libcufft.so.12",
    "libcurand.so.10",
    "libnvrtc.so.13",
    "libcudnn.so.9",
    "libnvinfer.so.10",
)
"""What onnxruntime-gpu 1.31's providers link or open (its preload_dlls list for CUDA 13, and
TensorRT's), looked for in the wheels whether or not onnxruntime-gpu is installed."""


def installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """What this machine offers fngate, as the runner sees it, line by line; returns the summary."""
    from runner.backends.libraries import (
        cuda_runtime_libraries,
        needed_libraries,
        preload,
        wheel_libraries,
        wheel_roots,
    )
    from runner.backends.providers import CUDA, PROVIDER_LIBRARIES, probe

    versions = {
        name: installed(name)
        for name in (
            "onnxruntime",
            "onnxruntime-gpu",
            "tensorrt-cu13",
            "cuda-bindings",
            "nvidia-ml-py",
            "torch",
        )
    }
    versions["cupy"] = next(
        (installed(name) for name in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if installed(name)), None
    )
    for name, version in versions.items():
        print(f"{name}: {version or 'not installed'}")
    print(f"python: {sys.version.split()[0]} ({sys.executable})")
    print(f"CUDA_VISIBLE_DEVICES: {os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    found_device = gpu.find_device(0)
    print(f"gpu (CUDA index 0): {found_device}")
    print(f"memory: {gpu.read_memory(0)}")
    import onnxruntime as ort

    cuda_version = getattr(ort, "cuda_version", "") or ""
    print(f"onnxruntime {ort.__version__} from {Path(ort.__file__).parent}")
    print(f"onnxruntime's CUDA build: {cuda_version or 'none (a CPU build)'}")
    print(f"onnxruntime's build: {ort.get_build_info()}")
    print(f"onnxruntime's providers: {ort.get_available_providers()}")
    capi = Path(ort.__file__).parent / "capi"
    roots = [capi, *wheel_roots()]
    for provider, file_name in PROVIDER_LIBRARIES.items():
        library = capi / file_name
        if not library.is_file():
            print(f"{provider}: {file_name} is not in this onnxruntime")
            continue
        print(f"{provider}: {library} links {list(needed_libraries(library))}")
        if shutil.which("readelf"):
            shown = subprocess.run(
                ["readelf", "-d", str(library)], capture_output=True, text=True, timeout=30, check=False
            )
            print(
                "\n".join(
                    f"  readelf: {line.strip()}" for line in shown.stdout.splitlines() if "NEEDED" in line
                )
            )
        loaded = preload(library, roots, cuda_runtime_libraries(cuda_version) if provider == CUDA else ())
        for path in loaded.loaded:
            print(f"  loaded {path}")
        for failure in (*loaded.failed, *loaded.absent):
            print(f"  FAILED {failure}")
    found = wheel_libraries(wheel_roots())
    for name in CUDA_LIBRARIES:
        print(f"{name}: {found.get(name, 'not in any NVIDIA wheel folder on sys.path')}")
    view = probe(0)
    print(f"runner's view: {view}")
    libraries = {name: str(found[name]) if name in found else None for name in CUDA_LIBRARIES}
    said = {
        "versions": versions,
        "device": str(found_device),
        "onnxruntime_cuda": cuda_version,
        "providers": list(view.available),
        "cuda_problem": view.cuda_problem,
        "tensorrt_problem": view.tensorrt_problem,
        "libraries": libraries,
    }
    return said


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


# ---------------------------------------------------------------- the serving path under fngate up

TORCH_MLP = """
\"\"\"A python-backend function in torch: relu(x @ w0) @ w1, its weights made here from a fixed seed,
on CUDA's device 0 (the GPU the runner gave this process); without torch's CUDA it says why.\"\"\"

import torch


class Model:
    def __init__(self, directory):
        self.fallback_reason = None if torch.cuda.is_available() else "torch sees no CUDA device"
        self.device = "cuda" if self.fallback_reason is None else "cpu"
        generator = torch.Generator().manual_seed(55)
        self.w0 = (torch.randn(256, 1024, generator=generator) / 16).to(self.device)
        self.w1 = (torch.randn(1024, 256, generator=generator) / 32).to(self.device)

    def infer(self, inputs):
        with torch.inference_mode():
            x = torch.from_numpy(inputs["input"]).to(self.device)
            return {"output": (torch.relu(x @ self.w0) @ self.w1).cpu().numpy()}

    def close(self):
        del self.w0, self.w1
        torch.cuda.empty_cache()
"""
SERVED = ("gpu-mlp", "torch-mlp")
IDLE_UNLOAD_S = 3
SETTLED_MIB = 64
"""After the idle unload, the device's memory in use may stay this far above its baseline."""


def serving_repo(work: Path) -> Path:
    """functions/gpu-mlp and torch-mlp (TORCH_MLP) on one pool, both unloaded after IDLE_UNLOAD_S idle."""
    repo = work / "serving-repo"
    shutil.copytree(GPU_FUNCTION, repo / "gpu-mlp", dirs_exist_ok=True)
    (repo / "torch-mlp").mkdir(parents=True, exist_ok=True)
    (repo / "torch-mlp" / "model.py").write_text(TORCH_MLP)
    manifest = yaml.safe_load((repo / "gpu-mlp" / "function.yaml").read_text())
    manifest["scaling"]["idle_unload_s"] = IDLE_UNLOAD_S
    (repo / "gpu-mlp" / "function.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    manifest |= {"name": "torch-mlp", "description": "The same shape of MLP in torch, on the runner's GPU"}
    (repo / "torch-mlp" / "function.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return repo


def phases(header: str) -> dict[str, float]:
    """A Server-Timing value (`start;dur=661.0, queue;dur=16.3, ...`) as phase -> ms."""
    found = {}
    for item in header.split(","):
        name, _, duration = item.strip().partition(";dur=")
        if name and duration:
            found[name] = float(duration)
    return found


def call(client: httpx.Client, function: str, rows: np.ndarray) -> tuple[httpx.Response, float]:
    """One V2 invocation with its tensors in binary (as perf_analyzer and Triton's clients send
    them: JSON would cost more than the model at 1024 rows) over the client's kept-alive connection
    (a connection a call would add some 20 ms, the client's own), and how long its answer took."""
    data = np.ascontiguousarray(rows, dtype=np.float32).tobytes()
    tensor = {"name": "input", "datatype": "FP32", "shape": list(rows.shape)}
    header = json.dumps(
        {
            "inputs": [tensor | {"parameters": {"binary_data_size": len(data)}}],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }
    ).encode()
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
    started = time.perf_counter()
    answer = client.post(f"/v2/models/{function}/infer", content=header + data, headers=headers, timeout=180)
    return answer, time.perf_counter() - started


def cold_call(client: httpx.Client, function: str) -> dict[str, Any]:
    """The function's first invocation, from no runner: its latency and the phases it waited for."""
    answer, took_s = call(client, function, np.zeros((1, 256), dtype=np.float32))
    found = phases(answer.headers.get("server-timing", ""))
    return {
        "status": answer.status_code,
        "error": None if answer.status_code == 200 else answer.text[:300],
        "s": round(took_s, 3),
        "phases_ms": found,
        "phases_sum_s": round(sum(found.values()) / 1000, 3),
    }


def sweep(client: httpx.Client, function: str, seconds: float) -> dict[str, Any]:
    """Rows per second and p50 per invocation of `function` at each batch size, one invocation at
    a time over HTTP (JSON), `seconds` each after one to warm up."""
    batches: dict[str, Any] = {}
    for rows in FUNCTION_BATCHES:
        batch = random_batches((FEATURES // 2,), rows, 1)[0]["input"]
        answer, _ = call(client, function, batch)
        if answer.status_code != 200:
            batches[str(rows)] = {"error": f"{answer.status_code} {answer.text[:200]}"}
            continue
        latencies: list[float] = []
        ended = time.perf_counter() + seconds
        while time.perf_counter() < ended or not latencies:
            answer, took_s = call(client, function, batch)
            if answer.status_code != 200:
                break
            latencies.append(took_s)
        batches[str(rows)] = {
            "rows_per_s": round(rows * len(latencies) / sum(latencies), 1),
            "p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 3),
        }
    return batches


def together(url: str, seconds: float) -> dict[str, Any]:
    """Both functions called at once from four threads each for `seconds`: how many answered, and
    how many did not."""
    import concurrent.futures

    def caller(function: str) -> tuple[int, int]:
        batch = random_batches((FEATURES // 2,), 16, 1)[0]["input"]
        ok = failed = 0
        ended = time.perf_counter() + seconds
        with httpx.Client(base_url=url) as client:
            while time.perf_counter() < ended:
                answer, _ = call(client, function, batch)
                ok, failed = (ok + 1, failed) if answer.status_code == 200 else (ok, failed + 1)
        return ok, failed

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = {pool.submit(caller, function): function for function in SERVED * 4}
        found: dict[str, Any] = {function: {"answered": 0, "failed": 0} for function in SERVED}
        for future, function in futures.items():
            ok, failed = future.result()
            found[function]["answered"] += ok
            found[function]["failed"] += failed
    return found


def settle(baseline: dict[str, Any] | None, deadline: float) -> tuple[dict[str, Any] | None, float | None]:
    """The device's memory once it is back within SETTLED_MIB of `baseline` (and when), or as it is
    at `deadline`."""
    started = time.monotonic()
    reading = memory()
    while reading is not None and baseline is not None and time.monotonic() < deadline:
        if reading["device_used_mib"] - baseline["device_used_mib"] <= SETTLED_MIB:
            return reading, round(time.monotonic() - started, 2)
        time.sleep(0.25)
        reading = memory()
    return reading, None


def log_lines(log: Path, *words: str) -> list[str]:
    return [
        line[-300:] for line in log.read_text(errors="replace").splitlines() if all(w in line for w in words)
    ]


def serving(work: Path, seconds: float) -> dict[str, Any]:
    """Under `fngate up` (its own Redis, gateway and the local scaler's runner), functions/gpu-mlp
    (CuPy) and torch-mlp (torch), one pool on one GPU: each from no runner to its first answer with
    the phases it waited for, both called at once, rows/s and p50 at batch 1 to 1024, the device's
    memory before any load, loaded and after the idle unload (it must come back to the baseline),
    then a second `fngate up` whose GPU memory budget holds one of the two but not both: each load
    evicts the other, idle, least recently used."""
    repo = serving_repo(work)
    env = {key: value for key, value in os.environ.items() if not key.startswith("FNGATE_")}
    extra = ["--idle-shutdown-s", "120"]  # the runner stays: the models' idle unload is what is measured
    result: dict[str, Any] = {"baseline": memory(), "functions": {}}
    up = fngate_up_for_bench(repo, env, work, "serving", extra)
    with up as (url, log), httpx.Client(base_url=url) as client:
        for function in SERVED:
            result["functions"][function] = {"cold": cold_call(client, function)}
        result["loaded"] = memory()
        result["together"] = together(url, seconds)
        for function in SERVED:
            result["functions"][function]["batches"] = sweep(client, function, seconds)
        result["after_idle_unload"], result["settled_after_s"] = settle(
            result["baseline"], time.monotonic() + IDLE_UNLOAD_S + 20
        )
        said = log_lines(log, "loaded ") + log_lines(log, "closed ") + log_lines(log, "runs on")
        result["runner_said"] = said
    taken = {function: gpu_mib_loaded(said, function) for function in SERVED}
    result["taken_mib"] = taken
    if not all(taken.values()):
        result["eviction"] = {"skipped": f"a model took no GPU memory, as its runner measured: {taken}"}
        return result
    small, large = sorted(size or 0 for size in taken.values())
    budget_mib = large + small // 2  # room for either, not for both
    eviction: dict[str, Any] = {"budget_mib": budget_mib, "answers": []}
    limited = env | {"FNGATE_GPU_MEMORY_BUDGET_BYTES": str(budget_mib * gpu.MIB)}
    up = fngate_up_for_bench(repo, limited, work, "budget", extra)
    with up as (url, log), httpx.Client(base_url=url) as client:
        for function in (*SERVED, SERVED[0]):
            answer, took_s = call(client, function, np.zeros((1, 256), dtype=np.float32))
            eviction["answers"].append([function, answer.status_code, round(took_s, 3)])
        eviction["runner_said"] = log_lines(log, "evicted")
    result["eviction"] = eviction
    return result


def gpu_mib_loaded(said: Sequence[str], function: str) -> int | None:
    """The GPU memory its runner said `function`'s load took ("loaded NAME version V (...): ...,
    N MiB of GPU memory"), the last time it said so."""
    import re

    found = None
    for line in said:
        match = re.search(rf"loaded {re.escape(function)} version .*?(\d+) MiB of GPU memory", line)
        if match:
            found = int(match.group(1))
    return found


def fngate_up_for_bench(repo: Path, env: dict[str, str], work: Path, name: str, extra: Sequence[str]) -> Any:
    from bench.__main__ import wait_live
    from bench.coldstart import fngate_up

    return fngate_up(None, str(repo), False, env, work / "logs", wait_live, name=name, extra=extra)


def serving_on_gpu(result: dict[str, Any]) -> bool:
    """Every function answered on the GPU, both at once without a failure, every batch size, the
    memory came back to its baseline, and each load under the budget evicted the other."""
    functions = result.get("functions", {})
    answered = all(
        item.get("cold", {}).get("status") == 200
        and all("rows_per_s" in row for row in item.get("batches", {}).values())
        for item in functions.values()
    )
    shared = all(item["failed"] == 0 and item["answered"] > 0 for item in result.get("together", {}).values())
    on_gpu = all(result.get("taken_mib", {}).get(function) for function in SERVED)
    eviction = result.get("eviction", {})
    evicted = len(eviction.get("runner_said", [])) >= 2 and all(
        row[1] == 200 for row in eviction.get("answers", [])
    )
    return (
        bool(functions)
        and answered
        and shared
        and on_gpu
        and result.get("settled_after_s") is not None
        and evicted
    )


# ---------------------------------------------------------------- the command line


def on_gpu(name: str, result: dict[str, Any]) -> bool:
    """Whether a measurement ran where it was to: on the GPU."""
    if "error" in result:
        return False
    if name == "environment":
        return True
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
    if name == "serving":
        return serving_on_gpu(result)
    return result.get("device") == result.get("wanted")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in (
        "environment",
        "python-function",
        "serving",
        "providers",
        "tensorrt-fallback",
        "up",
        "config",
        "cold",
    ):
        command = commands.add_parser(name)
        command.add_argument("--work", type=Path, required=True)
        command.add_argument("--seconds", type=float, default=1.0)
        if name == "config":
            command.add_argument("name", choices=["tensorrt-fp16", "tensorrt-native-fp16"])
        if name == "cold":
            command.add_argument("--engines", type=Path, required=True)
            command.add_argument("--store", type=Path, required=True)
    arguments = parser.parse_args(argv)
    work: Path = arguments.work
    work.mkdir(parents=True, exist_ok=True)
    try:
        if arguments.command == "environment":
            result = environment()
        elif arguments.command == "python-function":
            result = python_function(work, arguments.seconds)
        elif arguments.command == "providers":
            result = providers(work, arguments.seconds)
        elif arguments.command == "tensorrt-fallback":
            result = tensorrt_fallback(work)
        elif arguments.command == "up":
            result = up(work, arguments.seconds)
        elif arguments.command == "serving":
            result = serving(work, arguments.seconds)
        elif arguments.command == "config":
            from bench.gpu_tensorrt import time_config

            result = time_config(work, arguments.name, arguments.seconds)
        else:
            from bench.gpu_tensorrt import cold

            result = cold(work, arguments.engines, arguments.store)
    except Exception as exc:  # a measurement that breaks says how, as its result
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result, default=str), flush=True)
    return 0 if on_gpu(arguments.command, result) else 1


if __name__ == "__main__":
    sys.exit(main())
