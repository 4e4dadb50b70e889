"""Device checks of the GPU work (docs/gpu.md), from the repository root. On a machine with network:

    python scripts/gpu_check.py pack [--onnxruntime-wheel PATH] [--redis]   the folder .gpu/ for a GPU
        machine without network: the wheels of what it lacks, onnxruntime-gpu in parts, the calls
    python scripts/gpu_check.py wheels DIR [--have "NAME ..."] [--gpu]       those wheels alone

On the GPU machine, every call the same command (each call carrying what `pack` says):

    python3 scripts/gpu_check.py device --out DIR [--budget-s S]   call 1 (fngate's wheels and
        redis-server) runs the serving stage at once: GPU Python functions through the runner and
        under fngate up; the next calls keep the parts of onnxruntime-gpu that came; the one that
        brings the last puts it together, checks it and runs the ONNX stage
    python3 scripts/gpu_check.py all --out DIR [--wheels DIR] [--budget-s S]   every step below
    python3 scripts/gpu_check.py check          what the machine has, one line per missing piece

`all` runs each step in a process of its own under a limit: the smaller of the step's own and
what is left of the whole budget (a step that cannot get MIN_STEP_S is skipped, as is one that
needs what `check` found missing). Results are written after every step (results.json,
summary.md, log.txt in DIR), so a step that overruns or crashes loses only itself. The steps'
measurements are bench/gpu.py's. This file and bench/parts.py import only the standard library:
they run before anything is known to be installed.
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
sys.path.insert(0, str(ROOT))
from bench.parts import calls, lost, reassemble, received, split  # noqa: E402 - ROOT is on the path now

PACK = ROOT / ".gpu"
"""What `pack` makes and the calls carry (ignored by git: each part must travel once)."""
PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)
"""Every tag a wheel for Linux x86-64 and glibc 2.28 or later may carry: pip takes only those named."""
DEVICE_HAS = (
    "numpy torch cupy-cuda13x fastrlock cuda-bindings cuda-pathfinder nvidia-ml-py onnx onnxruntime "
    "protobuf ml-dtypes flatbuffers coloredlogs humanfriendly packaging sympy mpmath typing-extensions "
    "filelock networkx jinja2 markupsafe fsspec setuptools"
)
"""What the GPU machine's image holds (Python 3.12, torch with CUDA 13, CuPy, cuda-bindings,
nvidia-ml-py, onnx, the CPU onnxruntime, and what they depend on): `wheels` leaves them out. Its
pytest is not counted: pytest-asyncio wants pytest 8.4 or later, so pytest travels too (2 MiB)."""
ONNXRUNTIME_GPU = "onnxruntime-gpu==1.31.1"
CALL_BYTES = 60 * 2**20
"""What one call may carry, working tree included (64 MiB, less a margin)."""
MIN_STEP_S = 5.0
RESERVE_S = 10.0
"""Kept back from every step's limit for writing results and the summary."""
GRACE_S = 3.0
"""After its limit a step's processes get SIGTERM, and SIGKILL this much later."""
TOOLS = ("pytest", "pytest-asyncio", "pytest-timeout", "onnx", "httpx")
GPU_PIECES = (  # what, the module that tells, what it is for
    ("onnxruntime-gpu 1.31 (CUDA 13 build)", "onnxruntime-gpu", "the CUDA and TensorRT providers"),
    ("TensorRT 10 for CUDA 13 (tensorrt-cu13)", "tensorrt", "the TensorRT provider and .plan engines"),
    ("cuda-python (cuda-bindings 13)", "cuda.bindings", ".plan engines and the CUDA device's UUID"),
    ("NVML's bindings (nvidia-ml-py)", "pynvml", "finding the GPU and its memory"),
    ("CuPy", "cupy", "the GPU Python function (functions/gpu-mlp)"),
)
GPU_MODULES = (
    "runner.gpu",
    "runner.backends.libraries",
    "runner.backends.providers",
    "runner.backends.engine_cache",
    "runner.backends.onnx",
    "runner.backends.tensorrt",
    "runner.backends.python",
    "bench.gpu",
)
SERVING, ONNX, ALL = "serving", "onnx", "all"
"""The stages of a device run: the first call proves the serving path with what the machine has and
fngate's wheels; the last, once onnxruntime-gpu's parts have come, runs its steps. `all`: both."""
BUDGET_S = {SERVING: 200.0, ONNX: 240.0, ALL: 360.0}
"""Each stage's budget unless --budget-s (or GPU_CHECK_BUDGET_S) says otherwise: call 1's leaves
room in the 15 minutes of device time for it to run twice, the parts' calls and the last one."""
GPU_TESTS = {
    SERVING: ("tests/runner/test_gpu_python.py",),
    ONNX: ("tests/runner/test_gpu_backends.py", "tests/runner/test_gpu_memory.py"),
}


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
        lacking = next((name for name in ("fngate", step.needs) if step.needs and name in missing), None)
        if lacking is not None:  # a step that needs anything needs fngate too
            outcomes.append(Outcome(step.name, f"SKIPPED (needs {lacking})", 0.0))
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
    with log.open("ab") as sink:
        sink.write(f"\n== {step.name} (at most {limit_s:.0f} s): {' '.join(step.command)}\n".encode())
        sink.flush()
        start = sink.tell()  # a byte offset: what the step writes is read back as bytes
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
            sink.write(f"could not start: {exc}\n".encode())
            return Outcome(step.name, f"FAIL ({exc})", 0.0)
        try:
            code = process.wait(timeout=limit_s)
            status = "PASS" if code == 0 else f"FAIL (exit {code})"
        except subprocess.TimeoutExpired:
            _end(process)
            status = f"TIMEOUT (after {limit_s:.0f} s)"
        took_s = round(time.monotonic() - started, 1)
    said = log.read_bytes()[start:].decode(errors="replace")
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
    for outcome in outcomes:
        found = dict(outcome.result) if isinstance(outcome.result, dict) else outcome.result
        if not isinstance(found, dict | list):
            continue
        lines += ["", f"## {outcome.name}", ""]
        if isinstance(found, dict) and isinstance(found.get("batches"), dict):
            lines += batch_table(found["batches"])
            found = {key: value for key, value in found.items() if key != "batches"}
        if isinstance(found, dict):
            for model in ("wide", "conv"):
                if isinstance(found.get(model), dict) and isinstance(found[model].get("batches"), dict):
                    lines += [f"{model}:", "", *batch_table(found[model]["batches"]), ""]
                    found[model] = {key: value for key, value in found[model].items() if key != "batches"}
            functions = found.get("functions")
            if isinstance(functions, dict):  # the serving step's, function by function
                found["functions"] = dict(functions)
                for name, item in functions.items():
                    if isinstance(item, dict) and isinstance(item.get("batches"), dict):
                        lines += [f"{name}:", "", *batch_table(item["batches"]), ""]
                        found["functions"][name] = {
                            key: value for key, value in item.items() if key != "batches"
                        }
        lines.append(f"`{json.dumps(found)}`")
    return "\n".join(lines) + "\n"


