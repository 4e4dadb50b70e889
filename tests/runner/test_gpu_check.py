"""The device script: its budget (every step inside its limit and the whole inside the budget, a
step that overruns stopped with its children, what it printed kept, results written after each
step), its check of what a machine has, onnxruntime-gpu in parts put together again, and a dry run
of the whole device run on this machine with a stand-in nvidia-smi."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_an_overrunning_step_is_stopped_and_every_result_so_far_is_kept(tmp_path: Path) -> None:
    check = gpu_check()
    grandchild = tmp_path / "grandchild.pid"
    steps = [
        check.Step("quick", python('print("working"); print(\'{"rows_per_s": 123.0}\')'), 30),
        check.Step(
            "overruns",
            python(
                "import subprocess, sys, time\n"
                "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                f"open({str(grandchild)!r}, 'w').write(str(child.pid))\n"
                "print('{\"partial\": true}', flush=True)\n"
                "time.sleep(60)\n"
            ),
            2,
        ),
        check.Step("fails", python("import sys; sys.exit(3)"), 30),
        check.Step("needs a missing piece", python("print('never')"), 30, needs="fngate"),
    ]
    outcomes = check.run_steps(steps, tmp_path / "out", budget_s=30, reserve_s=1, missing=["fngate"])
    statuses = [outcome.status for outcome in outcomes]
    assert statuses == ["PASS", "TIMEOUT (after 2 s)", "FAIL (exit 3)", "SKIPPED (needs fngate)"]
    assert outcomes[0].result == {"rows_per_s": 123.0}
    assert outcomes[1].result == {"partial": True}
    assert outcomes[1].took_s < 10
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [item["status"] for item in written] == statuses
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "working" in log and '{"partial": true}' in log and "\nnever\n" not in log
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| overruns | TIMEOUT (after 2 s) |" in summary
    pid = int(grandchild.read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_the_budget_limits_the_steps_and_skips_what_no_longer_fits(tmp_path: Path) -> None:
    check = gpu_check()
    steps = [
        check.Step("takes the budget", python("import time; time.sleep(60)"), 300),
        check.Step("left out", python("print('never')"), 30),
    ]
    outcomes = check.run_steps(steps, tmp_path, budget_s=4, reserve_s=0.5, min_step_s=1)
    assert outcomes[0].status.startswith("TIMEOUT")
    assert outcomes[0].took_s < 8
    assert outcomes[1].status.startswith("SKIPPED (no time left")
    assert json.loads((tmp_path / "results.json").read_text())[1]["status"] == outcomes[1].status


def test_the_check_says_what_the_machine_has_one_line_per_piece() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = done.stdout.splitlines()
    found = json.loads(lines[-1])
    assert done.returncode == 0 and found["fngate_missing"] == []  # the dev install has them all
    assert any(line.startswith("ok: pydantic ") for line in lines)
    assert any(line.startswith("ok: pytest-asyncio ") for line in lines)
    for module in found["gpu_missing"]:
        assert any(line.startswith("missing: ") and "for " in line for line in lines), module
    pieces = [line for line in lines[:-1] if line.startswith(("ok: ", "missing: "))]
    assert len(pieces) == len(lines) - 1
    assert "ok: import runner.backends.python" in lines and "ok: import bench.gpu" in lines
    assert any(line.startswith("ok: pip check: 0 problems for fngate") for line in lines)
    assert found["imports"] == [] and found["pip_check"] == []


def test_a_steps_output_is_read_from_its_own_first_byte(tmp_path: Path) -> None:
    """The log holds what earlier steps wrote, multi-byte characters among it: each step's own
    output, and so its JSON result, starts at the byte where it began."""
    check = gpu_check()
    steps = [
        check.Step("wide characters", python('print("µs → " * 2000)'), 30),
        check.Step("result", python('print(\'{"rows_per_s": 1.5, "unit": "µs"}\')'), 30),
    ]
    outcomes = check.run_steps(steps, tmp_path, budget_s=30, reserve_s=0)
    assert outcomes[1].result == {"rows_per_s": 1.5, "unit": "µs"}


def test_pip_checks_problems_are_fngates_only_where_they_touch_what_it_needs() -> None:
    check = gpu_check()
    said = (
        "opentelemetry-proto 1.45.2 has requirement protobuf<7.0,>=5.0, but you have protobuf 7.36.2.\n"
        "pydantic 2.14.4 requires pydantic-core, which is not installed.\n"
        "torch 2.11.0 requires nvidia-nccl-cu13, which is not installed.\n"
        "No broken requirements found.\n"
    )
    mine, others = check.pip_problems(said, {"opentelemetry-proto", "pydantic", "pydantic-core"})
    assert [line.split()[0] for line in mine] == ["opentelemetry-proto", "pydantic"]
    assert [line.split()[0] for line in others] == ["torch"]


def test_a_wheel_in_parts_is_put_together_and_checked(tmp_path: Path) -> None:
    check = gpu_check()
    wheel = tmp_path / "big-1.0-py3-none-any.whl"
    wheel.write_bytes(os.urandom(10_000))
    parts = tmp_path / "parts"
    parts.mkdir()
    record = check.split(wheel, parts, 1000, 4000)
    assert [part["bytes"] for part in record["parts"]] == [1000, 4000, 4000, 1000]
    assert check.calls(record, True, True) == [
        [".gpu/parts.json", ".gpu/wheels", ".gpu/redis"],  # the serving path runs at once
        [".gpu/parts.json", ".gpu/part-1"],
        [".gpu/parts.json", ".gpu/part-2"],
        [".gpu/parts.json", ".gpu/part-3"],
        [".gpu/parts.json", ".gpu/part-4"],
    ]
    # Call 3 of 5 on a machine that kept calls 1 and 2's: nothing lost; on a fresh machine: lost.
    record["wheels"] = 12
    assert not check.lost(record, [], 12)
    assert not check.lost(record, ["part-1", "part-2"], 12)
    assert check.lost(record, ["part-2"], 12)
    assert check.lost(record, ["part-1", "part-2"], 0)  # the wheels came with call 1
    target = tmp_path / "target"
    target.mkdir()
    assert check.reassemble(parts, record, target).read_bytes() == wheel.read_bytes()
    (parts / "part-3").write_bytes(os.urandom(4000))  # damaged in transit: the same size
    assert check.received(parts, record) == (["part-1", "part-2", "part-4"], ["part-3"])
    with pytest.raises(ValueError, match="put together is"):
        check.reassemble(parts, record, target)


NVIDIA_SMI = """#!/bin/sh
if [ "$1" = "-L" ]; then
  echo "GPU 0: NVIDIA H200 (UUID: GPU-0a1b2c3d-0000-0000-0000-000000000000)"
