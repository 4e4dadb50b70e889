"""The device script's budget: every step inside its limit and the whole inside the budget, a step
that overruns stopped (its children too) with what it printed kept, results written after each
step; and its check of what a machine has, one line per missing piece."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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