def batch_table(batches: dict[str, Any]) -> list[str]:
    """Rows per second and p50 by batch size, one column pair for each way it was called."""
    ways = sorted({way for item in batches.values() if isinstance(item, dict) for way in item})
    if not ways or not all(isinstance(item.get(way), dict) for item in batches.values() for way in ways):
        ways = [""]  # one way only: the figures are the item itself
    header = " | ".join(
        f"{way + ' ' if way else ''}rows/s | {way + ' ' if way else ''}p50 ms" for way in ways
    )
    lines = [f"| batch | {header} |", "|---" * (1 + 2 * len(ways)) + "|"]
    for size, item in batches.items():
        cells = [item.get(way, {}) if way else item for way in ways]
        lines.append(
            f"| {size} | " + " | ".join(f"{c.get('rows_per_s')} | {c.get('p50_ms')}" for c in cells) + " |"
        )
    return lines


def plan(
    out: Path, wheels: Sequence[Path], scratch: Path, seconds: float, pack: Path = PACK, stage: str = ALL
) -> tuple[list[Step], dict[str, str]]:
    """The steps of a device run's `stage` and the environment they run in (the wheels' folder
    first, and a carried redis-server on the PATH)."""
    python = sys.executable
    site = scratch / "site"
    environment = dict(os.environ, PYTHONUNBUFFERED="1", REQUIRE_GPU="1")
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    redis = pack / "redis"
    if (redis / "redis-server").is_file():
        environment["PATH"] = os.pathsep.join([str(redis), environment.get("PATH", "")])
        environment["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(redis), environment.get("LD_LIBRARY_PATH")])
        )
    work = scratch / "work"
    measure = [python, "-m", "bench.gpu"]
    timed = ["--work", str(work), "--seconds", str(seconds)]
    steps = [Step("a GPU is visible (nvidia-smi)", [python, "-c", NVIDIA_SMI], 20)]
    if wheels:
        install = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        install += ["--disable-pip-version-check", "--upgrade", "--target", str(site)]
        steps.append(Step(f"install the wheels ({len(wheels)})", [*install, *map(str, wheels)], 120))
    me = [python, str(Path(__file__).resolve())]
    steps += [
        Step("what the machine has", [*me, "check"], 60),
        Step("environment", [*measure, "environment", *timed], 45, needs="fngate"),
    ]
    cold = [
        [*timed, "--engines", str(scratch / f"engines-{index}"), "--store", str(scratch / "store")]
        for index in range(2)
    ]
    serving = [  # name, bench.gpu's arguments (None: pytest), limit s, what it needs besides fngate
        ("GPU Python function through the runner", ["python-function", *timed], 75, "fngate"),
        ("gpu-mlp and torch-mlp under fngate up", ["serving", *timed], 150, "redis-server"),
        ("pytest -m gpu (Python functions)", None, 90, "fngate"),
        ("GPU Python function through fngate up", ["up", *timed], 60, "redis-server"),
    ]
    onnx = [
        ("CUDA provider against a bare session.run", ["providers", *timed], 90, "onnxruntime-gpu"),
        ("accelerator tensorrt without TensorRT", ["tensorrt-fallback", *timed], 30, "onnxruntime-gpu"),
        ("pytest -m gpu (ONNX and TensorRT)", None, 150, "onnxruntime-gpu"),
        ("timing tensorrt-fp16", ["config", "tensorrt-fp16", *timed], 60, "tensorrt"),
        ("timing tensorrt-native-fp16", ["config", "tensorrt-native-fp16", *timed], 60, "tensorrt"),
        ("cold start without a stored engine", ["cold", *cold[0]], 120, "tensorrt"),
        ("cold start with the stored engine", ["cold", *cold[1]], 60, "tensorrt"),
    ]
    measured = {SERVING: serving, ONNX: onnx, ALL: serving + onnx}[stage]
    steps += [
        Step(name, pytest_of(name) if arguments is None else [*measure, *arguments], limit_s, needs)
        for name, arguments, limit_s, needs in measured
    ]
    return steps, environment