else
  echo "NVIDIA H200, 580.95.05, 143771 MiB, 9.0, GPU-0a1b2c3d-0000-0000-0000-000000000000, Disabled"
fi
"""


def stand_in_wheel(folder: Path) -> Path:
    """A small real wheel (a module and its metadata) to travel in parts as onnxruntime-gpu does."""
    wheel = folder / "fngate_standin-1.0-py3-none-any.whl"
    info = "fngate_standin-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fngate_standin/__init__.py", "ARRIVED = True\n" + "# padding\n" * 400)
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fngate-standin\nVersion: 1.0\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def test_a_dry_run_of_the_device_run(tmp_path: Path) -> None:
    """The calls of a device run on this machine, with a stand-in nvidia-smi and a stand-in wheel
    in three parts. Call 1 (no part) runs the serving stage at once: the GPU Python function
    through the runner and under `fngate up`; the next calls keep what came, one on a machine that
    lost them says so, and the one that brings the last puts the wheel together, installs it and
    runs the ONNX stage, its summary after call 1's. Without a GPU the steps that need one fail,
    each with its figures; those that need what is not here are skipped."""
    check = gpu_check()
    pack, bin_folder, scratch = tmp_path / "pack", tmp_path / "bin", tmp_path / "scratch"
    for folder in (pack / "wheels", pack / "redis", bin_folder, scratch):
        folder.mkdir(parents=True)
    (bin_folder / "nvidia-smi").write_text(NVIDIA_SMI)
    (bin_folder / "nvidia-smi").chmod(0o755)
    server = shutil.which("redis-server")
    assert server is not None
    (pack / "redis" / "redis-server").symlink_to(server)  # as `pack --redis` carries it
    wheel = stand_in_wheel(tmp_path)
    record = check.split(wheel, pack, 2000, 2000)
    (pack / "parts.json").write_text(json.dumps(record))
    parts = {part["name"]: (pack / part["name"]).read_bytes() for part in record["parts"]}
    assert len(parts) >= 3
    (scratch / ".fngate-gpu-check").touch()
    (scratch / "left-by-an-earlier-run").write_text("stale")
    env = {key: value for key, value in os.environ.items() if not key.startswith(("FNGATE_", "REQUIRE_GPU"))}
    env["PATH"] = os.pathsep.join([str(bin_folder), str(Path(sys.executable).parent), "/usr/bin", "/bin"])

    def call(number: int, *here: str) -> subprocess.CompletedProcess[str]:
        for name, data in parts.items():
            (pack / name).unlink(missing_ok=True)
            if name in here:
                (pack / name).write_bytes(data)
        out = tmp_path / f"out-{number}"
        command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "device", "--out", str(out)]
        command += ["--pack", str(pack), "--scratch", str(scratch), "--seconds", "0.05", "--budget-s", "300"]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=340, check=False)

    def statuses(out: Path) -> dict[str, dict[str, Any]]:
        return {item["name"]: item for item in json.loads((out / "results.json").read_text())}

    names = list(parts)
    first = call(1)
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]  # no GPU: its steps fail
    assert "to come" in (tmp_path / "out-1" / "received.txt").read_text()
    assert not (scratch / "left-by-an-earlier-run").exists()
    served = statuses(tmp_path / "out-1")
    assert served["a GPU is visible (nvidia-smi)"]["result"][0]["name"] == "NVIDIA H200"
    assert served["environment"]["status"] == "PASS"
    # The GPU function ran through the runner on the CPU, said why, and its process ended on the
    # idle unload.
    function = served["GPU Python function through the runner"]
    assert function["status"] == "FAIL (exit 1)"
    assert function["result"]["device"] == "python" and function["result"]["fallback_reason"]
    assert function["result"]["process_ended_after_s"] is not None
    assert function["result"]["max_abs_diff_runner_vs_direct"] == 0.0
    assert set(function["result"]["batches"]) == {"1", "4", "16", "64", "256", "1024"}
    # Under fngate up: gpu-mlp from no runner to its answer, the phases it waited for, every batch
    # size; torch-mlp says why it did not load (no torch here); no GPU memory to budget.
    up = served["gpu-mlp and torch-mlp under fngate up"]
    assert up["status"] == "FAIL (exit 1)"
    mlp = up["result"]["functions"]["gpu-mlp"]
    assert mlp["cold"]["status"] == 200 and {"start", "load", "exec"} <= set(mlp["cold"]["phases_ms"])
    assert all("rows_per_s" in row for row in mlp["batches"].values()) and len(mlp["batches"]) == 6
    assert "torch" in up["result"]["functions"]["torch-mlp"]["cold"]["error"]
    assert up["result"]["together"]["gpu-mlp"]["failed"] == 0
    assert "skipped" in up["result"]["eviction"]
    assert served["pytest -m gpu (Python functions)"]["status"].startswith("FAIL")  # REQUIRE_GPU=1
    assert served["GPU Python function through fngate up"]["status"].startswith("FAIL")
    assert not any(name.startswith("CUDA provider") for name in served)  # the ONNX stage's

    lost = call(2, names[1])  # a fresh machine: part 1 is gone
    assert lost.returncode == 3 and "start again from call 1" in lost.stderr
    waiting = call(3, *names[:-1])
    assert waiting.returncode == 0 and "to come" in (tmp_path / "out-3" / "received.txt").read_text()
    done = call(4, *names)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out-4"
    assert sorted(path.name for path in out.iterdir()) == ["log.txt", "results.json", "summary.md"]
    outcomes = statuses(out)
    assert outcomes["install the wheels (1)"]["status"] == "PASS"
    assert (scratch / "run" / "site" / "fngate_standin" / "__init__.py").is_file()
    assert outcomes["what the machine has"]["status"] == "PASS"
    assert outcomes["call 1: gpu-mlp and torch-mlp under fngate up"] == up | {  # kept
        "name": "call 1: gpu-mlp and torch-mlp under fngate up"
    }
    assert outcomes["CUDA provider against a bare session.run"]["status"] == "SKIPPED (needs onnxruntime-gpu)"
    assert outcomes["pytest -m gpu (ONNX and TensorRT)"]["status"] == "SKIPPED (needs onnxruntime-gpu)"
    assert outcomes["timing tensorrt-fp16"]["status"] == "SKIPPED (needs tensorrt)"
    summary = (out / "summary.md").read_text()
    assert summary.index("| call 1: gpu-mlp and torch-mlp under fngate up |") < summary.index(
        "| CUDA provider"
    )
    assert "| 1024 | " in summary and "## call 1: GPU Python function through the runner" in summary
    assert (
        "## call 1: gpu-mlp and torch-mlp under fngate up\n\ngpu-mlp:\n\n| batch | rows/s | p50 ms |"
        in summary
    )
