"""Triton's statistics extension over Redis: the counters one hash per function version holds, the
pure builder of what a runner adds to them after a batch, and the parser that renders a hash as one
entry of Triton's `model_stats` for the gateway."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
"""Triton's inference_stats durations, each stored as `<name>_count` and `<name>_ns`."""
COUNTS = ("inference_count", "execution_count")
LAST_INFERENCE = "last_inference"
"""Milliseconds since the epoch of the last batch's end; set, not added."""
BATCH_PREFIX = "batch_"
"""`batch_<rows>_count` and `batch_<rows>_ns`: executions of that many rows and their compute time."""


@dataclasses.dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What a runner knows when a batch is done, in the clock of stream ids (epoch time)."""

    enqueued_ms: Sequence[int]
    """Each invocation's enqueue time: the millisecond part of its stream entry id."""
    rows: Sequence[int]
    """Each invocation's rows (1 for a function without batching)."""
    failed: Sequence[bool]
    started_ns: int
    """When the runner took the batch (before a cold load, if there was one)."""
    ended_ns: int


def increments(outcome: BatchOutcome) -> dict[str, int]:
    """The HINCRBY amounts for one batch (fields with a zero increment are left out).

    As in Triton, every successful invocation adds its own queue time and the whole batch's compute
    time; a failed one adds only to `fail`. fngate does not time input preparation and output apart
    from the backend call: compute_input and compute_output are counted with 0 ns."""
    compute_ns = max(0, outcome.ended_ns - outcome.started_ns)
    failed = failed_ns = succeeded = succeeded_ns = queued_ns = succeeded_rows = 0
    for enqueued_ms, rows, failure in zip(outcome.enqueued_ms, outcome.rows, outcome.failed, strict=True):
        enqueued_ns = enqueued_ms * 1_000_000
        total_ns = max(0, outcome.ended_ns - enqueued_ns)
        if failure:
            failed += 1
            failed_ns += total_ns
            continue
        succeeded += 1
        succeeded_ns += total_ns
        queued_ns += max(0, outcome.started_ns - enqueued_ns)
        succeeded_rows += rows
    amounts = [
        ("fail_count", failed),
        ("fail_ns", failed_ns),
        ("success_count", succeeded),
        ("success_ns", succeeded_ns),
        ("queue_count", succeeded),
        ("queue_ns", queued_ns),
        ("compute_input_count", succeeded),
        ("compute_infer_count", succeeded),
        ("compute_infer_ns", compute_ns * succeeded),
        ("compute_output_count", succeeded),
    ]
    if succeeded_rows:
        batch_rows = sum(outcome.rows)
        amounts += [
            ("inference_count", succeeded_rows),
            ("execution_count", 1),
            (f"{BATCH_PREFIX}{batch_rows}_count", 1),
            (f"{BATCH_PREFIX}{batch_rows}_ns", compute_ns),
        ]
    return {field: amount for field, amount in amounts if amount}


def model_stats(name: str, version: str, raw: Mapping[bytes, bytes]) -> dict[str, Any]:
    """One entry of Triton's `model_stats` from a statistics hash (empty: a version never run)."""
    fields = {key.decode(): int(value) for key, value in raw.items()}
    batches: dict[int, dict[str, int]] = {}
    for field, value in fields.items():
        if field.startswith(BATCH_PREFIX):
            size, _, unit = field.removeprefix(BATCH_PREFIX).partition("_")
            if size.isdigit():
                batches.setdefault(int(size), {})[unit] = value
    return {
        "name": name,
        "version": version,
        "last_inference": fields.get(LAST_INFERENCE, 0),
        "inference_count": fields.get("inference_count", 0),
        "execution_count": fields.get("execution_count", 0),
        "inference_stats": {
            **{
                duration: {"count": fields.get(f"{duration}_count", 0), "ns": fields.get(f"{duration}_ns", 0)}
                for duration in DURATIONS
            },
            "cache_hit": {"count": 0, "ns": 0},
            "cache_miss": {"count": 0, "ns": 0},
        },
        "response_stats": {},
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": {"count": counts.get("count", 0), "ns": 0},
                "compute_infer": {"count": counts.get("count", 0), "ns": counts.get("ns", 0)},
                "compute_output": {"count": counts.get("count", 0), "ns": 0},
            }
            for size, counts in sorted(batches.items())
        ],
        "memory_usage": [],
    }