def pytest_of(name: str) -> list[str]:
    """`pytest -m gpu` of the stage its step's name says."""
    tests = GPU_TESTS[SERVING if "Python functions" in name else ONNX]
    command = [sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-m", "gpu"]
    return [*command, "-v", "-rA", "--durations=10", "-o", "timeout=90", *tests]


NVIDIA_SMI = """
import json, shutil, subprocess, sys
if not shutil.which("nvidia-smi"):
    sys.exit("missing: nvidia-smi (NVIDIA's driver): no GPU to check")
query = "name,driver_version,memory.total,compute_cap,uuid,mig.mode.current"
done = subprocess.run(["nvidia-smi", "--query-gpu=" + query, "--format=csv,noheader"],
                      capture_output=True, text=True, timeout=15)
rows = [line.split(", ") for line in done.stdout.splitlines() if line.strip()]
if done.returncode or not rows:
    sys.exit("nvidia-smi sees no GPU: " + (done.stderr or done.stdout).strip())
listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15).stdout
print(listed, flush=True)
print(json.dumps([dict(zip(query.split(","), row)) for row in rows]))
"""


def empty_scratch(scratch: Path) -> None:
    """Start every run from nothing: what an earlier run built or installed is removed. Only a
    folder this script made (it holds its marker) or an empty one is emptied."""
    marker = scratch / ".fngate-gpu-check"
    if scratch.is_dir() and any(scratch.iterdir()) and not marker.is_file():
        raise SystemExit(f"gpu_check: {scratch} is not a scratch folder of this script; name another one")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    marker.touch()


def run_all(
    out: Path,
    wheels: Sequence[Path],
    budget_s: float,
    scratch: Path,
    seconds: float = 1.0,
    pack: Path = PACK,
    stage: str = ALL,
    earlier: Sequence[Outcome] = (),
) -> int:
    """The steps of `stage`, after `earlier` outcomes (an earlier call's, kept in the summary).
    Exit status: 0 when every step passed, 2 when no GPU is visible, else 1."""
    empty_scratch(scratch)
    (out / "log.txt").unlink(missing_ok=True)
    steps, environment = plan(out, wheels, scratch, seconds, pack, stage)
    deadline = time.monotonic() + budget_s
    outcomes = run_steps(steps[:1], out, budget_s, environment, earlier=earlier)
    if outcomes[-1].status != "PASS":
        print("gpu_check: no NVIDIA GPU is visible; nothing else is worth running", file=sys.stderr)
        return 2
    setup = [step for step in steps[1:] if not step.needs]
    outcomes = run_steps(setup, out, deadline - time.monotonic(), environment, earlier=outcomes)
    found = next((o.result for o in reversed(outcomes) if o.name == "what the machine has"), None)
    missing = ["fngate"] if not isinstance(found, dict) or found.get("fngate_missing") else []
    if isinstance(found, dict):
        missing += list(found.get("gpu_missing", ()))
    if not shutil.which("redis-server", path=environment.get("PATH")):
        missing.append("redis-server")
    rest = [step for step in steps[1:] if step.needs]
    outcomes = run_steps(
        rest, out, deadline - time.monotonic(), environment, missing=missing, earlier=outcomes
    )
    print((out / "summary.md").read_text())
    return 0 if all(o.status == "PASS" for o in outcomes[len(earlier) :]) else 1


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


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wanted_requirements() -> list[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *TOOLS]


def closure(names: Sequence[str]) -> set[str]:
    """The installed distributions these names need, directly or through one another (normalized)."""
    seen: set[str] = set()
    todo = [normalized(name) for name in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [normalized(requirement_name(item)) for item in requires if "extra ==" not in item]
    return seen


def pip_problems(said: str, concerned: set[str]) -> tuple[list[str], list[str]]:
    """pip check's problems ("x 1.0 requires y, which is not installed." / "x 1.0 has requirement
    y>=2, but you have y 1.5."): those about a distribution in `concerned` (as the one that
    requires or the one required), and the others: the machine's, not fngate's."""
    mine, others = [], []
    for line in said.splitlines():
        words = line.split()
        if len(words) >= 5 and words[2] in ("requires", "has"):
            required = requirement_name(words[4 if words[2] == "has" else 3].rstrip(","))
            about_fngate = normalized(words[0]) in concerned or normalized(required) in concerned
            (mine if about_fngate else others).append(line.strip())
    return mine, others


def check() -> int:
    """One line per piece: `ok:` or `missing:`, then a JSON line the summary keeps. Exit 1 when
    fngate itself cannot run (its dependencies or the test tools are missing, or pip check finds
    their requirements unmet, or a GPU module does not import)."""
    fngate_missing = []
    requirements = wanted_requirements()
    for requirement in requirements:
        name = requirement_name(requirement)
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
    broken = [] if fngate_missing else import_problems()
    done = subprocess.run(
        [sys.executable, "-m", "pip", "check", "--disable-pip-version-check"],
        capture_output=True, text=True, timeout=45, check=False,
    )  # fmt: skip
    unmet, others = pip_problems(done.stdout, closure([requirement_name(item) for item in requirements]))
    for line in unmet:
        print(f"missing: pip check: {line}")
    print(f"ok: pip check: {len(unmet)} problems for fngate, {len(others)} for other packages")
    said = {
        "fngate_missing": fngate_missing,
        "gpu_missing": gpu_missing,
        "pip_check": unmet,
        "imports": broken,
    }
    print(json.dumps(said))
    return 1 if fngate_missing or unmet or broken else 0


IMPORTS = """
import importlib, json, sys
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
        print(json.dumps([module, None]))
    except Exception as exc:
        print(json.dumps([module, f"{type(exc).__name__}: {exc}"]))
"""


def import_problems() -> list[str]:
    """Import fngate's GPU modules in a fresh interpreter (as the steps do), one line each."""
    command = [sys.executable, "-c", IMPORTS, *GPU_MODULES]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    said = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    problems = []
    for module in GPU_MODULES:
        problem = said.get(module, f"the import stopped its interpreter: {done.stderr.strip()[-300:]}")
        if problem is None:
            print(f"ok: import {module}")
        else:
            print(f"missing: import {module}: {problem}")
            problems.append(f"{module}: {problem}")
    return problems


# ---------------------------------------------------------------- wheels, parts and the device's calls


def download_wheels(
    dest: Path, python_version: str, have: set[str], gpu: bool, pip_arguments: list[str]
) -> int:
    """Download, for a GPU machine without network, the wheels of fngate's dependencies and the
    test tools (and its gpu extra with `gpu`) for Linux x86-64 and this Python version, then drop
    those of the distributions `have` names (what that machine already has)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*wanted_requirements(), *(project["optional-dependencies"]["gpu"] if gpu else [])]
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


def tree_bytes() -> int:
    """What every call carries besides its payload: the working tree as git lists it."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    paths = [ROOT / name for name in listed.decode().split("\0") if name]
    return sum(path.stat().st_size for path in paths if path.is_file())


def pack(onnxruntime_wheel: Path | None, with_redis: bool, have: str, part_bytes: int = CALL_BYTES) -> int:
    """Make .gpu/ for the device (wheels, redis-server, onnxruntime-gpu in parts) and write
    .gpu/calls.json: what each call carries, the same command each time."""
    shutil.rmtree(PACK, ignore_errors=True)
    (PACK / "wheels").mkdir(parents=True)
    if download_wheels(PACK / "wheels", "3.12", set(have.split()), False, []):
        return 1
    wheels_bytes = sum(path.stat().st_size for path in (PACK / "wheels").iterdir())
    redis_bytes = copy_redis(PACK / "redis") if with_redis else 0
    if onnxruntime_wheel is None:
        download = PACK / "download"
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(download)]
        command += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        command += [argument for platform in PLATFORMS for argument in ("--platform", platform)]
        if subprocess.run([*command, ONNXRUNTIME_GPU], check=False).returncode != 0:
            return 1
        (onnxruntime_wheel,) = download.glob("*.whl")
    tree = tree_bytes()
    if tree + wheels_bytes + redis_bytes > part_bytes:
        print("gpu_check: the wheels and redis-server do not fit in the first call", file=sys.stderr)
        return 1
    record = split(onnxruntime_wheel, PACK, part_bytes - tree, part_bytes - tree)
    record["wheels"] = len(list((PACK / "wheels").glob("*.whl")))
    shutil.rmtree(PACK / "download", ignore_errors=True)
    (PACK / "parts.json").write_text(json.dumps(record, indent=1))
    carried = calls(record, True, with_redis)
    (PACK / "calls.json").write_text(json.dumps(carried, indent=1))
    sizes = {"working tree": tree, "wheels": wheels_bytes, "redis-server": redis_bytes}
    print(", ".join(f"{what} {size / 2**20:.1f} MiB" for what, size in sizes.items()))
    print(f"{record['wheel']}: {record['bytes'] / 2**20:.1f} MiB in {len(record['parts'])} parts")
    for index, carry in enumerate(carried, 1):
        print(f"call {index}: carry {json.dumps(carry)}")
    print('each call: python3 scripts/gpu_check.py device --out "$OUT"')
    return 0


def copy_redis(folder: Path) -> int:
    """Debian's redis-server and the libraries it links that a Python image lacks (liblzf, jemalloc)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("gpu_check: --redis needs redis-server here (apt-get install redis-server)")
    folder.mkdir(parents=True)
    shutil.copy2(Path(binary).resolve(), folder / "redis-server")
    linked = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=30, check=True).stdout
    for line in linked.splitlines():
        if "=>" in line and any(name in line for name in ("liblzf", "libjemalloc")):
            library = Path(line.split("=>", 1)[1].split("(", 1)[0].strip())
            shutil.copy2(library.resolve(), folder / library.name)
    return sum(path.stat().st_size for path in folder.iterdir())


def device(out: Path, budget_s: float | None, scratch: Path, seconds: float, pack: Path = PACK) -> int:
    """One call on the GPU machine. The first (fngate's wheels and redis-server, no part of
    onnxruntime-gpu yet) runs the serving stage at once and keeps its outcomes beside the parts;
    the next ones note which parts have come (received.txt in `out`); the one that brings the last
    puts onnxruntime-gpu together and runs the ONNX stage, its summary after the first call's.
    Exit 3 when what an earlier call carried is gone (the machine was handed back between calls):
    start again from call 1."""
    record = json.loads((pack / "parts.json").read_text()) if (pack / "parts.json").is_file() else None
    wheels = sorted((pack / "wheels").glob("*.whl"))
    if record is None:  # nothing in parts: one call does everything
        return run_all(out, wheels, budget_s or BUDGET_S[ALL], scratch, seconds, pack)
    here, missing = received(pack, record)
    said = f"have {here or 'no part'}; to come {missing or 'nothing'}"
    print(f"gpu_check: {record['wheel']}: {said}", flush=True)
    if lost(record, here, len(wheels)):
        print("gpu_check: what an earlier call carried is gone: start again from call 1", file=sys.stderr)
        return 3
    kept = pack / "serving-results.json"
    if not here:  # call 1
        kept.unlink(missing_ok=True)
        code = run_all(out, wheels, budget_s or BUDGET_S[SERVING], scratch, seconds, pack, SERVING)
        if (out / "results.json").is_file():
            shutil.copyfile(out / "results.json", kept)
        (out / "received.txt").write_text(said + "\n")
        return code
    if missing:
        (out / "received.txt").write_text(said + "\n")
        return 0
    earlier = [  # named apart from this call's own steps of the same names
        Outcome(**(item | {"name": f"call 1: {item['name']}"})) for item in json.loads(kept.read_text())
    ] if kept.is_file() else []  # fmt: skip
    if not earlier:
        print("gpu_check: call 1's results are not here: its summary is not repeated", flush=True)
    empty_scratch(scratch)
    try:
        wheels.append(reassemble(pack, record, scratch))
    except ValueError as exc:
        print(f"gpu_check: {exc}: start again from call 1", file=sys.stderr)
        return 3
    return run_all(out, wheels, budget_s or BUDGET_S[ONNX], scratch / "run", seconds, pack, ONNX, earlier)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    default_scratch = Path(os.environ.get("TMPDIR", "/tmp")) / "fngate-gpu-check"
    for name in ("all", "device"):
        command = commands.add_parser(name)
        command.add_argument("--out", type=Path, required=True)
        command.add_argument(
            "--budget-s",
            type=float,
            default=float(os.environ["GPU_CHECK_BUDGET_S"]) if os.environ.get("GPU_CHECK_BUDGET_S") else None,
            help="seconds for the steps of this call (default: the stage's, BUDGET_S)",
        )
        command.add_argument("--scratch", type=Path, default=default_scratch)
        command.add_argument("--seconds", type=float, default=1.0, help="each measurement's window")
        if name == "all":
            command.add_argument("--wheels", type=Path)
        else:
            command.add_argument("--pack", type=Path, default=PACK, help="what the calls carried (.gpu)")
    commands.add_parser("check")
    packing = commands.add_parser("pack")
    packing.add_argument("--onnxruntime-wheel", type=Path, help="this file rather than one downloaded")
    packing.add_argument("--redis", action="store_true", help="also redis-server, for the fngate up step")
    packing.add_argument("--have", default=DEVICE_HAS, help="distributions the GPU machine has")
    download = commands.add_parser("wheels")
    download.add_argument("dest", type=Path)
    download.add_argument("--python-version", default="3.12")
    download.add_argument("--have", default=DEVICE_HAS, help="distributions the GPU machine has")
    download.add_argument(
        "--gpu", action="store_true", help="also the gpu extra (hundreds of MiB: CUDA and cuDNN)"
    )
    download.add_argument("pip_arguments", nargs="*", help="after --: more pip arguments")
    arguments = parser.parse_args()
    if arguments.command in ("all", "device"):
        arguments.out.mkdir(parents=True, exist_ok=True)
    if arguments.command == "all":
        folder = arguments.wheels
        wheels = sorted(folder.glob("*.whl")) if folder is not None else []
        budget_s = arguments.budget_s or BUDGET_S[ALL]
        return run_all(arguments.out, wheels, budget_s, arguments.scratch, arguments.seconds)
    if arguments.command == "device":
        return device(arguments.out, arguments.budget_s, arguments.scratch, arguments.seconds, arguments.pack)
    if arguments.command == "check":
        return check()
    if arguments.command == "pack":
        return pack(arguments.onnxruntime_wheel, arguments.redis, arguments.have)
    arguments.dest.mkdir(parents=True, exist_ok=True)
    have = set(arguments.have.replace(",", " ").split())
    return download_wheels(
        arguments.dest, arguments.python_version, have, arguments.gpu, arguments.pip_arguments
    )


if __name__ == "__main__":
    sys.exit(main())
