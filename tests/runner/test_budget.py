"""The memory budget's decisions (runner.budget): which idle models to unload, least recently used
first, for a load to fit, in host memory and in GPU memory alike (NVML's numbers stood in); what
can never fit; a version's estimate before its first load; the default budget from a memory
cgroup's limit, the machine's memory and NVML's total."""

from __future__ import annotations

from pathlib import Path

import pytest

from fngate.manifest import parse_manifest
from fngate.repository import ArtifactFile, FunctionVersion
from runner import gpu
from runner.budget import (
    MIB,
    PROCESS_BYTES,
    Cost,
    Held,
    MemoryLimits,
    estimate,
    host_limit_bytes,
    make_room,
    runner_limits,
    too_large,
)


def held(name: str, host_mib: int, last_used: float, idle: bool = True, gpu_mib: int = 0) -> Held:
    return Held((name, "1"), Cost(host_mib * MIB, gpu_mib * MIB, True), last_used, idle)


HOST = MemoryLimits(1000 * MIB)
GPU = MemoryLimits(None, 1000 * MIB)
"""A GPU's budget alone: 1000 MiB of device memory as NVML would report it."""


@pytest.mark.parametrize(
    ("need", "limits", "models", "expected", "case"),
    [
        (Cost(400 * MIB), HOST, [held("a", 400, 1)], [], "fits beside what is loaded"),
        (
            Cost(400 * MIB),
            HOST,
            [held("a", 400, 2), held("b", 400, 1)],
            [("b", "1")],
            "the least recently used goes first",
        ),
        (
            Cost(950 * MIB),
            HOST,
            [held("a", 400, 2), held("b", 400, 1), held("c", 100, 3)],
            [("b", "1"), ("a", "1"), ("c", "1")],
            "as many as it takes",
        ),
        (
            Cost(400 * MIB),
            HOST,
            [held("a", 400, 1, idle=False), held("b", 400, 2, idle=False)],
            None,
            "all in use",
        ),
        (
            Cost(400 * MIB),
            HOST,
            [held("a", 400, 1, idle=False), held("b", 400, 2)],
            [("b", "1")],
            "one in use stays, an idle one goes though more recent",
        ),
        (
            Cost(0, 600 * MIB),
            GPU,
            [held("a", 900, 1), held("b", 0, 2, gpu_mib=500)],
            [("b", "1")],
            "GPU: host-only models stay",
        ),
        (
            Cost(0, 600 * MIB),
            GPU,
            [held("b", 0, 2, gpu_mib=500, idle=False)],
            None,
            "GPU: the one there is in use",
        ),
        (Cost(5000 * MIB), MemoryLimits(None), [held("a", 400, 1)], [], "no budget"),
        (
            Cost(300 * MIB, load_host_bytes=500 * MIB),
            HOST,
            [held("a", 400, 2), held("b", 300, 1)],
            [("b", "1")],
            "room for the load's peak, not only for what it holds after",
        ),
    ],
)
def test_make_room_unloads_idle_models_least_recently_used_first(
    need: Cost, limits: MemoryLimits, models: list[Held], expected: list[tuple[str, str]] | None, case: str
) -> None:
    assert make_room(need, limits, models) == expected, case


def test_a_model_over_the_budget_alone_is_named_with_its_size_and_the_budget() -> None:
    assert too_large(Cost(1000 * MIB), HOST) is None
    assert too_large(Cost(600 * MIB, load_host_bytes=1100 * MIB), HOST) is not None  # its load's peak
    found = too_large(Cost(1200 * MIB, 0, True), HOST)
    assert found == (
        "needs 1200 MiB of host memory (measured at its last load), more than a runner's memory "
        "budget of 1000 MiB"
    )
    assert "GPU 0 memory" in (too_large(Cost(0, 2000 * MIB), GPU) or "")


def version(model: dict[str, object], size: int) -> FunctionVersion:
    manifest = parse_manifest(
        {
            "name": "f",
            "model": model,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
        },
        "f.yaml",
    )
    path = str(model["path"])
    return FunctionVersion(manifest, "1", Path(), "", (ArtifactFile(path, "0" * 64, size),))


def test_the_estimate_before_a_first_load_is_the_files_times_the_backends_factor_per_instance() -> None:
    onnx = {"backend": "onnxruntime", "path": "m.onnx"}
    # Held once loaded, and at the load's peak with the file's bytes beside it.
    assert estimate(version(onnx, 100 * MIB)) == Cost(150 * MIB, load_host_bytes=250 * MIB)
    assert estimate(version({**onnx, "instances": 2}, 100 * MIB)) == Cost(
        300 * MIB, load_host_bytes=400 * MIB
    )
    cuda = estimate(version({**onnx, "accelerator": "cuda"}, 100 * MIB))
    assert cuda == Cost(100 * MIB, 150 * MIB, load_host_bytes=200 * MIB)
    python = {"backend": "python", "path": "model.py"}
    assert estimate(version(python, 1000)) == Cost(PROCESS_BYTES + 2000)
    assert estimate(version({**python, "memory_limit_mb": 300}, 1000)) == Cost(300 * MIB)


def test_the_default_budget_is_a_share_of_the_cgroup_limit_or_the_machine_and_of_the_gpu(
    tmp_path: Path,
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree: 1 kB\n", encoding="ascii")
    own = tmp_path / "cgroup"
    own.write_text("0::/pod/runner\n", encoding="ascii")
    root = tmp_path / "fs"
    (root / "pod" / "runner").mkdir(parents=True)
    assert host_limit_bytes(root, own, meminfo) == 16384000 * 1024  # no limit file: the machine
    (root / "pod" / "runner" / "memory.max").write_text("max\n", encoding="ascii")
    assert host_limit_bytes(root, own, meminfo) == 16384000 * 1024
    (root / "pod" / "runner" / "memory.max").write_text(f"{4 * 1024 * MIB}\n", encoding="ascii")
    assert host_limit_bytes(root, own, meminfo) == 4 * 1024 * MIB

    device = gpu.Device(0, "H100", "GPU-a", "9.0", 80 * 1024 * MIB, 1024 * MIB)
    limits = runner_limits(True, 2000 * MIB, 0, 0.5, 300 * MIB, device)
    assert limits == MemoryLimits(2000 * MIB, 40 * 1024 * MIB, 0)
    assert runner_limits(True, 0, 10 * MIB, 0.5, 0, gpu.NoDevice("no NVML")).gpu_bytes is None
    assert runner_limits(False, 2000 * MIB, 0, 0.5, 0, device) == MemoryLimits(None, None, 0)
