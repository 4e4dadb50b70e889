"""Triton's metric names (nv_inference_*, nv_cache_*, nv_gpu_*) with Triton's labels and units,
derived when scraped from what fngate keeps anyway (the statistics hashes runners add to, the
gateway's cache counters, NVML), and written in Prometheus's text format as Triton writes them:
counters without a `_total` suffix, durations in integer microseconds."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from fngate.nvml import GpuReading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

INFERENCE = (
    # (name, statistics hash field, divisor to Triton's unit, help)
    ("nv_inference_request_success", "success_count", 1, "Invocations a runner answered successfully"),
    ("nv_inference_request_failure", "fail_count", 1, "Invocations a runner answered with an error"),
    ("nv_inference_count", "inference_count", 1, "Rows executed, over all batches (cache hits not included)"),
    ("nv_inference_exec_count", "execution_count", 1, "Batches executed (cache hits not included)"),
    (
        "nv_inference_request_duration_us",
        "success_ns",
        1000,
        "Cumulative time of successful invocations, enqueue to answer, in microseconds",
    ),
    (
        "nv_inference_queue_duration_us",
        "queue_ns",
        1000,
        "Cumulative time successful invocations waited in the queue, in microseconds",
    ),
    (
        "nv_inference_compute_input_duration_us",
        "compute_input_ns",
        1000,
        "Cumulative input preparation time, in microseconds (not timed apart: 0)",
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "compute_infer_ns",
        1000,
        "Cumulative batch time of successful invocations, a cold load included, in microseconds",
    ),
    (
        "nv_inference_compute_output_duration_us",
        "compute_output_ns",
        1000,
        "Cumulative output time, in microseconds (not timed apart: 0)",
    ),
)


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    name: str
    help: str
    kind: str
    """counter or gauge"""
    samples: tuple[tuple[tuple[tuple[str, str], ...], float], ...]
    """(labels as (name, value) pairs, value)"""


def inference_families(stats: Sequence[tuple[str, str, Mapping[bytes, bytes]]]) -> list[Family]:
    """nv_inference_* per (model, version), from each version's statistics hash (an empty hash: a
    version never run, all zeros), summed over every runner as the hash is."""
    rows = [
        ((("model", model), ("version", version)), {key.decode(): int(value) for key, value in raw.items()})
        for model, version, raw in stats
    ]
    return [
        Family(
            name, text, "counter", tuple((labels, fields.get(field, 0) // divisor) for labels, fields in rows)
        )
        for name, field, divisor, text in INFERENCE
    ]


def cache_families(hits: Mapping[str, float], misses: Mapping[str, float]) -> list[Family]:
    """nv_cache_num_hits_per_model and _misses_, by function (`model`): this gateway's counts."""
    return [
        Family(
            "nv_cache_num_hits_per_model",
            "Invocations this gateway answered from the response cache",
            "counter",
            tuple(((("model", model),), value) for model, value in sorted(hits.items())),
        ),
        Family(
            "nv_cache_num_misses_per_model",
            "Cacheable invocations the response cache could not answer at this gateway",
            "counter",
            tuple(((("model", model),), value) for model, value in sorted(misses.items())),
        ),
    ]


GPU = (
    ("nv_gpu_utilization", "gauge", "Share of time a kernel ran on the GPU, 0.0 to 1.0"),
    ("nv_gpu_memory_total_bytes", "gauge", "GPU memory in all, in bytes"),
    ("nv_gpu_memory_used_bytes", "gauge", "GPU memory in use, in bytes"),
    ("nv_gpu_power_usage", "gauge", "GPU power draw, in watts"),
    ("nv_gpu_power_limit", "gauge", "GPU power limit, in watts"),
    ("nv_energy_consumption", "counter", "GPU energy used since its driver loaded, in joules"),
)


def gpu_families(readings: Sequence[GpuReading]) -> list[Family]:
    """nv_gpu_* by `gpu_uuid`, as Triton labels them; none at all without a GPU."""
    if not readings:
        return []
    values: dict[str, list[tuple[tuple[tuple[str, str], ...], float]]] = {name: [] for name, _, _ in GPU}
    for reading in readings:
        labels = (("gpu_uuid", reading.uuid),)
        measured = {
            "nv_gpu_utilization": reading.utilization,
            "nv_gpu_memory_total_bytes": reading.memory_total_bytes,
            "nv_gpu_memory_used_bytes": reading.memory_used_bytes,
            "nv_gpu_power_usage": reading.power_w,
            "nv_gpu_power_limit": reading.power_limit_w,
            "nv_energy_consumption": reading.energy_j,
        }
        for name, value in measured.items():
            if value is not None:
                values[name].append((labels, float(value)))
    return [Family(name, text, kind, tuple(values[name])) for name, kind, text in GPU if values[name]]


def render(families: Iterable[Family]) -> bytes:
    """Prometheus's text exposition format (0.0.4), names exactly as given."""
    lines = []
    for family in families:
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for labels, value in family.samples:
            inside = ",".join(f'{name}="{_escape_label(text)}"' for name, text in labels)
            lines.append(f"{family.name}{{{inside}}} {_number(value)}")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
