"""The runner's Prometheus metrics (compare Triton's nv_inference_* families), served on the
runner's own port by runner.status."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from fngate.telemetry import LATENCY_BUCKETS

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
