"""The gateway's Prometheus metrics, in the spirit of Triton's nv_inference_* families, and the
calls that count an invocation's outcome (the core's, whatever the front end). With several gateway
processes (PROMETHEUS_MULTIPROC_DIR set), an exposition aggregates all of them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
from opentelemetry import trace
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from redis.exceptions import RedisError

from fngate import keys, queue
from fngate.telemetry import LATENCY_BUCKETS

REQUEST_SUCCESS = Counter(
    "fngate_request_success", "Invocations answered successfully", ["function", "version"]
)
REQUEST_FAILURE = Counter(
    "fngate_request_failure", "Invocations answered with an error, by error code", ["function", "code"]
)
REQUEST_DURATION = Histogram(
    "fngate_request_duration_seconds",
    "Gateway time per invocation, body read to answer",
    ["function"],
    buckets=LATENCY_BUCKETS,
)
COLD_START = Histogram(
    "fngate_cold_start_seconds",
    "What invocations that paid a cold start waited for, by phase (start, queue, fetch, load, exec)",
    ["function", "phase"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
CACHE_HITS = Counter("fngate_cache_hits", "Invocations answered from the response cache", ["function"])
CACHE_MISSES = Counter(
    "fngate_cache_misses", "Cacheable invocations the cache could not answer", ["function"]
)
CACHE_FAILURES = Counter("fngate_cache_failures", "Cache lookups that failed (the request went on)")
WITHDRAWN = Counter(
    "fngate_withdrawn",
    "Synchronous invocations whose caller left while queued, by what became of their entry:"
    " withdrawn (no runner runs it), stopped (the runner that read it answers it unrun), marked (one of"
    " a grouped entry: whichever runner reads it answers it unrun), running and"
    " shared (it runs for identical ones), gone, failed",
    ["function", "outcome"],
)
QUEUE_DEPTH = Gauge(
    "fngate_queue_depth",
    "Invocations queued or in flight, per priority level (sync, async)",
    ["function", "level"],
    multiprocess_mode="max",
)
QUEUE_LAG = Gauge(
    "fngate_queue_lag",
    "Invocations no runner has read yet, per priority level",
    ["function", "level"],
    multiprocess_mode="max",
)
QUEUE_PENDING = Gauge(
    "fngate_queue_pending",
    "Invocations read by a runner, not yet answered, per priority level",
    ["function", "level"],
    multiprocess_mode="max",
)


async def refresh_queue_gauges(redis: aioredis.Redis, functions: Mapping[str, int]) -> dict[str, int]:
    """Read the length and group state of each function's stream at every priority level
    (`functions`: name -> its priority levels, batching.priorities): one round trip, at scrape time.
    Returns the invocations no runner has read yet, by function (over its levels)."""
    waiting: dict[str, int] = {}
    streams = [
        (name, level, stream)
        for name, priorities in functions.items()
        for level, stream in zip(keys.level_names(priorities), keys.levels(name, priorities), strict=True)
    ]
    async with redis.pipeline(transaction=False) as pipe:
        for _name, _level, stream in streams:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
            pipe.get(queue.extra_count(stream))
        try:
            results = await pipe.execute(raise_on_error=False)
        except RedisError:
            return waiting
    for index, (name, level, _stream) in enumerate(streams):
        depth, groups, extra = results[3 * index : 3 * index + 3]
        if isinstance(depth, int):  # entries, and what grouped entries hold beyond one each
            QUEUE_DEPTH.labels(name, level).set(depth + (int(extra) if isinstance(extra, bytes) else 0))
        for group in groups if isinstance(groups, list) else ():
            if group.get("name") in (keys.RUNNER_GROUP, keys.RUNNER_GROUP.encode()):
                QUEUE_PENDING.labels(name, level).set(group.get("pending") or 0)
                QUEUE_LAG.labels(name, level).set(group.get("lag") or 0)
                waiting[name] = waiting.get(name, 0) + (group.get("lag") or 0)
    return waiting


MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
"""Read once, at import, as prometheus_client itself reads it: gateway workers sum their metrics."""


def registry() -> CollectorRegistry:
    """What /metrics exposes: this process's metrics, or every worker's summed."""
    if MULTIPROCESS:
        summed = CollectorRegistry()
        multiprocess.MultiProcessCollector(summed)  # type: ignore[no-untyped-call]
        return summed
    return REGISTRY


def exposition() -> bytes:
    return generate_latest(registry())


def counts(
    collected: CollectorRegistry, name: str, where: Callable[[dict[str, str]], bool] | None = None
) -> dict[str, float]:
    """A counter's values by function, as exposed (every worker's summed); with `where`, of the
    samples whose labels it accepts."""
    found: dict[str, float] = {}
    for family in collected.collect():
        if family.name == name:
            for sample in family.samples:
                if sample.name == f"{name}_total" and (where is None or where(sample.labels)):
                    function = sample.labels.get("function", "")
                    found[function] = found.get(function, 0.0) + sample.value
    return found


_durations: dict[str, Any] = {}
_successes: dict[tuple[str, str], Any] = {}


def answered(function: str, version: str, started: float) -> None:
    """An invocation answered successfully; `started` is time.perf_counter() when it arrived."""
    labels = (function, version)
    success = _successes.get(labels)
    if success is None:
        success = _successes[labels] = REQUEST_SUCCESS.labels(*labels)
    success.inc()
    took(function, started)


def failed(function: str, code: str) -> None:
    """An invocation answered with an error. `function` is '' for a name that is no function's (a
    client cannot add series by inventing names)."""
    REQUEST_FAILURE.labels(function, code).inc()


def server_timing(function: str, timing: Mapping[str, float]) -> bytes:
    """The Server-Timing value of an answer that paid a cold start (each phase, in ms), counted in
    fngate_cold_start_seconds and, traced, an event of the request's span, as it is made."""
    for phase, ms in timing.items():
        COLD_START.labels(function, phase).observe(ms / 1000)
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event("cold start", {f"fngate.cold_start.{phase}_ms": ms for phase, ms in timing.items()})
    return ", ".join(f"{phase};dur={ms:.1f}" for phase, ms in timing.items()).encode()


def took(function: str, started: float) -> None:
    child = _durations.get(function)
    if child is None:
        child = _durations[function] = REQUEST_DURATION.labels(function)
    child.observe(time.perf_counter() - started)


def looked_up(function: str, hit: bool) -> None:
    (CACHE_HITS if hit else CACHE_MISSES).labels(function).inc()
