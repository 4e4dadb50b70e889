"""Device checks of the GPU work (docs/gpu.md), run by scripts/gpu_check.sh from the repository root:

    python scripts/gpu_check.py all --out DIR [--wheels DIR] [--budget-s S]   every step below, in order
    python scripts/gpu_check.py check          what the machine has, one line per missing piece
    python scripts/gpu_check.py environment    versions, the GPU, onnxruntime's CUDA build, the
                                               libraries its GPU providers link and where they were found
    python scripts/gpu_check.py config NAME --work DIR     one timing of the wide benchmark model
    python scripts/gpu_check.py cold --work DIR --engines DIR --store DIR    one cold start
    python scripts/gpu_check.py wheels DIR [--have "NAME ..."] [--gpu]       (with network) the wheels
                                               of what a GPU machine lacks, for its Python

`all` runs each step in a process of its own under a limit: the smaller of the step's own and
what is left of the whole budget (a step that cannot get MIN_STEP_S is skipped). Results are
written after every step (results.json, summary.md, log.txt in DIR), so a step that overruns or
crashes loses only itself. This file imports only the standard library at the top: `all` and
`check` run before anything is known to be installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FEATURES = 512
BATCHES = (1, 32)
CONFIGS = {  # name: accelerator, precision, the device it must run on
    "cpu": ("cpu", "fp32", "CPUExecutionProvider"),
    "cuda": ("cuda", "fp32", "CUDAExecutionProvider"),
    "tensorrt-fp16": ("tensorrt", "fp16", "TensorrtExecutionProvider"),
}
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
"""What onnxruntime-gpu 1.31's providers link, as onnxruntime's own preload_dlls names them for
CUDA 13 (and TensorRT's), looked for in the wheels whether or not onnxruntime-gpu is installed."""
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
MIN_STEP_S = 5.0
RESERVE_S = 10.0
"""Kept back from every step's limit for writing results and the summary."""
GRACE_S = 3.0
"""After its limit a step's processes get SIGTERM, and SIGKILL this much later."""
TOOLS = ("pytest", "pytest-asyncio", "pytest-timeout", "onnx")
GPU_PIECES = (  # what, the module that tells, what it is for
    ("onnxruntime-gpu 1.31 (CUDA 13 build)", "onnxruntime-gpu", "the CUDA and TensorRT providers"),
    ("TensorRT 10 for CUDA 13 (tensorrt-cu13)", "tensorrt", "the TensorRT provider and .plan engines"),
    ("cuda-python (cuda-bindings 13)", "cuda.bindings", ".plan engines and the CUDA device's UUID"),
    ("NVML's bindings (nvidia-ml-py)", "pynvml", "finding the GPU and its memory"),
)


# ---------------------------------------------------------------- the steps and their budget


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    limit_s: float
    needs: str = ""
    """A piece that `check` found missing makes the step skipped with this name as the reason."""


@dataclasses.dataclass
class Outcome:
    name: str
    status: str
    """PASS, FAIL (exit N), TIMEOUT (after N s), SKIPPED (why)."""
    took_s: float
    result: Any = None
    """The last JSON line the step printed, if any."""


def run_steps(
    steps: Sequence[Step],
    out: Path,
    budget_s: float,
    environment: dict[str, str] | None = None,
    reserve_s: float = RESERVE_S,
    missing: Sequence[str] = (),
    earlier: Sequence[Outcome] = (),
    min_step_s: float = MIN_STEP_S,
) -> list[Outcome]:
    """Run `steps` in order inside `budget_s` in all, writing the results (after `earlier`'s)
    after each one; returns every outcome, `earlier`'s first."""
    deadline = time.monotonic() + budget_s
    outcomes = list(earlier)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    for step in steps:
        left = deadline - time.monotonic() - reserve_s
        limit = min(step.limit_s, left)
        if step.needs and step.needs in missing:
            outcomes.append(Outcome(step.name, f"SKIPPED (needs {step.needs})", 0.0))
        elif left < min_step_s:
            outcomes.append(Outcome(step.name, f"SKIPPED (no time left: {max(left, 0):.0f} s)", 0.0))
        else:
            outcomes.append(run_step(step, limit, log, environment))
        print(f"== {step.name}: {outcomes[-1].status} ({outcomes[-1].took_s} s)", flush=True)
        write_results(out, outcomes)
    return outcomes


def run_step(step: Step, limit_s: float, log: Path, environment: dict[str, str] | None) -> Outcome:
    """One step in a new process group (so that its children end with it), output to `log`."""
    print(f"== {step.name} (at most {limit_s:.0f} s): {' '.join(step.command)}", flush=True)
    with log.open("a") as sink:
        sink.write(f"\n== {step.name} (at most {limit_s:.0f} s): {' '.join(step.command)}\n")
        sink.flush()
        start = sink.tell()
        started = time.monotonic()
        try:
            process = subprocess.Popen(
                step.command,
                cwd=ROOT,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environment,
                start_new_session=True,
            )
        except OSError as exc:
            sink.write(f"could not start: {exc}\n")
            return Outcome(step.name, f"FAIL ({exc})", 0.0)
        try:
            code = process.wait(timeout=limit_s)
            status = "PASS" if code == 0 else f"FAIL (exit {code})"
        except subprocess.TimeoutExpired:
            _end(process)
            status = f"TIMEOUT (after {limit_s:.0f} s)"
        took_s = round(time.monotonic() - started, 1)
    said = log.read_text(errors="replace")[start:]
    print(said[-4000:], end="" if said.endswith("\n") else "\n", flush=True)
    return Outcome(step.name, status, took_s, last_json(said))


def _end(process: subprocess.Popen[bytes]) -> None:
    for sent, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        try:
            os.killpg(process.pid, sent)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def last_json(text: str) -> Any:
    for line in reversed(text.splitlines()):
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def write_results(out: Path, outcomes: Sequence[Outcome]) -> None:
    (out / "results.json").write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=2))
    (out / "summary.md").write_text(summary(outcomes))


