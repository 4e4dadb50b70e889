"""runner.worker.usable_cpus: onnxruntime's threads follow a container's CPU limit (a cgroup v2
quota), not the node's CPUs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runner.worker import usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        (None, AFFINITY),  # no cgroup v2 file: outside a container
        ("max 100000\n", AFFINITY),  # no limit
        ("100000 100000\n", 1),
        ("150000 100000\n", min(2, AFFINITY)),  # 1.5 CPUs: two threads, each less than busy
        ("5000 100000\n", 1),  # 50m: still one thread
        (f"{(AFFINITY + 8) * 100000} 100000\n", AFFINITY),  # a limit above the CPUs it may run on
        ("garbage\n", AFFINITY),
    ],
)
def test_usable_cpus_follow_the_cgroup_quota(tmp_path: Path, cpu_max: str | None, expected: int) -> None:
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max, encoding="ascii")
    assert usable_cpus(tmp_path) == expected
