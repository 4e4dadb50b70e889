"""Scenarios G and B: the Open Inference Protocol driven by Triton's own perf_analyzer (closed loop
at a fixed concurrency, binary tensors) over gRPC (G, `-i grpc`) or over HTTP (B, `-i http`: V2
with the binary tensor extension), against fngate and, with --triton, against the real Triton in
the same run, point by point. fngate's HTTP path with JSON bodies and this bench's own load
generator is scenario T."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import perf_analyzer
from bench.deployment import Meter, metered

Row = dict[str, Any]
POINTS = [("tiny", c) for c in (1, 16, 64)] + [("wide", c) for c in (1, 16, 64)]


PROTOCOLS = {"G": ("grpc", "gRPC"), "B": ("http", "HTTP, binary tensors")}
"""Scenario -> perf_analyzer's protocol (-i) and how the output names it."""


def measure(
    command: list[str],
    address: str,
    model: str,
    concurrency: int,
    measure_s: float,
    logs: Path,
    label: str,
    protocol: str = "grpc",
) -> Row:
    """One perf_analyzer point: throughput and the client's latency percentiles (ms)."""
    args = ["-m", model, "-u", address, "-i", protocol, "--concurrency-range", str(concurrency)]
    name = f"perf-{label}-{protocol}-{model}-c{concurrency}"
    return perf_analyzer.point(command, args, measure_s, logs, name)


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
    scenario: str = "G",
) -> None:
    """Each point on fngate, then on Triton; with a meter, each server's CPU and run-queue wait
    per inference too. `fngate_model` names the function that serves a model at fngate (its
    batching as Triton's); `extra` goes into every row (the batching delay of the comparison);
    `scenario`: G (gRPC) or B (HTTP), the addresses being that protocol's."""
    protocol, shown = PROTOCOLS[scenario]
    body = "grpc" if protocol == "grpc" else "binary"
    command, why = perf_analyzer.provide()
    if not command:
        print(f"{scenario}  skipped: {why}", flush=True)
        return
    print(
        f"{scenario}  {shown} with perf_analyzer: fngate {fngate_address}, Triton {triton_address or '-'}",
        flush=True,
    )
    for model, concurrency in POINTS:
        ours: Row = {"scenario": scenario, "function": model, **(extra or {}), "body": body}
        ours["concurrency"] = concurrency
        served = fngate_model(model)
        ours.update(
            metered(
                fngate_meter,
                served,
                functools.partial(
                    measure, command, fngate_address, served, concurrency, measure_s, logs, "fngate", protocol
                ),
            )
        )
        point = f"   {model} c={concurrency} over {shown}"
        if triton_address is not None:
            theirs: Row = {
                "scenario": scenario,
                "function": f"{model}@triton",
                **(extra or {}),
                "body": body,
                "concurrency": concurrency,
            }
            theirs.update(
                metered(
                    triton_meter,
                    model,
                    functools.partial(
                        measure,
                        command,
                        triton_address,
                        model,
                        concurrency,
                        measure_s,
                        logs,
                        "triton",
                        protocol,
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
