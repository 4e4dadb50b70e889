"""The benchmark's report: a markdown table against the targets, and a PNG plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

Row = dict[str, Any]

# (what, how to find the figure, comparison, target)
TARGETS: list[tuple[str, dict[str, Any], str, str, float]] = [
    (
        "tiny, c=1, p50 latency (ms)",
        {"scenario": "S1", "function": "tiny", "concurrency": 1, "body": "binary"},
        "p50_ms",
        "<=",
        0.8,
    ),
    (
        "tiny, c=16, throughput (req/s)",
        {"scenario": "S1", "function": "tiny", "concurrency": 16, "body": "binary"},
        "req_per_s",
        ">=",
        5000,
    ),
    (
        "wide, c=1, throughput (req/s)",
        {"scenario": "S2", "function": "wide", "concurrency": 1, "body": "binary"},
        "req_per_s",
        ">=",
        800,
    ),
    (
        "wide, c=64, throughput (req/s)",
        {"scenario": "S2", "function": "wide", "concurrency": 64, "body": "binary"},
        "req_per_s",
        ">=",
        3150,
    ),
    (
        "wide, c=64, p99 latency (ms)",
        {"scenario": "S2", "function": "wide", "concurrency": 64, "body": "binary"},
        "p99_ms",
        "<=",
        35,
    ),
    (
        "cache hit, p50 latency (ms)",
        {"scenario": "S3", "cache": "hit", "concurrency": 1},
        "p50_ms",
        "<=",
        0.5,
    ),
    (
        "cold start, request to answer (ms)",
        {"scenario": "S4", "function": "tiny"},
        "spawn_to_answer_ms",
        "<=",
        1500,
    ),
]


def find(rows: list[Row], where: dict[str, Any], metric: str) -> float | None:
    values = [row[metric] for row in rows if all(row.get(k) == v for k, v in where.items()) and metric in row]
    if not values:
        return None
    values.sort()
    return float(values[len(values) // 2])  # the median where a scenario ran several times


def write_report(out: Path, meta: dict[str, Any], rows: list[Row]) -> None:
    lines = [
        "# fngate benchmark",
        "",
        f"{meta['date']} on {meta['machine']}; Python {meta['python']}, onnxruntime {meta['onnxruntime']}, "
        f"fngate {meta['fngate']}; warm-up {meta['warmup_s']} s, measurement {meta['measure_s']} s "
        f"per point; the whole run took {meta['duration_s']} s.",
    ]
    lines += _targets(rows)
    lines += _against_triton(rows)
    lines += _large_cold_starts(rows)
    lines += _robustness(rows)
    lines += _hostile(rows)
    rows = [row for row in rows if row.get("scenario") not in (*ROBUSTNESS, "H")]
    rows = [row for row in rows if "p99_under_10ms_req_per_s" not in row]  # in the table above
    lines += ["", "## Every point", ""]
    columns = [
        "scenario",
        "function",
        "delay_us",
        "body",
        "cache",
        "concurrency",
        "batch",
        "gateways",
        "runners",
        "req_per_s",
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "errors",
        "checked",
        "cpu_us_gateway",
        "cpu_us_runner",
        "cpu_us_redis",
        "cpu_us_loadgen",
        "cpu_us_server",
        "wait_us_gateway",
        "wait_us_runner",
        "wait_us_redis",
        "wait_us_server",
        "round_trip_us",
        "cpu_us_per_round_trip",
        "runner",
        "status",
        "spawn_to_answer_ms",
        "limit_ms",
        "baseline_ms",
        "woken_at_ms",
        "imports_ms",
        "runner_up_at_ms",
        "download_ms",
        "model_load_ms",
        "loaded_at_ms",
    ]
    used = [column for column in columns if any(column in row for row in rows)]
    lines.append("| " + " | ".join(used) + " |")
    lines.append("| " + " | ".join("---" for _ in used) + " |")
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(column)) for column in used) + " |")
    lines += [
        "",
        "S4 phases, in ms after the request was sent: woken_at (the scaler heard the gateway's wake), "
        "runner_up_at (the runner process had started, imported and connected; imports_ms of it were "
        "imports), loaded_at (the model was loaded); spawn_to_answer is the whole cold start.",
        "",
        "cpu_us_*: CPU time per completed request of each kind of process during the measurement "
        "window (user + system, from /proc); for perf_analyzer's points (G, O), per inference the "
        "server's statistics counted over the whole perf_analyzer run, and cpu_us_loadgen is "
        "perf_analyzer's own. wait_us_*: time the process's threads were runnable but waited for "
        "a CPU, per request (from /proc/PID/task/*/schedstat).",
        "",
        "process wake (S0): two processes passing a byte back and forth over a Unix socket pair, "
        "pinned to one CPU or to two (bench/wake.py); round_trip_us is the wall time of a round trip, "
        "cpu_us_per_round_trip the CPU time of both processes for it. Each hop of an invocation "
        "between processes is such a wake.",
        "",
    ]
    (out / "results.md").write_text("\n".join(lines))


def _targets(rows: list[Row]) -> list[str]:
    """fngate's own targets (scenarios S1-S4), or a line saying that this run measured none."""
    found = [(what, find(rows, where, metric), sign, target) for what, where, metric, sign, target in TARGETS]
    if all(value is None for _, value, _, _ in found):
        return ["", "This run measured none of fngate's own targets (scenarios S1-S4 did not run)."]
    lines = [
        "",
        "## Against the targets",
        "",
        "| figure | fngate | target | met |",
        "| --- | ---: | ---: | :---: |",
    ]
    for what, value, sign, target in found:
        if value is None:
            lines.append(f"| {what} | not measured | {sign} {target} | |")
            continue
        met = value <= target if sign == "<=" else value >= target
        lines.append(f"| {what} | {value:.2f} | {sign} {target} | {'yes' if met else 'no'} |")
    return lines


