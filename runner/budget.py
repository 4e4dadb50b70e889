"""A runner's memory budget (docs/memory.md): what models may take of host memory and of its GPU's,
each model's cost (measured when it loads, remembered per function version, estimated from its
files before its first load), and which idle models to unload, least recently used first, to make
room for a load. The decisions are pure; the readings (/proc, cgroup, NVML) are small functions."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import gc
import os
from collections.abc import Sequence
from pathlib import Path

from fngate.repository import FunctionVersion
from runner import gpu

Key = tuple[str, str]
"""(function, version)"""
MIB = 1024 * 1024
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

ESTIMATE_FACTORS: dict[str, float] = {"onnxruntime": 1.5, "tensorrt": 1.2, "pytorch": 1.5, "python": 2.0}
"""A model's memory per byte of its files, before its first load measures it: onnxruntime holds
the initializers and its own copies while it optimizes; a TensorRT engine holds its weights and
activations; a python function holds what its model.py reads."""
PROCESS_BYTES = 48 * MIB
"""A python function's process before its Model: the interpreter and numpy (per instance)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Cost:
    """What one model (all its instances) takes, or is expected to take, of each memory."""

    host_bytes: int
    """Host memory it holds once loaded."""
    gpu_bytes: int = 0
    measured: bool = False
    """Measured at a load of this version; False: estimated from its files."""
    load_host_bytes: int = 0
    """The most host memory its load took at once (the file's bytes beside the model being
    built): what must be free for it to load."""

    @property
    def loading_host_bytes(self) -> int:
        return max(self.load_host_bytes, self.host_bytes)


NOTHING = Cost(0)


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryLimits:
    """What models may take of each memory; None: that memory is not held to a budget."""

    host_bytes: int | None
    gpu_bytes: int | None = None
    gpu_index: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """A loaded model as the planner sees it."""

    key: Key
    cost: Cost
    last_used: float
    idle: bool
    """No batch uses it: it may be unloaded."""


def make_room(need: Cost, limits: MemoryLimits, held: Sequence[Held]) -> list[Key] | None:
    """The idle models to unload, least recently used first, for `need` to fit beside the models
    that stay: [] when it fits as it is, None when unloading every idle model is not enough. A
    model is unloaded only for a memory that is still over its budget and that it holds."""
    host = need.loading_host_bytes + sum(model.cost.host_bytes for model in held)
    device = need.gpu_bytes + sum(model.cost.gpu_bytes for model in held)
    unload: list[Key] = []
    for model in sorted((model for model in held if model.idle), key=lambda model: model.last_used):
        host_over, device_over = _over(host, limits.host_bytes), _over(device, limits.gpu_bytes)
        if not (host_over or device_over):
            break
        if (host_over and model.cost.host_bytes > 0) or (device_over and model.cost.gpu_bytes > 0):
            unload.append(model.key)
            host -= model.cost.host_bytes
            device -= model.cost.gpu_bytes
    if _over(host, limits.host_bytes) or _over(device, limits.gpu_bytes):
        return None
    return unload


def too_large(need: Cost, limits: MemoryLimits) -> str | None:
    """Why a model can never fit this runner's budget (it alone is over it), or None."""
    for memory, wanted, limit in (
        ("host memory", need.loading_host_bytes, limits.host_bytes),
        (f"GPU {limits.gpu_index} memory", need.gpu_bytes, limits.gpu_bytes),
    ):
        if _over(wanted, limit):
            how = "measured at its last load" if need.measured else "estimated before its first load"
            return (
                f"needs {wanted / MIB:.0f} MiB of {memory} ({how}), more than a runner's memory "
                f"budget of {(limit or 0) / MIB:.0f} MiB"
            )
    return None


def _over(used: int, limit: int | None) -> bool:
    return limit is not None and used > limit


def on_gpu(function: FunctionVersion) -> bool:
    model = function.manifest.model
    return model.accelerator != "cpu" or model.backend == "tensorrt"


