"""NVML (nvidia-ml-py, imported lazily: its one home), initialised once per process, and the
readings Triton exports per GPU (utilization, memory, power, energy). Nothing here raises on a
machine without a GPU or without the bindings: there are no GPUs to read."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_nvml: Any = None
_problem = ""


def library() -> Any:
    """The initialised pynvml module, or None (`problem()` says why)."""
    global _nvml, _problem  # noqa: PLW0603 - NVML is initialised once per process
    with _lock:
        if _nvml is None and not _problem:
            try:
                import pynvml  # type: ignore[import-not-found,unused-ignore]

                pynvml.nvmlInit()
                _nvml = pynvml
            except ImportError:
                _problem = "NVML's Python bindings (nvidia-ml-py) are not installed"
            except Exception as exc:  # pynvml.NVMLError and OSError: no driver, no device
                _problem = f"NVML did not start: {exc}"
        return _nvml


def problem() -> str:
    """Why `library()` answered None ('' when it did not)."""
    return _problem


@dataclasses.dataclass(frozen=True, slots=True)
class GpuReading:
    """One look at a GPU, in the units Triton exports."""

    uuid: str
    utilization: float
    """The share of the last sample period a kernel ran: 0.0 to 1.0."""
    memory_used_bytes: int
    memory_total_bytes: int
    power_w: float | None
    power_limit_w: float | None
    energy_j: float | None
    """Since the driver loaded (NVML's counter); None where the GPU does not count it."""


def read_gpus() -> list[GpuReading]:
    """Every GPU NVML sees; empty without NVML. Blocking (a few NVML calls per GPU)."""
    nvml = library()
    if nvml is None:
        return []
    readings = []
    try:
        count = nvml.nvmlDeviceGetCount()
    except Exception as exc:  # pynvml.NVMLError
        log.debug("NVML could not count the GPUs: %s", exc)
        return []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            uuid = text(nvml.nvmlDeviceGetUUID(handle))
            busy = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
        except Exception as exc:  # pynvml.NVMLError: a GPU that fell off the bus, say
            log.debug("NVML could not read GPU %d: %s", index, exc)
            continue
        readings.append(
            GpuReading(
                uuid,
                busy,
                int(memory.used),
                int(memory.total),
                _optional(nvml.nvmlDeviceGetPowerUsage, handle, 1000),
                _optional(nvml.nvmlDeviceGetEnforcedPowerLimit, handle, 1000),
                _optional(nvml.nvmlDeviceGetTotalEnergyConsumption, handle, 1000),
            )
        )
    return readings


def _optional(read: Any, handle: Any, per_unit: int) -> float | None:
    """NVML's milli-unit reading in units, or None where the GPU does not report it."""
    try:
        return float(read(handle)) / per_unit
    except Exception:  # pynvml.NVMLError_NotSupported and kin
        return None


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