TRITON = "@triton"
"""The suffix of a Triton point's function: `tiny@triton` is Triton's `tiny`."""


def pairs(rows: list[Row], scenario: str) -> list[tuple[Row, Row]]:
    """Each fngate point of `scenario` with Triton's point on the same load (the same model, body,
    concurrency and rate), in the order they ran."""

    def load(row: Row) -> tuple[Any, ...]:
        return (row.get("body"), row.get("concurrency"), row.get("rate"), row.get("delay_us"))

    found: list[tuple[Row, Row]] = []
    points = [row for row in rows if row.get("scenario") == scenario and "req_per_s" in row]
    for ours in points:
        if str(ours.get("function", "")).endswith(TRITON):
            continue
        theirs = next(
            (
                row
                for row in points
                if row.get("function") == f"{ours.get('function')}{TRITON}" and load(row) == load(ours)
            ),
            None,
        )
        if theirs is not None:
            found.append((ours, theirs))
    return found


def _against_triton(rows: list[Row]) -> list[str]:
    """T and G: fngate against Triton point by point, with the throughput ratio; O: the latency at
    each arrival rate, and the highest rate each held with p99 under 10 ms."""
    lines: list[str] = []
    closed = closed_pairs(rows)
    if closed:
        lines += [
            "",
            "## Against Triton, in the same run (closed loop)",
            "",
            "Like for like: both servers batch the same model with the same max_batch_size and the "
            "same max_queue_delay_us (the delay column) under the same load.",
            "",
            "| protocol | model | concurrency | delay µs | fngate req/s | Triton req/s | fngate/Triton "
            "| fngate p50 / p99 ms | Triton p50 / p99 ms | server CPU µs/req, fngate / Triton |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for protocol, (ours, theirs) in closed:
            ratio = ours["req_per_s"] / max(theirs["req_per_s"], 1e-9)
            lines.append(
                f"| {protocol} | {ours['function']} | {ours['concurrency']} | "
                f"{_cell(ours.get('delay_us'))} | "
                f"{ours['req_per_s']:.0f} | {theirs['req_per_s']:.0f} | {ratio:.2f} | {_latency(ours)} | "
                f"{_latency(theirs)} | {_per_request(ours, theirs, 'cpu_us')} |"
            )
        lines += _at_best(closed)
    open_loop = _open_loop(rows)
    if open_loop:
        lines += [
            "",
            "## Against Triton, in the same run (open loop: Poisson arrivals, O)",
            "",
            "| delay µs | rate (req/s) | fngate answered | fngate p50 / p99 ms | Triton answered "
            "| Triton p50 / p99 ms | server CPU µs/req, fngate / Triton "
            "| run-queue wait µs/req, fngate / Triton |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for delay, rate, at_fngate, at_triton in open_loop:
            lines.append(
                f"| {_cell(delay)} | {rate} | {_answered(at_fngate)} | {_answered(at_triton)} | "
                f"{_per_request(at_fngate, at_triton, 'cpu_us')} | "
                f"{_per_request(at_fngate, at_triton, 'wait_us')} |"
            )
        if any(at_fngate is None or at_triton is None for _, _, at_fngate, at_triton in open_loop):
            lines += [
                "",
                "—: not driven at that rate, since the server could not answer a lower one (or the "
                "point failed; see `results.json`).",
            ]
        best = {
            (str(row["function"]), row.get("delay_us")): row["p99_under_10ms_req_per_s"]
            for row in rows
            if row.get("scenario") == "O" and "p99_under_10ms_req_per_s" in row
        }
        if best:
            held = ", ".join(
                f"{'Triton' if name.endswith(TRITON) else 'fngate'} up to {rate} req/s"
                + ("" if delay is None else f" (delay {delay} µs)")
                for (name, delay), rate in best.items()
            )
            lines += ["", f"The highest rate reached with p99 under 10 ms: {held}."]
    return lines


def closed_pairs(rows: list[Row]) -> list[tuple[str, tuple[Row, Row]]]:
    """Every closed-loop point beside Triton's at the same load and delay, by protocol."""
    closed = [("HTTP, V2 JSON (T)", pair) for pair in pairs(rows, "T")]
    closed += [("gRPC, perf_analyzer (G)", pair) for pair in pairs(rows, "G")]
    closed += [("HTTP, binary, perf_analyzer (B)", pair) for pair in pairs(rows, "B")]
    return closed


def at_better_delay(
    closed: list[tuple[str, tuple[Row, Row]]],
) -> dict[tuple[str, Any, Any], tuple[Row, Row]]:
    """(protocol, model, concurrency): fngate's point and Triton's, each at its own better delay."""
    best: dict[tuple[str, Any, Any], list[Row]] = {}
    for protocol, (ours, theirs) in closed:
        found = best.setdefault((protocol, ours["function"], ours["concurrency"]), [ours, theirs])
        for index, row in enumerate((ours, theirs)):
            if row["req_per_s"] > found[index]["req_per_s"]:
                found[index] = row
    return {key: (ours, theirs) for key, (ours, theirs) in best.items()}


def _at_best(closed: list[tuple[str, tuple[Row, Row]]]) -> list[str]:
    """Each server at its better delay, point by point: the ratio a user gets who tunes both."""
    if len({ours.get("delay_us") for _, (ours, _) in closed}) < 2:
        return []
    lines = [
        "",
        "Each server at its better delay:",
        "",
        "| protocol | model | concurrency | fngate req/s (delay µs) | Triton req/s (delay µs) "
        "| fngate/Triton |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for (protocol, model, concurrency), (ours, theirs) in at_better_delay(closed).items():
        ratio = ours["req_per_s"] / max(theirs["req_per_s"], 1e-9)
        lines.append(
            f"| {protocol} | {model} | {concurrency} | {ours['req_per_s']:.0f} ({ours.get('delay_us')}) | "
            f"{theirs['req_per_s']:.0f} ({theirs.get('delay_us')}) | {ratio:.2f} |"
        )
    return lines


def _open_loop(rows: list[Row]) -> list[tuple[Any, int, Row | None, Row | None]]:
    """O's points by batching delay and rate, fngate's and Triton's (None where a server was not
    driven at that rate, or its point failed); empty unless Triton ran."""
    points = [row for row in rows if row.get("scenario") == "O" and "rate" in row]
    by_server: dict[tuple[bool, Any, int], Row] = {}
    for row in points:
        if "req_per_s" in row:
            triton = str(row.get("function", "")).endswith(TRITON)
            by_server[(triton, row.get("delay_us"), row["rate"])] = row
    if not any(triton for triton, _, _ in by_server):
        return []
    loads = sorted(
        {(row.get("delay_us"), row["rate"]) for row in points}, key=lambda load: (load[0] or 0, load[1])
    )
    return [
        (delay, rate, by_server.get((False, delay, rate)), by_server.get((True, delay, rate)))
        for delay, rate in loads
    ]


def _answered(row: Row | None) -> str:
    """A server's cells of the open-loop table: what it answered per second, and its latency."""
    return "— | —" if row is None else f"{row['req_per_s']:.0f} | {_latency(row)}"


SERVER_KINDS = ("gateway", "runner", "redis", "server")
"""fngate's kinds of process, and Triton's one server."""


def _server_total(row: Row, measure: str) -> float | None:
    """`measure` (cpu_us or wait_us) summed over the server's processes; None when not measured."""
    found = [row[key] for kind in SERVER_KINDS if (key := f"{measure}_{kind}") in row]
    return sum(found) if found else None


def _per_request(ours: Row | None, theirs: Row | None, measure: str) -> str:
    both = [None if row is None else _server_total(row, measure) for row in (ours, theirs)]
    return " / ".join("—" if value is None else f"{value:.0f}" for value in both)


def _latency(row: Row) -> str:
    return f"{row.get('p50_ms', math.nan):.2f} / {row.get('p99_ms', math.nan):.2f}"


def _hostile(rows: list[Row]) -> list[str]:
    """H: what each hostile probe was answered, and what it cost the gateway."""
    probes = [row for row in rows if row.get("scenario") == "H"]
    if not probes:
        return []
    lines = [
        "",
        "## Hostile callers (H)",
        "",
        "| server | probe | answer | time (s) | peak RSS added (MiB) | worker's peak RSS (MiB) |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for row in probes:
        lines.append(
            f"| {row.get('server', '')} | {row.get('probe', '')} | {row.get('status', '')} | "
            f"{_cell(row.get('time_s'))} | {_cell(row.get('peak_mib'))} | "
            f"{_cell(row.get('worker_peak_mib'))} |"
        )
    return lines


def _large_cold_starts(rows: list[Row]) -> list[str]:
    """S4 with --large-model: each cold start against its limit, measured in the same run."""
    large = [row for row in rows if row.get("scenario") == "S4" and row.get("function") == "large"]
    if not large:
        return []
    lines = [
        "",
        "## Cold starts of a large model (268 MB, from S3), against limits measured in the same run",
        "",
        "| runner | artifact cache | attempt | status | request to answer (ms) | limit (ms) | base (ms) "
        "| met |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for row in large:
        met = row["status"] == 200 and row["spawn_to_answer_ms"] <= row["limit_ms"]
        lines.append(
            f"| {row.get('runner', '')} | {row['cache']} | {row['attempt']} | {row['status']} | "
            f"{row['spawn_to_answer_ms']:.0f} | {row['limit_ms']:.0f} | {row['baseline_ms']:.0f} | "
            f"{'yes' if met else 'no'} |"
        )
    lines += [
        "",
        "Limits: empty cache, the plain boto3 download_file of the model + 400 ms; on disk, onnxruntime's "
        "InferenceSession of the local file + 250 ms (both measured alone, before the cold starts). "
        "Runner: started on demand by the scaler, or the standby runner that `fngate up` keeps by default.",
    ]
    return lines


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.2f}" if value < 100 else f"{value:.0f}"
    return str(value)


ROBUSTNESS = ("P", "M", "M-quota")
"""Scenarios with tables of their own (bench/poison.py, bench/soak.py)."""


def _robustness(rows: list[dict[str, Any]]) -> list[str]:
    """P: what a poison in a batch costs its innocents; M: Redis's memory under the mixed soak."""
    lines: list[str] = []
    poison = [row for row in rows if row.get("scenario") == "P"]
    if poison:
        lines += [
            "",
            "## A poison invocation among fifteen innocents in one batch (P)",
            "",
            "| round | innocents answered | failed | p50 ms | max ms | extra p50 ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        columns = ("round", "innocents_ok", "innocents_failed", "innocent_p50_ms", "innocent_max_ms")
        lines += [
            "| " + " | ".join(str(row[key]) for key in (*columns, "extra_p50_ms")) + " |" for row in poison
        ]
    for row in rows:
        if row.get("scenario") == "M":
            samples = ", ".join(f"{at:.0f} s: {mib} MiB" for at, mib in row["samples_mib"])
            lines += [
                "",
                "## Redis's memory under a mixed soak (M)",
                "",
                f"{row['seconds']:.0f} s, {row['invocations_per_s']} invocations a second "
                f"({row['async_per_s']} asynchronous), {row['failed']} failed. used_memory: {samples}. "
                f"Growth {row['growth_mb_per_min']} MB a minute after the first sample, "
                f"{row['bytes_in_redis_per_result']} B a result ({row['stored_result_bytes']} B stored): "
                f"{row['growth_at_103_async_per_s_mb_per_min']} MB a minute at 103 asynchronous a second.",
            ]
        if row.get("scenario") == "M-quota":
            lines += [
                "",
                f"Past a 256 KiB result quota: {row['accepted']} accepted, {row['refused_429']} refused "
                f"(429), {row['lost']} accepted and not answered.",
            ]
    return lines
