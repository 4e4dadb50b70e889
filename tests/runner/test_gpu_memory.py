"""GPU memory: the policy that makes room for a model (idle models first, least recently used
first, never one in use) or refuses it, the estimate before a load, and NVML where there is none."""

from __future__ import annotations

import pytest

from runner import gpu
from runner.gpu import MIB, Resident, Room, make_room

A = Resident("a", 400 * MIB, last_used=10.0, busy=False)
B = Resident("b", 300 * MIB, last_used=5.0, busy=False)
C = Resident("c", 200 * MIB, last_used=1.0, busy=True)


@pytest.mark.parametrize(
    ("need_mib", "residents", "expected"),
    [
        (100, [A, B, C], Room()),  # 900 + 100 fits 1000
        (200, [A, B, C], Room(evict=("b",))),  # b is the least recently used idle model
        (500, [A, B, C], Room(evict=("b", "a"))),
        (700, [A, B, C], Room(evict=("b", "a"))),
        (
            900,
            [A, B, C],
            Room(
                refused="it needs 900 MiB of GPU memory; the budget is 1000 MiB and "
                "1 models in use hold 200 MiB"
            ),
        ),
        (1200, [], Room(refused="it needs 1200 MiB of GPU memory, more than the budget 1000 MiB")),
        (1000, [], Room()),
    ],
)
def test_make_room_evicts_idle_models_least_recently_used_first(
    need_mib: int, residents: list[Resident], expected: Room
) -> None:
    assert make_room(need_mib * MIB, 1000 * MIB, residents) == expected


def test_the_estimate_prefers_what_the_model_took_last_time() -> None:
    assert gpu.estimate_bytes(1000 * MIB, "fp32") == 1256 * MIB
    assert gpu.estimate_bytes(1000 * MIB, "fp16") == 756 * MIB
    assert gpu.estimate_bytes(1000 * MIB, "fp16", measured=300 * MIB) == 300 * MIB


def test_the_budget_is_the_setting_or_most_of_the_device() -> None:
    device = gpu.Device(0, "NVIDIA H200", "GPU-1", "9.0", 1000 * MIB, 0)
    assert gpu.budget_bytes(0, device) == 900 * MIB
    assert gpu.budget_bytes(123, device) == 123


def test_without_a_gpu_nvml_says_why_and_reports_no_memory() -> None:
    device = gpu.find_device(0)
    if isinstance(device, gpu.Device):
        pytest.skip(f"this machine has a GPU ({device.name})")
    assert device.reason
    assert gpu.process_bytes(0) is None
    assert gpu.held_bytes(0) is None