def estimate(function: FunctionVersion) -> Cost:
    """A version's cost before its first load: its files' size times its backend's factor, per
    instance (a python function's process, or its memory_limit_mb where it declares one), and
    the file's bytes beside it while it loads; on a GPU the model's weights go to device memory,
    and host memory holds the file as it loads."""
    model = function.manifest.model
    size = sum(item.size for item in function.files) or _model_file_bytes(function)
    each = int(size * ESTIMATE_FACTORS.get(model.backend, 1.0))
    count = model.instances
    if model.backend == "python":
        each = model.memory_limit_mb * MIB if model.memory_limit_mb else PROCESS_BYTES + each
        return Cost(each * count)
    if on_gpu(function):
        return Cost(size * count, each * count, load_host_bytes=size * (count + 1))
    return Cost(each * count, load_host_bytes=each * count + size)


def _model_file_bytes(function: FunctionVersion) -> int:
    """An unversioned folder's version lists no files: its model file's size on disk."""
    try:
        return (function.directory / function.manifest.model.path).stat().st_size
    except OSError:
        return 0


class Costs:
    """Each version's cost, measured at its last load (kept after it is unloaded), else estimated."""

    def __init__(self) -> None:
        self._measured: dict[Key, Cost] = {}

    def of(self, function: FunctionVersion) -> Cost:
        return self._measured.get((function.name, function.version)) or estimate(function)

    def remember(self, key: Key, cost: Cost) -> None:
        self._measured[key] = dataclasses.replace(cost, measured=True)


def host_limit_bytes(
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    own_cgroup: Path = Path("/proc/self/cgroup"),
    meminfo: Path = Path("/proc/meminfo"),
) -> int:
    """What this process may use of host memory: its memory cgroup's limit (v2 memory.max, which is
    how a container's memory limit is set), else the machine's memory (MemTotal)."""
    total = _mem_total(meminfo)
    try:
        relative = own_cgroup.read_text(encoding="ascii").strip().split("::", 1)[1].lstrip("/")
    except (OSError, IndexError):
        relative = ""
    for folder in (cgroup_root / relative, cgroup_root):
        try:
            text = (folder / "memory.max").read_text(encoding="ascii").strip()
        except OSError:
            continue
        if text.isdigit():
            return min(int(text), total) if total else int(text)
    return total


def _mem_total(meminfo: Path) -> int:
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def runner_limits(
    enabled: bool,
    host_budget_bytes: int,
    gpu_budget_bytes: int,
    share: float,
    base_bytes: int,
    device: gpu.Device | gpu.NoDevice,
    gpu_index: int = 0,
) -> MemoryLimits:
    """The runner's budget from its settings: a byte count where set, else `share` of what the
    pod or machine has (less `base_bytes`, what the runner holds before any model) and of the
    GPU's memory as NVML reports it; no GPU budget without a GPU that NVML sees."""
    if not enabled:
        return MemoryLimits(None, None, gpu_index)
    host = host_budget_bytes or max(int(host_limit_bytes() * share) - base_bytes, 0)
    device_bytes = None
    if isinstance(device, gpu.Device):
        device_bytes = gpu_budget_bytes or int(device.total_bytes * share)
    return MemoryLimits(host, device_bytes, gpu_index)


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set size, from /proc (0 where there is no /proc or no such process)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Set a process's peak resident size (VmHWM) to its resident size now; False where the
    kernel does not let it (then the peak of its whole life is read)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes(pid: int | str = "self") -> int:
    """A process's peak resident size since it started or its last `reset_peak_rss` (0 where
    there is no /proc)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def give_back_memory() -> None:
    """Collect cycles, then ask glibc to return freed heap pages to the system: without it, an
    unloaded model's memory stays in the process's arenas and RSS does not come down."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        libc = ctypes.CDLL(name)
        trim = getattr(libc, "malloc_trim", None)
        if trim is not None:
            trim(0)