def summary(outcomes: Sequence[Outcome]) -> str:
    lines = [
        f"# fngate GPU check, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}",
        "",
        "| step | outcome | took s |",
        "|---|---|---|",
    ]
    lines += [f"| {o.name} | {o.status} | {o.took_s} |" for o in outcomes]
    by_name = {o.name: o for o in outcomes}
    gpu = by_name.get("a GPU is visible (nvidia-smi)")
    missing = by_name.get("what the machine has")
    for label, outcome in (("GPU", gpu), ("missing", missing)):
        if outcome is not None and isinstance(outcome.result, dict | list):
            lines += ["", f"{label}: `{json.dumps(outcome.result)}`"]
    timings = [o.result for o in outcomes if o.name.startswith("timing ") and isinstance(o.result, dict)]
    if timings:
        lines += [
            "",
            "| configuration | device | load s | batch 1 p50 ms | batch 32 p50 ms | batch 32 rows/s "
            "| max abs diff vs CPU | GPU memory MiB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for item in timings:
            if "batches" not in item:
                lines.append(f"| {item.get('name')} | not run: {item.get('error', '')} | | | | | | |")
                continue
            one, many = item["batches"]["1"], item["batches"]["32"]
            lines.append(
                f"| {item['name']} | {item['device']} | {item['load_s']} | {one['p50_ms']} | "
                f"{many['p50_ms']} | {many['rows_per_s']} | {item.get('max_abs_diff_vs_cpu', '')} | "
                f"{item.get('device_memory_bytes', 0) // 2**20} |"
            )
    colds = [(o.name, o.took_s, o.result) for o in outcomes if o.name.startswith("cold start")]
    if colds:
        lines += [
            "",
            "| cold start (new process, TensorRT fp16) | wall s | load + first answer s | engine cache |",
        ]
        lines += ["|---|---|---|---|"]
        for name, took_s, said in colds:
            found = said if isinstance(said, dict) else {}
            first_s = found.get("load_and_first_answer_s", found.get("error", ""))
            events = found.get("events", "")
            lines.append(f"| {name} | {took_s} | {first_s} | {events} |")
    return "\n".join(lines) + "\n"


def plan(out: Path, wheels: Path | None, scratch: Path) -> tuple[list[Step], dict[str, str]]:
    """Every step of a device run and the environment they run in (the wheels' folder first)."""
    python = sys.executable
    site = scratch / "site"
    environment = dict(os.environ, PYTHONUNBUFFERED="1", REQUIRE_GPU="1")
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    work = scratch / "work"
    me = [python, str(Path(__file__).resolve())]
    steps = [
        Step(
            "a GPU is visible (nvidia-smi)",
            [python, "-c", NVIDIA_SMI],
            20,
        )
    ]
    if wheels is not None:
        steps.append(
            Step(
                f"install the wheels in {wheels}",
                [
                    python,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--no-index",
                    "--no-deps",
                    "--no-compile",
                    "--disable-pip-version-check",
                    "--upgrade",
                    "--target",
                    str(site),
                    *sorted(str(path) for path in wheels.glob("*.whl")),
                ],
                300,
            )
        )
    steps += [
        Step("what the machine has", [*me, "check"], 30),
        Step("environment", [*me, "environment"], 60, needs="fngate"),
        Step(
            "pytest -m gpu",
            [
                python,
                "-m",
                "pytest",
                "--noconftest",
                "-p",
                "no:cacheprovider",
                "-m",
                "gpu",
                "-q",
                "-rA",
                "-o",
                "timeout=90",
                "tests/runner/test_gpu_backends.py",
                "tests/runner/test_gpu_memory.py",
            ],
            180,
            needs="fngate",
        ),
    ]
    steps += [
        Step(f"timing {name}", [*me, "config", name, "--work", str(work)], 60, needs="fngate")
        for name in (*CONFIGS, "tensorrt-native-fp16")
    ]
    steps += [
        Step(
            f"cold start {label}",
            [
                *me,
                "cold",
                "--work",
                str(work),
                "--engines",
                str(scratch / f"cold-engines-{index}"),
                "--store",
                str(scratch / "cold-store"),
            ],
            limit_s,
            needs="fngate",
        )
        for index, (label, limit_s) in enumerate(
            (("without a stored engine", 120), ("with the stored engine", 60))
        )
    ]
    return steps, environment


NVIDIA_SMI = """
import json, shutil, subprocess, sys
if not shutil.which("nvidia-smi"):
    sys.exit("missing: nvidia-smi (NVIDIA's driver): no GPU to check")
query = "name,driver_version,memory.total,compute_cap,uuid"
done = subprocess.run(["nvidia-smi", "--query-gpu=" + query, "--format=csv,noheader"],
                      capture_output=True, text=True, timeout=15)
rows = [line.split(", ") for line in done.stdout.splitlines() if line.strip()]
if done.returncode or not rows:
    sys.exit("nvidia-smi sees no GPU: " + (done.stderr or done.stdout).strip())
print(json.dumps([dict(zip(query.split(","), row)) for row in rows]))
"""


def run_all(out: Path, wheels: Path | None, budget_s: float, scratch: Path) -> int:
    """Exit status: 0 when every step passed, 2 when no GPU is visible, else 1."""
    (out / "log.txt").unlink(missing_ok=True)
    steps, environment = plan(out, wheels, scratch)
    deadline = time.monotonic() + budget_s
    outcomes = run_steps(steps[:1], out, budget_s, environment)
    if outcomes[0].status != "PASS":
        print("gpu_check: no NVIDIA GPU is visible; nothing else is worth running", file=sys.stderr)
        return 2
    setup = [step for step in steps[1:] if not step.needs]
    outcomes = run_steps(setup, out, deadline - time.monotonic(), environment, earlier=outcomes)
    found = next((o.result for o in outcomes if o.name == "what the machine has"), None)
    missing = ["fngate"] if not isinstance(found, dict) or found.get("fngate_missing") else []
    rest = [step for step in steps[1:] if step.needs]
    outcomes = run_steps(
        rest, out, deadline - time.monotonic(), environment, missing=missing, earlier=outcomes
    )
    print((out / "summary.md").read_text())
    return 0 if all(o.status == "PASS" for o in outcomes) else 1


# ---------------------------------------------------------------- check


def installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def requirement_name(requirement: str) -> str:
    for stop in "[<>=~!; ":
        requirement = requirement.split(stop, 1)[0]
    return requirement.strip()


def check() -> int:
    """One line per piece: `ok:` or `missing:`, then a JSON line the summary keeps. Exit 1 when
    fngate itself cannot run (its dependencies or the test tools are missing)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    fngate_missing = []
    for requirement in [*project["dependencies"], *TOOLS]:
        name = requirement_name(requirement)
        if "sys_platform" in requirement and sys.platform == "win32":
            continue
        version = installed(name)
        if version is None:
            fngate_missing.append(name)
            print(f"missing: {name} (fngate needs {requirement}): install it, or put its wheel in WHEELS")
        else:
            print(f"ok: {name} {version}")
    gpu_missing = []
    for what, module, purpose in GPU_PIECES:
        if module == "onnxruntime-gpu":
            version = installed(module)
            if version is None and installed("onnxruntime"):
                cpu_build = installed("onnxruntime")
                print(f"missing: {what}, for {purpose}: only the CPU package onnxruntime {cpu_build} is here")
                gpu_missing.append(module)
                continue
        else:
            version = "present" if importable(module) else None
        if version is None:
            print(f"missing: {what}, for {purpose}")
            gpu_missing.append(module)
        else:
            print(f"ok: {what}: {version}")
    print(json.dumps({"fngate_missing": fngate_missing, "gpu_missing": gpu_missing}))
    return 1 if fngate_missing else 0


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download_wheels(
    dest: Path, python_version: str, have: set[str], gpu: bool, pip_arguments: list[str]
) -> int:
    """Download, for a GPU machine without network, the wheels of fngate's dependencies and the
    test tools (and its gpu extra with `gpu`) for Linux x86-64 and this Python version, then drop
    those of the distributions `have` names (what that machine already has)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *TOOLS, *(project["optional-dependencies"]["gpu"] if gpu else [])]
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    command = [
        sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(dest),
        "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
        *platforms, *pip_arguments, *wanted,
    ]  # fmt: skip
    if subprocess.run(command, check=False).returncode != 0:
        print("gpu_check: pip download failed (see above)", file=sys.stderr)
        return 1
    skipped = {normalized(name) for name in have}
    total = 0
    for path in sorted(dest.glob("*.whl")):
        if normalized(path.name.split("-", 1)[0]) in skipped:
            path.unlink()
        else:
            total += path.stat().st_size
            print(f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB")
    print(f"{total / 2**20:.1f} MiB of wheels in {dest}")
    return 0


# ---------------------------------------------------------------- environment


def environment() -> int:
    """What this machine offers fngate, as the runner sees it."""
    sys.path.insert(0, str(ROOT))
    from runner import gpu
    from runner.backends.libraries import needed_libraries, preload, wheel_libraries, wheel_roots
    from runner.backends.providers import PROVIDER_LIBRARIES, probe

    for name in (
        "onnxruntime",
        "onnxruntime-gpu",
        "tensorrt-cu13",
        "tensorrt",
        "cuda-bindings",
        "nvidia-ml-py",
    ):
        print(f"{name}: {installed(name) or 'not installed'}")
    print(f"python: {sys.version.split()[0]} ({sys.executable})")
    print(f"CUDA_VISIBLE_DEVICES: {os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    print(f"gpu (CUDA index 0): {gpu.find_device(0)}")
    print(f"memory: {gpu.read_memory(0)}")
    try:
        import onnxruntime as ort
    except ImportError as exc:
        print(f"onnxruntime: cannot be imported ({exc})")
        return 1
    print(f"onnxruntime {ort.__version__} from {Path(ort.__file__).parent}")
    print(f"onnxruntime's CUDA build: {getattr(ort, 'cuda_version', '') or 'none (a CPU build)'}")
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
        loaded = preload(library, roots)
        for path in loaded.loaded:
            print(f"  loaded {path}")
        for failure in loaded.failed:
            print(f"  FAILED {failure}")
    found = wheel_libraries(wheel_roots())
    for name in CUDA_LIBRARIES:
        print(f"{name}: {found.get(name, 'not in any NVIDIA wheel folder on sys.path')}")
    print(f"runner's view: {probe(0)}")
    return 0


# ---------------------------------------------------------------- timings


def function(work: Path, accelerator: str = "cpu", precision: str = "fp32") -> tuple[Any, Path]:
    """The benchmark's wide MLP as a function folder with this accelerator (built once per folder)."""
    import yaml

    from bench.models import wide, write_function
    from fngate.manifest import load_manifest

    folder = work / f"wide-{accelerator}-{precision}"
    if not (folder / "wide" / "function.yaml").is_file():
        write_function(folder, "wide", wide(), FEATURES, max_batch_size=32, preferred_batch_sizes=[32])
        path = folder / "wide" / "function.yaml"
        data = yaml.safe_load(path.read_text())
        data["model"].update(accelerator=accelerator, precision=precision)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_manifest(folder / "wide" / "function.yaml"), folder / "wide"


def measure(backend: Any, batch: int, seconds: float) -> dict[str, float]:
    import numpy as np

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


def max_difference(backend: Any, work: Path) -> float:
    import numpy as np

    from runner.backends.onnx import OnnxBackend

    manifest, folder = function(work)
    reference = OnnxBackend(manifest, folder, 4)
    batch = {"input": np.random.default_rng(7).standard_normal((32, FEATURES), dtype=np.float32)}
    try:
        expected = reference.run(batch, ["output"])["output"]
    finally:
        reference.close()
    return round(float(np.max(np.abs(backend.run(batch, ["output"])["output"] - expected))), 5)


def time_config(work: Path, name: str, seconds: float) -> int:
    """One configuration, loaded and timed in this process; prints its result as one JSON line."""
    sys.path.insert(0, str(ROOT))
    result: dict[str, Any] = {"name": name}
    try:
        started = time.perf_counter()
        if name == "tensorrt-native-fp16":
            backend = native_backend(work, result)
        else:
            from runner.backends.onnx import OnnxBackend
            from runner.backends.providers import Acceleration

            accelerator, precision, wanted = CONFIGS[name]
            manifest, folder = function(work, accelerator, precision)
            acceleration = Acceleration(engine_dir=work / "engines" / name, require=True)
            result["wanted"] = wanted
            backend = OnnxBackend(manifest, folder, min(os.cpu_count() or 1, 16), acceleration)
        result |= {"load_s": round(time.perf_counter() - started, 3), "device": backend.device}
        result["device_memory_bytes"] = backend.device_memory_bytes
        result["fallback_reason"] = getattr(backend, "fallback_reason", None)
        try:
            result["batches"] = {str(batch): measure(backend, batch, seconds) for batch in BATCHES}
            result["max_abs_diff_vs_cpu"] = max_difference(backend, work)
        finally:
            backend.close()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(result), flush=True)
    return 0 if "error" not in result and result.get("device") == result.get("wanted") else 1


def native_backend(work: Path, result: dict[str, Any]) -> Any:
    """The same model as a native fp16 .plan through the tensorrt backend (built here first)."""
    from runner.backends.tensorrt import TensorRTBackend, build_plan

    manifest, folder = function(work, "cpu", "fp32")
    result["wanted"] = "TensorRT"
    started = time.perf_counter()
    build_plan(manifest, folder / "model.onnx", folder / "model.plan", fp16=True)
    result["build_s"] = round(time.perf_counter() - started, 3)
    native = manifest.model_copy(
        update={"model_spec": manifest.model.model_copy(update={"backend": "tensorrt", "path": "model.plan"})}
    )
    return TensorRTBackend(native, folder)


def cold(work: Path, engines: Path, store: Path) -> int:
    """One cold start in this new process: the TensorRT fp16 function, its engine cache in `store`."""
    sys.path.insert(0, str(ROOT))
    import numpy as np
    from prometheus_client import REGISTRY

    from runner.backends.engine_cache import FolderEngineStore
    from runner.backends.onnx import OnnxBackend
    from runner.backends.providers import Acceleration

    manifest, folder = function(work, "tensorrt", "fp16")
    started = time.perf_counter()
    try:
        accel = Acceleration(engines, FolderEngineStore(store), require=True)
        backend = OnnxBackend(manifest, folder, 1, accel)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    backend.run({"input": np.zeros((1, FEATURES), dtype=np.float32)}, ["output"])
    load_s = round(time.perf_counter() - started, 3)
    events = {
        event: REGISTRY.get_sample_value(
            "fngate_engine_cache_events_total", {"function": "wide", "event": event}
        )
        for event in ("local", "downloaded", "miss", "mismatch", "stale", "uploaded", "upload_failed")
    }
    said = {
        "load_and_first_answer_s": load_s,
        "device": backend.device,
        "events": {k: v for k, v in events.items() if v},
    }
    print(json.dumps(said), flush=True)
    backend.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    everything = commands.add_parser("all")
    everything.add_argument("--out", type=Path, required=True)
    everything.add_argument("--wheels", type=Path)
    everything.add_argument("--budget-s", type=float, default=480.0)
    everything.add_argument(
        "--scratch", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fngate-gpu-check"
    )
    commands.add_parser("check")
    commands.add_parser("environment")
    download = commands.add_parser("wheels")
    download.add_argument("dest", type=Path)
    download.add_argument("--python-version", default="3.12")
    download.add_argument("--have", default="", help="distributions the GPU machine has, separated by spaces")
    download.add_argument(
        "--gpu", action="store_true", help="also the gpu extra (GBs; TensorRT needs NVIDIA's index)"
    )
    download.add_argument(
        "pip_arguments", nargs="*", help="after --: more pip arguments (--extra-index-url URL)"
    )
    config = commands.add_parser("config")
    config.add_argument("name", choices=[*CONFIGS, "tensorrt-native-fp16"])
    config.add_argument("--work", type=Path, required=True)
    config.add_argument("--seconds", type=float, default=1.0)
    cold_parser = commands.add_parser("cold")
    for name in ("--work", "--engines", "--store"):
        cold_parser.add_argument(name, type=Path, required=True)
    arguments = parser.parse_args()
    if arguments.command == "all":
        wheels = arguments.wheels if arguments.wheels and any(arguments.wheels.glob("*.whl")) else None
        arguments.scratch.mkdir(parents=True, exist_ok=True)
        arguments.out.mkdir(parents=True, exist_ok=True)
        return run_all(arguments.out, wheels, arguments.budget_s, arguments.scratch)
    if arguments.command == "check":
        return check()
    if arguments.command == "environment":
        return environment()
    if arguments.command == "wheels":
        arguments.dest.mkdir(parents=True, exist_ok=True)
        have = set(arguments.have.replace(",", " ").split())
        return download_wheels(
            arguments.dest, arguments.python_version, have, arguments.gpu, arguments.pip_arguments
        )
    if arguments.command == "config":
        arguments.work.mkdir(parents=True, exist_ok=True)
        return time_config(arguments.work, arguments.name, arguments.seconds)
    arguments.work.mkdir(parents=True, exist_ok=True)
    return cold(arguments.work, arguments.engines, arguments.store)


if __name__ == "__main__":
    sys.exit(main())
