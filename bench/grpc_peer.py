"""Scenario G: the Open Inference Protocol over gRPC, driven by Triton's own perf_analyzer (`-i
grpc`, binary tensors, closed loop at a fixed concurrency), against fngate's gRPC port and, with
--triton, against the real Triton's gRPC port in the same run, point by point. fngate's HTTP path
at the same points comes from scenario T or S1; this one reports gRPC and its ratios."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import perf_analyzer
from bench.deployment import Meter, metered

Row = dict[str, Any]
POINTS = [("tiny", c) for c in (1, 16, 64)] + [("wide", c) for c in (1, 16, 64)]


def measure(
    command: list[str], address: str, model: str, concurrency: int, measure_s: float, logs: Path, label: str
) -> Row:
    """One perf_analyzer point: throughput and the client's latency percentiles (ms)."""
    args = ["-m", model, "-u", address, "-i", "grpc", "--concurrency-range", str(concurrency)]
    return perf_analyzer.point(command, args, measure_s, logs, f"perf-{label}-{model}-c{concurrency}")


def run(
    fngate_address: str,
    triton_address: str | None,
    measure_s: float,
    logs: Path,
    record: Callable[[Row], None],
    fngate_meter: Meter | None = None,
    triton_meter: Meter | None = None,
    fngate_model: Callable[[str], str] = str,
    extra: Row | None = None,
) -> None:
    """Each point on fngate, then on Triton; with a meter, each server's CPU and run-queue wait
    per inference too. `fngate_model` names the function that serves a model at fngate (its
    batching as Triton's); `extra` goes into every row (the batching delay of the comparison)."""
    command, why = perf_analyzer.provide()
    if not command:
        print(f"G  skipped: {why}", flush=True)
        return
    print(f"G  gRPC with perf_analyzer: fngate {fngate_address}, Triton {triton_address or '-'}", flush=True)
    for model, concurrency in POINTS:
        ours: Row = {"scenario": "G", "function": model, **(extra or {}), "body": "grpc"}
        ours["concurrency"] = concurrency
        served = fngate_model(model)
        ours.update(
            metered(
                fngate_meter,
                served,
                functools.partial(
                    measure, command, fngate_address, served, concurrency, measure_s, logs, "fngate"
                ),
            )
        )
        point = f"   {model} c={concurrency} over gRPC"
        if triton_address is not None:
            theirs: Row = {
                "scenario": "G",
                "function": f"{model}@triton",
                **(extra or {}),
                "body": "grpc",
                "concurrency": concurrency,
            }
            theirs.update(
                metered(
                    triton_meter,
                    model,
                    functools.partial(
                        measure, command, triton_address, model, concurrency, measure_s, logs, "triton"
                    ),
                )
            )
            if ours.get("req_per_s") and theirs.get("req_per_s"):
                ratio = ours["req_per_s"] / theirs["req_per_s"]
                ours["triton_ratio"] = ratio
                print(f"{point}: fngate/Triton throughput x{ratio:.2f}", flush=True)
            else:
                print(f"{point}: no ratio (a server failed: see its row)", flush=True)
            record(ours)
            record(theirs)
        else:
            record(ours)
