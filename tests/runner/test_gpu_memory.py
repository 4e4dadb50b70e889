"""GPU memory and the device: what a load took, counted the same way before and after (a process's
first load creates its CUDA context); which NVML device a CUDA index names (by UUID); the metrics
a load and an unload set; and NVML where there is none."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from fngate.repository import FolderRepository
from runner import gpu
from runner.gpu import (
    MIB,
    MemoryReading,
    child_visible_devices,
    freed_bytes,
    nvml_index,
    taken_bytes,
    uuid_text,
)
from runner.models import LoadedModels
from tests.runner.gpu_support import CLASSIFIER, require_gpu

A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
C = "GPU-cccccccc-0000-0000-0000-000000000000"
MIG = "MIG-a1a1a1a1-0000-0000-0000-000000000000"
H200 = gpu.Device(0, "NVIDIA H200", A, "9.0", 141 * 1024**3, 0)


@pytest.mark.parametrize(
    ("before", "after", "taken_mib"),
    [
        # A process's first load: NVML lists it only once the load made its CUDA context; the
        # device's use rose by more (another process loaded too): this process's 500 MiB count.
        (MemoryReading(9000 * MIB, None), MemoryReading(10_700 * MIB, 500 * MIB), 500),
        (MemoryReading(9000 * MIB, 300 * MIB), MemoryReading(9800 * MIB, 800 * MIB), 500),
        # NVML never lists this process (its pid is hidden in a container): the device's use, both times.
        (MemoryReading(9000 * MIB, None), MemoryReading(9600 * MIB, None), 600),
        (MemoryReading(9000 * MIB, None), MemoryReading(8000 * MIB, None), 0),  # others freed more
    ],
)
def test_a_load_is_measured_the_same_way_before_and_after(
    before: MemoryReading, after: MemoryReading, taken_mib: int
) -> None:
    assert taken_bytes(before, after) == taken_mib * MIB


@pytest.mark.parametrize(
    ("before", "after", "freed_mib"),
    [
        # A function's process that ended: NVML lists it before the unload, not after.
        (MemoryReading(9000 * MIB, 700 * MIB), MemoryReading(8300 * MIB, None), 700),
        # The runner's own session closed: its CUDA context (here 300 MiB) stays with the process.
        (MemoryReading(9000 * MIB, 1000 * MIB), MemoryReading(8300 * MIB, 300 * MIB), 700),
        (MemoryReading(9000 * MIB, None), MemoryReading(8500 * MIB, None), 500),  # pids hidden
    ],
)
def test_an_unload_is_measured_the_same_way_before_and_after(
    before: MemoryReading, after: MemoryReading, freed_mib: int
) -> None:
    assert freed_bytes(before, after) == freed_mib * MIB


@pytest.mark.parametrize(
    ("device", "index", "visible", "expected"),
    [
        (H200, 0, "3,5", A),  # NVML knows it: its UUID, whatever the numbering
        (dataclasses.replace(H200, uuid=MIG), 0, None, MIG),  # a MIG instance by its own UUID
        (gpu.NoDevice("no NVML"), 1, "3,5", "5"),
        (gpu.NoDevice("no NVML"), 1, None, "1"),
        (gpu.NoDevice("no NVML"), 2, "3,5", ""),  # no such GPU: the child sees none
    ],
)
def test_a_functions_process_is_given_the_runners_gpu(
    device: gpu.Device | gpu.NoDevice, index: int, visible: str | None, expected: str
) -> None:
    assert child_visible_devices(device, index, visible) == expected


def test_cudas_uuid_is_written_as_nvml_writes_it() -> None:
    raw = bytes.fromhex("0123456789abcdef0011223344556677")
    assert uuid_text(raw) == "GPU-01234567-89ab-cdef-0011-223344556677"


@pytest.mark.parametrize(
    ("cuda_index", "cuda_uuid", "visible", "expected"),
    [
        (0, None, None, 0),  # nothing hidden, nothing reordered
        (1, C, None, 2),  # CUDA's own UUID settles it, whatever the order
        (0, B, "2,1", 1),
        (0, None, "2,1", 2),  # CUDA_VISIBLE_DEVICES by index: CUDA's 0 is NVML's 2
        (1, None, "2,1", 1),
        (0, None, "GPU-cccc", 2),  # by UUID prefix
        (0, "GPU-dddddddd-0000-0000-0000-000000000000", None, "is not among the GPUs NVML sees"),
        (2, None, "2,1", "leaves 2 GPUs; there is no GPU 2"),
        (0, None, "GPU-", "names no single GPU"),
        (3, None, None, "NVML sees 3 GPUs; there is no GPU 3"),
    ],
)
def test_a_cuda_index_is_mapped_to_nvmls_by_uuid(
    cuda_index: int, cuda_uuid: str | None, visible: str | None, expected: int | str
) -> None:
    found = nvml_index(cuda_index, [A, B, C.upper()], cuda_uuid, visible)
    if isinstance(expected, int):
        assert found == expected
    else:
        assert isinstance(found, str) and expected in found


@pytest.mark.parametrize(
    ("cuda_index", "cuda_uuid", "visible", "expected"),
    [
        (0, MIG, None, 1),  # CUDA's UUID of a MIG instance is its MIG UUID
        (0, "GPU-" + MIG.split("-", 1)[1], None, 1),  # as uuid_text writes the driver API's bytes
        (0, None, "1", 2),  # an index counts whole GPUs: NVML's second GPU comes after A's instance
        (1, None, None, 2),
        (0, None, MIG[:12], 1),  # CUDA_VISIBLE_DEVICES=MIG-<uuid>
    ],
)
def test_mig_instances_are_found_among_nvmls_devices(
    cuda_index: int, cuda_uuid: str | None, visible: str | None, expected: int
) -> None:
    assert nvml_index(cuda_index, [A, MIG, B], cuda_uuid, visible) == expected


def test_the_driver_major_version_is_read_from_nvmls() -> None:
    device = gpu.Device(0, "NVIDIA H200", A, "9.0", 141 * 1024**3, 0, "580.159.03")
    assert device.driver_major == "580"


async def test_a_loaded_model_reports_its_device_until_unloaded(tmp_path: Path) -> None:
    record = FolderRepository(CLASSIFIER.parent).get("classifier")
    models = LoadedModels(1)
    models.offer({"classifier": record})
    (version,) = record.versions
    labels = {"function": "classifier", "version": version, "device": "CPUExecutionProvider", "asked": "cpu"}
    try:
        await models.get(record.versions[version])
        assert REGISTRY.get_sample_value("fngate_model_device", labels) == 1
        memory = {"function": "classifier", "version": version, "gpu": "0"}
        assert REGISTRY.get_sample_value("fngate_model_gpu_memory_bytes", memory) is None  # not on a GPU
        assert await models.unload(("classifier", version))
        assert REGISTRY.get_sample_value("fngate_model_device", labels) is None
    finally:
        models.close()


def test_without_a_gpu_nvml_says_why_and_reports_no_memory() -> None:
    device = gpu.find_device(0)
    if isinstance(device, gpu.Device):
        pytest.skip(f"this machine has a GPU ({device.name})")
    assert device.reason
    assert gpu.read_memory(0) is None


@pytest.mark.gpu
def test_nvml_reads_the_gpu_cuda_numbers_0() -> None:
    device = require_gpu()
    assert device.total_bytes > device.used_bytes > 0
    assert device.uuid.startswith(("GPU-", "MIG-"))
    assert device.driver_major.isdigit()
    reading = gpu.read_memory(0)
    assert reading is not None and reading.device_used_bytes > 0
