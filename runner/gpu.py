"""The GPU as NVML sees it (nvidia-ml-py, imported lazily: its one home), and the memory policy of a
runner's GPU: which idle models to unload, least recently used first, so that a new one fits its
budget, or why it cannot. NVML calls block briefly; none raises on a machine without a GPU."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Hashable, Sequence
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_BUDGET_SHARE = 0.9
"""Without a configured budget, models may hold this share of the device's memory (the rest is
left to CUDA contexts, workspaces and other processes)."""
MIB = 1024 * 1024

_lock = threading.Lock()
_nvml: Any = None
_nvml_problem = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Device:
    index: int
    name: str
    uuid: str
    compute_capability: str
    """"9.0" for an H100/H200: TensorRT engines are built for one."""
    total_bytes: int
    used_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class NoDevice:
    reason: str


def _library() -> Any:
    """The initialised pynvml module, or None (the reason is kept for `find_device`)."""
    global _nvml, _nvml_problem  # noqa: PLW0603 - NVML is initialised once per process
    with _lock:
        if _nvml is None and not _nvml_problem:
            try:
                import pynvml  # type: ignore[import-not-found,unused-ignore]

                pynvml.nvmlInit()
                _nvml = pynvml
            except ImportError:
                _nvml_problem = "NVML's Python bindings (nvidia-ml-py) are not installed"
            except Exception as exc:  # pynvml.NVMLError and OSError: no driver, no device
                _nvml_problem = f"NVML did not start: {exc}"
        return _nvml


def find_device(index: int = 0) -> Device | NoDevice:
    """The GPU with this index, or why there is none."""
    nvml = _library()
    if nvml is None:
        return NoDevice(_nvml_problem)
    try:
        count = nvml.nvmlDeviceGetCount()
        if index >= count:
            return NoDevice(f"NVML sees {count} GPUs; there is no GPU {index}")
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        return Device(
            index,
            _text(nvml.nvmlDeviceGetName(handle)),
            _text(nvml.nvmlDeviceGetUUID(handle)),
            f"{major}.{minor}",
            int(memory.total),
            int(memory.used),
        )
    except Exception as exc:  # pynvml.NVMLError
        return NoDevice(f"NVML could not read GPU {index}: {exc}")


def process_bytes(index: int = 0, pid: int | None = None) -> int | None:
    """Device memory held by this process (or `pid`) on the GPU; None where NVML cannot tell
    (no GPU, or a container whose process ids NVML does not see)."""
    nvml = _library()
    if nvml is None:
        return None
    wanted = os.getpid() if pid is None else pid
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:  # pynvml.NVMLError
        return None
    for process in processes:
        if process.pid == wanted and process.usedGpuMemory is not None:
            return int(process.usedGpuMemory)
    return None


def held_bytes(index: int = 0) -> int | None:
    """What a load or unload moves: this process's memory on the device where NVML reports it,
    else the whole device's used memory (a delta of it then also counts other processes)."""
    own = process_bytes(index)
    if own is not None:
        return own
    device = find_device(index)
    return device.used_bytes if isinstance(device, Device) else None


def budget_bytes(configured: int, device: Device) -> int:
    """The memory a runner's models may hold: the setting, or a share of the device."""
    return configured if configured > 0 else int(device.total_bytes * DEFAULT_BUDGET_SHARE)


def estimate_bytes(model_bytes: int, precision: str, measured: int | None = None) -> int:
    """Device memory a model will likely need before it is loaded: what it took the last time it
    was loaded here, else its weights (halved for fp16) and a workspace of 256 MiB."""
    if measured is not None and measured > 0:
        return measured
    weights = model_bytes // 2 if precision == "fp16" else model_bytes
    return weights + 256 * MIB


@dataclasses.dataclass(frozen=True, slots=True)
class Resident:
    """A loaded model as the memory policy sees it."""

    key: Hashable
    bytes: int
    last_used: float
    busy: bool
    """A batch is running on it: never evicted."""


@dataclasses.dataclass(frozen=True, slots=True)
class Room:
    evict: tuple[Hashable, ...] = ()
    """Unload these (least recently used first), then load."""
    refused: str | None = None
    """Why the model cannot be loaded now; nothing is evicted then."""


def make_room(need_bytes: int, budget: int, residents: Sequence[Resident]) -> Room:
    """Which idle models to unload so that `need_bytes` more fit `budget`, or why it cannot fit.
    Models in use are never evicted; among idle ones the least recently used go first."""
    held = sum(model.bytes for model in residents)
    if held + need_bytes <= budget:
        return Room()
    if need_bytes > budget:
        return Room(refused=f"it needs {_mib(need_bytes)} of GPU memory, more than the budget {_mib(budget)}")
    evict: list[Hashable] = []
    for model in sorted((m for m in residents if not m.busy), key=lambda m: m.last_used):
        evict.append(model.key)
        held -= model.bytes
        if held + need_bytes <= budget:
            return Room(evict=tuple(evict))
    busy = [model for model in residents if model.busy]
    return Room(
        refused=f"it needs {_mib(need_bytes)} of GPU memory; the budget is {_mib(budget)} and "
        f"{len(busy)} models in use hold {_mib(sum(model.bytes for model in busy))}"
    )


def _mib(count: int) -> str:
    return f"{count / MIB:.0f} MiB"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
