"""The runner's Prometheus metrics (compare Triton's nv_inference_* families), served on the
runner's own port by runner.status."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fngate.telemetry import LATENCY_BUCKETS
from runner import gpu

if TYPE_CHECKING:
    from runner.budget import Cost, MemoryLimits
    from runner.models import LoadedModel

INFERENCE_COUNT = Counter(
    "fngate_inference_count", "Rows executed (inferences), over all batches", ["function", "version"]
)
EXECUTION_COUNT = Counter("fngate_execution_count", "Batches executed", ["function", "version"])
INVOCATIONS = Counter(
    "fngate_runner_invocations", "Invocations a runner answered, by outcome", ["function", "outcome"]
)
BATCH_SIZE = Histogram(
    "fngate_batch_size", "Rows per executed batch", ["function"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)
)
QUEUE_DURATION = Histogram(
    "fngate_queue_duration_seconds",
    "Enqueue to the start of the batch that served it",
    ["function"],
    buckets=LATENCY_BUCKETS,
)
COMPUTE_DURATION = Histogram(
    "fngate_compute_duration_seconds", "Backend time per batch", ["function"], buckets=LATENCY_BUCKETS
)
MODEL_LOAD_DURATION = Histogram(
    "fngate_model_load_duration_seconds",
    "Time to load a model",
    ["function"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
MODEL_LOADS = Counter("fngate_model_loads", "Model loads, by outcome", ["function", "outcome"])
COLD_STARTS = Counter(
    "fngate_cold_starts", "Batches that had to wait for their model to load first", ["function"]
)
MODELS_LOADED = Gauge("fngate_models_loaded", "Models loaded in this runner")

# GPU: what each model runs on, its engine caches, and device memory (compare Triton's nv_gpu_*).
MODEL_DEVICE = Gauge(
    "fngate_model_device",
    "1 for each loaded model, labelled with what it runs on and the accelerator its manifest asked for",
    ["function", "version", "device", "asked"],
)
ACCELERATOR_FALLBACKS = Counter(
    "fngate_accelerator_fallbacks",
    "Model loads that run on another provider than their manifest asked for",
    ["function", "asked", "device"],
)
ENGINE_CACHE_EVENTS = Counter(
    "fngate_engine_cache_events",
    "TensorRT engine caches by event: local, downloaded, miss (built), mismatch (ignored, built), "
    "stale (did not load: deleted, built), uploaded, upload_failed",
    ["function", "event"],
)
MODEL_GPU_MEMORY = Gauge(
    "fngate_model_gpu_memory_bytes",
    "GPU memory a loaded model took when it loaded (NVML)",
    ["function", "version", "gpu"],
)
CPU_DEVICES = ("CPUExecutionProvider", "python")
"""What a model that runs on no GPU reports as its device."""
PYTHON_GPU = "python:cuda"
"""The device of a python function whose own process runs on the runner's GPU."""


class GpuMemory(Collector):
    """fngate_gpu_memory_used_bytes and _total_bytes of the runner's GPU, read from NVML when
    scraped; registered once a model runs on that GPU."""

    def __init__(self, index: int) -> None:
        self._index = index

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily("fngate_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=["gpu"])
        total = GaugeMetricFamily("fngate_gpu_memory_total_bytes", "GPU memory in all (NVML)", labels=["gpu"])
        device = gpu.find_device(self._index)
        if isinstance(device, gpu.Device):
            used.add_metric([str(self._index)], device.used_bytes)
            total.add_metric([str(self._index)], device.total_bytes)
        yield used
        yield total


@functools.cache
def _watch(index: int) -> None:
    REGISTRY.register(GpuMemory(index))


def _model_labels(name: str, version: str, accelerator: str, backend: object) -> tuple[str, str, str, str]:
    return (name, version, str(getattr(backend, "device", "python")), accelerator)


# The memory budget (runner.budget; docs/memory.md).
MEMORY_BUDGET = Gauge(
    "fngate_memory_budget_bytes", "What models may take of each memory (host, gpu<N>)", ["memory"]
)
MEMORY_USED = Gauge(
    "fngate_memory_used_bytes",
    "What the loaded models take of each memory, as measured at their loads",
    ["memory"],
)
MODEL_MEMORY = Gauge(
    "fngate_model_memory_bytes",
    "What a loaded model took of each memory when it loaded (every instance)",
    ["function", "version", "memory"],
)
MEMORY_EVICTIONS = Counter(
    "fngate_memory_evictions", "Idle models unloaded to make room for another's load", ["function"]
)
MEMORY_REFUSALS = Counter(
    "fngate_memory_refusals",
    "Loads refused by the memory budget, by reason: too-large (answered unavailable), no-room (left "
    "to other runners while the models in use here leave too little)",
    ["function", "reason"],
)


def _memories(gpu_index: int) -> tuple[str, str]:
    return ("host", f"gpu{gpu_index}")


def memory_budget(limits: MemoryLimits) -> None:
    for memory, limit in zip(_memories(limits.gpu_index), (limits.host_bytes, limits.gpu_bytes), strict=True):
        if limit is not None:
            MEMORY_BUDGET.labels(memory).set(limit)


def memory_used(limits: MemoryLimits | None, models: Iterable[LoadedModel]) -> None:
    costs = [model.cost for model in models]
    host, device = _memories(limits.gpu_index if limits is not None else 0)
    MEMORY_USED.labels(host).set(sum(cost.host_bytes for cost in costs))
    MEMORY_USED.labels(device).set(sum(cost.gpu_bytes for cost in costs))


def model_loaded(
    name: str, version: str, accelerator: str, backend: object, gpu_index: int, cost: Cost | None = None
) -> None:
    """After a load: what the model runs on and, on a GPU, the memory it took."""
    labels = _model_labels(name, version, accelerator, backend)
    MODEL_DEVICE.labels(*labels).set(1)
    if cost is not None:
        host, device = _memories(gpu_index)
        MODEL_MEMORY.labels(name, version, host).set(cost.host_bytes)
        MODEL_MEMORY.labels(name, version, device).set(cost.gpu_bytes)
    if labels[2] not in CPU_DEVICES:
        _watch(gpu_index)
        MODEL_GPU_MEMORY.labels(name, version, str(gpu_index)).set(
            int(getattr(backend, "device_memory_bytes", 0))
        )


def model_unloaded(name: str, version: str, accelerator: str, backend: object, gpu_index: int) -> None:
    with contextlib.suppress(KeyError):
        MODEL_DEVICE.remove(*_model_labels(name, version, accelerator, backend))
    with contextlib.suppress(KeyError):
        MODEL_GPU_MEMORY.remove(name, version, str(gpu_index))
    for memory in _memories(gpu_index):
        with contextlib.suppress(KeyError):
            MODEL_MEMORY.remove(name, version, memory)


RSS_BYTES = Gauge("fngate_runner_rss_bytes", "Resident memory of this runner process")
CACHE_STORE_FAILURES = Counter(
    "fngate_cache_store_failures", "Answers a runner could not store in a separate cache Redis"
)
FUNCTION_RESTARTS = Counter(
    "fngate_function_restarts",
    "Processes of Python functions stopped to be started again, by reason: exited (it died), timeout "
    "(a batch ran past execution_timeout_ms), memory (its RSS went over memory_limit_mb), protocol "
    "(it wrote something else than an answer on the pipe)",
    ["function", "reason"],
)
