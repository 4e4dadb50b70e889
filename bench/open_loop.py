"""Scenario O: open-loop traffic, the way production traffic arrives. Triton's perf_analyzer sends
Poisson arrivals at fixed rates (`--request-rate-range`, `--request-distribution poisson`, enough
client threads to reach the rate) over HTTP, V2 with binary tensors, to fngate and, with --triton,
to the real Triton in the same run, rate by rate (fngate first at each rate), up to a rate above
what either server holds on two cores; a server is not driven past the first rate it could not
answer. For each server: the latency percentiles at each rate it reached, and the highest reached
rate whose p99 stays under 10 ms (the Triton guide's real-time target)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import perf_analyzer
from bench.deployment import Meter, metered

Row = dict[str, Any]
RATES = (500, 1000, 2000, 3000, 4000, 5000, 6000, 8000, 10000, 12000, 15000, 20000)
THREADS = 128
"""Client threads (each sends its next request once its last is answered): enough for 20,000 req/s
at 6 ms each."""
REACHED = 0.95
"""A rate counts as reached when the server answered at least this share of it."""
P99_TARGET_MS = 10.0


def measure(
    command: list[str], url: str, model: str, rate: int, measure_s: float, logs: Path, label: str
) -> Row:
    """One rate: what was answered per second and the client's latency percentiles (ms)."""
    args = ["-m", model, "-u", url, "-i", "http", "--request-rate-range", str(rate)]
    args += ["--request-distribution", "poisson", "--max-threads", str(THREADS)]
    row = perf_analyzer.point(command, args, measure_s, logs, f"open-{label}-{model}-r{rate}")
    if "req_per_s" in row:
        row["reached"] = row["req_per_s"] >= REACHED * rate
    return {"rate": rate, **row}


def still_driven(rows: list[Row]) -> bool:
    """Whether a server goes on to the next rate after these: not once it could not answer one (a
    point that failed says nothing of the server, and the ladder goes on)."""
    return not rows or rows[-1].get("reached") is not False


def best_rate(rows: list[Row]) -> int:
    """The highest rate reached with p99 under P99_TARGET_MS (0: none)."""
    held = [row["rate"] for row in rows if row.get("reached") and row.get("p99_ms", 1e9) < P99_TARGET_MS]
    return max(held, default=0)


def run(
    fngate_url: str,
    triton_url: str | None,
    measure_s: float,
    logs: Path,
    record: Callable[[Row], None],
    model: str = "tiny",
    meters: dict[str, Meter] | None = None,
    fngate_model: str | None = None,
    extra: Row | None = None,
) -> None:
    """Rate by rate, fngate then Triton; with `meters` (by label), each server's CPU and run-queue
    wait per inference too. `fngate_model`: the function that serves `model` at fngate (its
    batching as Triton's); `extra` goes into every row."""
    command, why = perf_analyzer.provide()
    if not command:
        print(f"O  skipped: {why}", flush=True)
        return
    print(f"O  open loop, Poisson arrivals ({model}, perf_analyzer over HTTP)", flush=True)
    servers = [("fngate", fngate_url)] + ([("triton", triton_url)] if triton_url else [])
    seen: dict[str, list[Row]] = {label: [] for label, _ in servers}
    for rate in RATES:
        for label, url in servers:
            if not still_driven(seen[label]):
                continue
            name = model if label == "fngate" else f"{model}@triton"
            served = (fngate_model or model) if label == "fngate" else model
            row: Row = {"scenario": "O", "function": name, **(extra or {}), "body": "binary"}
            row["concurrency"] = THREADS
            meter = (meters or {}).get(label)
            row.update(
                metered(
                    meter,
                    served,
                    functools.partial(measure, command, url, served, rate, measure_s, logs, label),
                )
            )
            row.setdefault("rate", rate)
            record(row)
            seen[label].append(row)
            print(
                f"   {label} at {rate} req/s: answered {row.get('req_per_s', 0):.0f}, "
                f"p50 {row.get('p50_ms', 0):.2f} ms, p99 {row.get('p99_ms', 0):.2f} ms",
                flush=True,
            )
    for label, rows in seen.items():
        best = best_rate(rows)
        name = model if label == "fngate" else f"{model}@triton"
        record(
            {
                "scenario": "O",
                "function": name,
                **(extra or {}),
                "body": "binary",
                "p99_under_10ms_req_per_s": best,
            }
        )
        print(f"   {label}: p99 under {P99_TARGET_MS:g} ms up to {best} req/s", flush=True)
