"""Triton's metric names (nv_inference_*, nv_cache_*, nv_gpu_*) with Triton's labels and units,
derived when scraped from what fngate keeps anyway (the statistics hashes runners add to, the
gateway's cache counters, NVML), and written in Prometheus's text format as Triton writes them:
counters without a `_total` suffix, durations in integer microseconds."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from fngate.nvml import GpuReading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Each family's name, type, labels and help are Triton 2.51's (tests/e2e/triton-2.51-metrics.txt is
# a scrape of it); what fngate counts in each is said in docs/reference/metrics.md.
INFERENCE = (
    # (name, statistics hash field, divisor to Triton's unit, help)
    (
        "nv_inference_request_success",
        "success_count",
        1,
        "Number of successful inference requests, all batch sizes",
    ),
    (
        "nv_inference_count",
        "inference_count",
        1,
        "Number of inferences performed (does not include cached requests)",
    ),
    (
        "nv_inference_exec_count",
        "execution_count",
        1,
        "Number of model executions performed (does not include cached requests)",
    ),
    (
        "nv_inference_request_duration_us",
        "success_ns",
        1000,
        "Cumulative inference request duration in microseconds (includes cached requests)",
    ),
    (
        "nv_inference_queue_duration_us",
        "queue_ns",
        1000,
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
    ),
    (
        "nv_inference_compute_input_duration_us",
        "compute_input_ns",
        1000,
        "Cumulative compute input duration in microseconds (does not include cached requests)",
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "compute_infer_ns",
        1000,
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
    ),
    (
        "nv_inference_compute_output_duration_us",
        "compute_output_ns",
        1000,
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
    ),
)
FAILURE = "nv_inference_request_failure"
FAILURE_HELP = "Number of failed inference requests, all batch sizes"
REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
"""Triton's failure reasons: refused by the queue (full, or its timeout), the caller left, the
model failed, anything else."""


@dataclasses.dataclass(frozen=True, slots=True)
class Family:
    name: str
    help: str
    kind: str
    """counter or gauge"""
    samples: tuple[tuple[tuple[tuple[str, str], ...], float], ...]
    """(labels as (name, value) pairs, value)"""
    suffixes: tuple[str, ...] = ()
    """Each sample's name after the family's (a histogram's _bucket, _sum, _count); none: bare."""


@dataclasses.dataclass(frozen=True, slots=True)
class VersionCounts:
    """What Triton's per-version families say of one (model, version)."""

    model: str
    version: str
    stats: Mapping[bytes, bytes]
    """Its statistics hash, summed over every runner (empty: never run)."""
    failures: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Failures by Triton's reason that this gateway saw and no runner counts (REJECTED, CANCELED)."""
    pending: int = 0
    """Invocations waiting for a runner (the model's, counted on its default version)."""


def inference_families(counted: Sequence[VersionCounts]) -> list[Family]:
    """nv_inference_* per (model, version), from each version's statistics hash (an empty hash: a
    version never run, all zeros), summed over every runner as the hash is; its failures by reason
    (BACKEND: the runners' count; the others: this gateway's) and its pending gauge."""
    rows = [
        (
            (("model", item.model), ("version", item.version)),
            {key.decode(): int(value) for key, value in item.stats.items()},
            item,
        )
        for item in counted
    ]
    families = [
        Family(
            name,
            text,
            "counter",
            tuple((labels, fields.get(field, 0) // divisor) for labels, fields, _ in rows),
        )
        for name, field, divisor, text in INFERENCE
    ]
    failures = tuple(
        (
            (("model", item.model), ("reason", reason), ("version", item.version)),
            fields.get("fail_count", 0) if reason == "BACKEND" else item.failures.get(reason, 0),
        )
        for _, fields, item in rows
        for reason in REASONS
    )
    families.insert(1, Family(FAILURE, FAILURE_HELP, "counter", failures))
    families.append(
        Family(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            "gauge",
            tuple((labels, item.pending) for labels, _, item in rows),
        )
    )
    return families


@dataclasses.dataclass(frozen=True, slots=True)
class CpuReading:
    busy: int
    total: int
    """Jiffies, summed over every CPU, from /proc/stat."""


def read_cpu() -> CpuReading | None:
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return CpuReading(sum(fields) - idle, sum(fields))


def read_memory() -> tuple[int, int] | None:
    """The host's memory (total, used) in bytes: used is what is not available (MemAvailable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            fields = {
                line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo if line.count(" ") >= 1
            }
    except (OSError, ValueError, IndexError):
        return None
    total = fields.get("MemTotal", 0)
    return total, total - fields.get("MemAvailable", total)


def host_families(before: CpuReading | None, now: CpuReading | None) -> list[Family]:
    """nv_cpu_* (utilization between two readings, 0.0 to 1.0, and memory) and the pinned memory
    pool's two gauges, which are 0: fngate keeps no pinned pool (Triton's with a pool size of 0)."""
    families = [
        Family(
            "nv_pinned_memory_pool_total_bytes",
            "Pinned memory pool total memory size, in bytes",
            "gauge",
            (((), 0.0),),
        ),
        Family(
            "nv_pinned_memory_pool_used_bytes",
            "Pinned memory pool used memory size, in bytes",
            "gauge",
            (((), 0.0),),
        ),
    ]
    if before is not None and now is not None and now.total > before.total:
        share = (now.busy - before.busy) / (now.total - before.total)
        families.append(
            Family("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", "gauge", (((), share),))
        )
    memory = read_memory()
    if memory is not None:
        total, used = memory
        families += [
            Family(
                "nv_cpu_memory_total_bytes",
                "CPU total memory (RAM), in bytes",
                "gauge",
                (((), float(total)),),
            ),
            Family(
                "nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", "gauge", (((), float(used)),)
            ),
        ]
    return families


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
        for index, (labels, value) in enumerate(family.samples):
            name = family.name + (family.suffixes[index] if family.suffixes else "")
            inside = ",".join(f'{label}="{_escape_label(text)}"' for label, text in labels)
            lines.append(f"{name}{{{inside}}} {_number(value)}" if inside else f"{name} {_number(value)}")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
