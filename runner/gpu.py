"""The GPU as NVML sees it (through fngate.nvml, nvidia-ml-py's one home): the device a CUDA index
names (matched by UUID, since NVML and CUDA may number GPUs differently; a MIG instance by its own
UUID), what a function's own process is given to see of it, and the device memory a load takes.
NVML calls block briefly; none raises on a machine without a GPU."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

from fngate.nvml import library as nvml_library
from fngate.nvml import problem as nvml_problem
from fngate.nvml import text

log = logging.getLogger(__name__)

MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class Device:
    index: int
    """The CUDA index: what onnxruntime's device_id, cudaSetDevice and FNGATE_GPU_DEVICE count."""
    name: str
    uuid: str
    compute_capability: str
    """"9.0" for an H100/H200: TensorRT engines are built for one."""
    total_bytes: int
    used_bytes: int
    driver_version: str = ""
    """NVIDIA's driver, "580.65.06"; its major version is part of an engine's key."""
    nvml_index: int = 0
    """Its place among NVML's devices: every GPU, and after a GPU in MIG mode its MIG instances."""

    @property
    def driver_major(self) -> str:
        return self.driver_version.split(".", 1)[0]


@dataclasses.dataclass(frozen=True, slots=True)
class NoDevice:
    reason: str


def uuid_text(raw: bytes) -> str:
    """CUDA's 16-byte device UUID written as NVML writes it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    digits = raw.hex()
    return f"GPU-{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:32]}"


def nvml_index(
    cuda_index: int, nvml_uuids: Sequence[str], cuda_uuid: str | None, visible: str | None
) -> int | str:
    """The place in `nvml_uuids` of the device that CUDA numbers `cuda_index`, or why it cannot be told.

    `nvml_uuids` lists NVML's devices: each GPU (GPU-...) and, after a GPU in MIG mode, its MIG
    instances (MIG-...). CUDA counts only the devices CUDA_VISIBLE_DEVICES lists (`visible`, by
    index or UUID prefix) and by default fastest first; NVML counts every GPU in PCI order. CUDA's
    own UUID of the device (`cuda_uuid`, from the driver API: a MIG instance's is its MIG UUID)
    settles it; without one, CUDA_VISIBLE_DEVICES is read and PCI order assumed, an index in it
    counting whole GPUs only."""
    wanted = [uuid.lower() for uuid in nvml_uuids]
    gpus = [index for index, uuid in enumerate(wanted) if not uuid.startswith("mig-")]
    if cuda_uuid is not None:
        # The driver API gives a MIG instance's UUID as bare bytes (written GPU-... here), NVML
        # writes the same bytes MIG-...: the digits decide.
        digits = [_digits(uuid) for uuid in wanted]
        if _digits(cuda_uuid) in digits:
            return digits.index(_digits(cuda_uuid))
        return f"CUDA's GPU {cuda_index} ({cuda_uuid}) is not among the GPUs NVML sees"
    if visible is None:
        return (
            gpus[cuda_index]
            if cuda_index < len(gpus)
            else f"NVML sees {len(gpus)} GPUs; there is no GPU {cuda_index}"
        )
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if cuda_index >= len(entries):
        return f"CUDA_VISIBLE_DEVICES={visible!r} leaves {len(entries)} GPUs; there is no GPU {cuda_index}"
    entry = entries[cuda_index].lower()
    if entry.isdigit():
        found = int(entry)
        return (
            gpus[found]
            if found < len(gpus)
            else f"CUDA_VISIBLE_DEVICES names GPU {found}, which NVML does not see"
        )
    matches = [index for index, uuid in enumerate(wanted) if uuid.startswith(entry)]
    if len(matches) == 1:
        return matches[0]
    return f"CUDA_VISIBLE_DEVICES entry {entries[cuda_index]!r} names no single GPU that NVML sees"


def _digits(uuid: str) -> str:
    """A device UUID without its GPU- or MIG- prefix, lower case."""
    lowered = uuid.lower()
    return lowered.split("-", 1)[1] if lowered.startswith(("gpu-", "mig-")) else lowered


def child_visible_devices(device: Device | NoDevice, cuda_index: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a function's own process that is to use this runner's GPU, CUDA's
    `cuda_index` here: the device's UUID (a MIG instance's MIG UUID), which means the same device
    whatever the numbering; where NVML cannot tell, the entry the runner's own CUDA_VISIBLE_DEVICES
    (`visible`) has at that index, else the index. In the child that device is CUDA's 0."""
    if isinstance(device, Device):
        return device.uuid
    if visible is None:
        return str(cuda_index)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    return entries[cuda_index] if cuda_index < len(entries) else ""


def _cuda_uuid(cuda_index: int) -> str | None:
    """CUDA's UUID of a device, from the driver API (cuda-bindings); None without it. cuInit
    creates no context, so this costs no device memory."""
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        (error,) = driver.cuInit(0)
        if error != driver.CUresult.CUDA_SUCCESS:
            return None
        error, device = driver.cuDeviceGet(cuda_index)
        if error != driver.CUresult.CUDA_SUCCESS:
            return None
        get_uuid = getattr(driver, "cuDeviceGetUuid_v2", None) or driver.cuDeviceGetUuid
        error, uuid = get_uuid(device)
        if error != driver.CUresult.CUDA_SUCCESS:
            return None
        raw = uuid.bytes
        return uuid_text((raw.encode("latin-1") if isinstance(raw, str) else bytes(raw))[:16])
    except Exception:  # a driver the bindings do not match: fall back to CUDA_VISIBLE_DEVICES
        log.debug("cuda-bindings could not name CUDA device %d", cuda_index, exc_info=True)
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    uuid: str
    handle: Any
    parent: Any
    """The GPU's handle; for a MIG instance, that of the GPU it is part of."""


def _entries(nvml: Any) -> list[_Entry]:
    """NVML's devices: every GPU and, after a GPU in MIG mode, each of its MIG instances."""
    entries = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        entries.append(_Entry(text(nvml.nvmlDeviceGetUUID(handle)), handle, handle))
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except Exception:  # pynvml.NVMLError_NotSupported: a GPU without MIG
            continue
        if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            continue
        for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except Exception:  # pynvml.NVMLError_NotFound: an empty slot
                continue
            entries.append(_Entry(text(nvml.nvmlDeviceGetUUID(mig)), mig, handle))
    return entries


@functools.cache
def _nvml_entry(cuda_index: int) -> tuple[_Entry, int] | str:
    """Looked up once per process: which GPU a runner uses does not change while it runs."""
    nvml = nvml_library()
    if nvml is None:
        return nvml_problem()
    try:
        entries = _entries(nvml)
    except Exception as exc:  # pynvml.NVMLError
        return f"NVML could not list the GPUs: {exc}"
    found = nvml_index(
        cuda_index,
        [entry.uuid for entry in entries],
        _cuda_uuid(cuda_index),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    return found if isinstance(found, str) else (entries[found], found)


def _handle(cuda_index: int) -> tuple[Any, _Entry, int] | str:
    """(pynvml, the device's entry, its NVML index), or why there is none."""
    found = _nvml_entry(cuda_index)
    if isinstance(found, str):
        return found
    return nvml_library(), *found


def find_device(index: int = 0) -> Device | NoDevice:
    """The GPU (or MIG instance) with this CUDA index, or why there is none."""
    found = _handle(index)
    if isinstance(found, str):
        return NoDevice(found)
    nvml, entry, at = found
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(entry.parent)
        memory = nvml.nvmlDeviceGetMemoryInfo(entry.handle)
        return Device(
            index,
            text(nvml.nvmlDeviceGetName(entry.handle)),
            entry.uuid,
            f"{major}.{minor}",
            int(memory.total),
            int(memory.used),
            text(nvml.nvmlSystemGetDriverVersion()),
            at,
        )
    except Exception as exc:  # pynvml.NVMLError
        return NoDevice(f"NVML could not read GPU {index}: {exc}")


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryReading:
    """One look at a GPU's memory: the whole device's use, and this process's where NVML lists it."""

    device_used_bytes: int
    process_bytes: int | None
    """None when NVML does not list this process: it has no CUDA context yet, or NVML cannot see
    its process id (a container)."""


def read_memory(index: int = 0, pid: int | None = None) -> MemoryReading | None:
    """This process's (or `pid`'s) view of the GPU's memory; None where NVML cannot tell."""
    found = _handle(index)
    if isinstance(found, str):
        return None
    nvml, entry, _at = found
    wanted = os.getpid() if pid is None else pid
    try:
        used = int(nvml.nvmlDeviceGetMemoryInfo(entry.handle).used)
        processes = nvml.nvmlDeviceGetComputeRunningProcesses(entry.handle)
    except Exception:  # pynvml.NVMLError
        return None
    own = next(
        (int(p.usedGpuMemory) for p in processes if p.pid == wanted and p.usedGpuMemory is not None), None
    )
    return MemoryReading(used, own)


def taken_bytes(before: MemoryReading, after: MemoryReading) -> int:
    """What a load took, both readings counted the same way. Where NVML lists this process after
    the load, its own memory (absent before: none, as on a process's first load, which creates its
    CUDA context); where it does not (its process id is hidden), the device's use, which then also
    counts what other processes did meanwhile."""
    if after.process_bytes is not None:
        return max(after.process_bytes - (before.process_bytes or 0), 0)
    return max(after.device_used_bytes - before.device_used_bytes, 0)


def freed_bytes(before: MemoryReading, after: MemoryReading) -> int:
    """What an unload gave back, both readings counted the same way: this process's own memory
    where NVML listed it before (none listed after: a function's process that ended, or a context
    that holds nothing), else the device's use."""
    if before.process_bytes is not None:
        return max(before.process_bytes - (after.process_bytes or 0), 0)
    return max(before.device_used_bytes - after.device_used_bytes, 0)
