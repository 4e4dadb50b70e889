"""The benchmark's report (bench/report.py): what a reader of results.md compares fngate with Triton
by, the hostile probes' answers and costs, from the rows a run recorded; and the wake probe of its
floors (bench/wake.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import wake
from bench.deployment import Meter, process_meter, runqueue_waits
from bench.open_loop import still_driven
from bench.plot import against_triton_series, draw
from bench.report import pairs, write_report

META = {
    "date": "2026-12-03T00:00:00+00:00",
    "machine": "x86_64, a CPU, 2 cores",
    "python": "3.11",
    "fngate": "0.1.0",
    "onnxruntime": "1",
    "duration_s": 1.0,
    "warmup_s": 1.0,
    "measure_s": 4.0,
}


def point(
    scenario: str, function: str, body: str, concurrency: int, req_per_s: float, **more: Any
) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "function": function,
        "body": body,
        "concurrency": concurrency,
        "req_per_s": req_per_s,
        "p50_ms": 1.0,
        "p99_ms": 2.0,
        **more,
    }


def test_each_fngate_point_meets_tritons_on_the_same_load() -> None:
    rows = [
        point("G", "tiny", "grpc", 16, 2000),
        point("G", "tiny@triton", "grpc", 16, 4000),
        point("G", "tiny", "grpc", 64, 3000),  # Triton's c=64 failed: no pair
        point("G", "tiny@triton", "grpc", 1, 300),
        point("O", "tiny", "binary", 32, 990, rate=1000),
        point("O", "tiny@triton", "binary", 32, 480, rate=500),
        point("O", "tiny@triton", "binary", 32, 1000, rate=1000),
    ]
    found = [
        (ours["concurrency"], ours.get("rate"), theirs["req_per_s"]) for ours, theirs in pairs(rows, "G")
    ]
    assert found == [(16, None, 4000)]
    assert [(ours["rate"], theirs["req_per_s"]) for ours, theirs in pairs(rows, "O")] == [(1000, 1000)]


def test_the_report_shows_the_ratios_the_best_rates_and_the_hostile_probes(tmp_path: Path) -> None:
    rows = [
        point("T", "tiny", "json", 16, 4100, delay_us=0),
        point("T", "tiny@triton", "json", 16, 4827, delay_us=0),
        point("G", "wide", "grpc", 64, 2493),
        point("G", "wide@triton", "grpc", 64, 4292),
        point("B", "tiny", "binary", 16, 3000),
        point("B", "tiny@triton", "binary", 16, 6000),
        point("O", "tiny", "binary", 32, 1006, rate=1000),
        point("O", "tiny@triton", "binary", 32, 1006, rate=1000),
        {"scenario": "O", "function": "tiny", "body": "binary", "p99_under_10ms_req_per_s": 1000},
        {"scenario": "O", "function": "tiny@triton", "body": "binary", "p99_under_10ms_req_per_s": 5000},
        {"scenario": "H", "server": "grpc", "probe": "gRPC 400 PINGs", "status": "GOAWAY ENHANCE_YOUR_CALM",
         "time_s": 0.009, "peak_mib": 0.0, "worker_peak_mib": 131.0},
    ]  # fmt: skip
    write_report(tmp_path, META, rows)
    text = (tmp_path / "results.md").read_text()
    assert "| HTTP, V2 JSON (T) | tiny | 16 | 0 | 4100 | 4827 | 0.85 |" in text
    assert "| gRPC, perf_analyzer (G) | wide | 64 |  | 2493 | 4292 | 0.58 |" in text
    assert "| HTTP, binary, perf_analyzer (B) | tiny | 16 |  | 3000 | 6000 | 0.50 |" in text
    assert "| 1000 | 1006 | 1.00 / 2.00 | 1006 | 1.00 / 2.00 |" in text
    assert "fngate up to 1000 req/s, Triton up to 5000 req/s" in text
    assert "| grpc | gRPC 400 PINGs | GOAWAY ENHANCE_YOUR_CALM | 0.01 | 0.00 | 131 |" in text
    every_point = text.split("## Every point", 1)[1]
    assert "p99_under" not in every_point and "PINGs" not in every_point


def test_the_tables_against_triton_show_each_servers_cost_per_request(tmp_path: Path) -> None:
    fngate = {"cpu_us_gateway": 300.0, "cpu_us_runner": 120.0, "cpu_us_redis": 80.0, "cpu_us_loadgen": 60.0}
    waits = {"wait_us_gateway": 200.0, "wait_us_runner": 90.0, "wait_us_redis": 10.0}
    rows = [
        point("G", "tiny", "grpc", 16, 2000, **fngate),
        point("G", "tiny@triton", "grpc", 16, 4000, cpu_us_server=110.0),
        point("O", "tiny", "binary", 32, 1000, rate=1000, **fngate, **waits),
        point("O", "tiny@triton", "binary", 32, 1000, rate=1000, cpu_us_server=700.0, wait_us_server=40.0),
        point("O", "tiny", "binary", 32, 2000, rate=2000),  # not measured: shown as such
        point("O", "tiny@triton", "binary", 32, 2000, rate=2000),
    ]
    write_report(tmp_path, META, rows)
    text = (tmp_path / "results.md").read_text()
    assert (
        "| gRPC, perf_analyzer (G) | tiny | 16 |  | 2000 | 4000 | 0.50 | 1.00 / 2.00 | 1.00 / 2.00 "
        "| 500 / 110 |" in text
    )
    assert "| 1000 | 1000 | 1.00 / 2.00 | 1000 | 1.00 / 2.00 | 500 / 700 | 300 / 40 |" in text
    assert "| 2000 | 2000 | 1.00 / 2.00 | 2000 | 1.00 / 2.00 | — / — | — / — |" in text


def test_the_open_loop_table_goes_on_with_the_server_that_still_answers(tmp_path: Path) -> None:
    """fngate stopped being driven after a rate it could not answer; Triton's higher rates still
    show, beside an empty cell."""
    rows = [
        point("O", "tiny", "binary", 64, 5980, rate=6000, reached=True),
        point("O", "tiny@triton", "binary", 64, 6010, rate=6000, reached=True),
        point("O", "tiny", "binary", 64, 6100, rate=8000, reached=False),
        point("O", "tiny@triton", "binary", 64, 8020, rate=8000, reached=True),
        point("O", "tiny@triton", "binary", 64, 10010, rate=10000, reached=True),
    ]
    write_report(tmp_path, META, rows)
    text = (tmp_path / "results.md").read_text()
    assert "| 8000 | 6100 | 1.00 / 2.00 | 8020 | 1.00 / 2.00 |" in text
    assert "| 10000 | — | — | 10010 | 1.00 / 2.00 | — / — | — / — |" in text
    assert "—: not driven at that rate" in text


def test_the_open_loop_ladder_stops_a_server_only_at_a_rate_it_could_not_answer() -> None:
    assert still_driven([])
    assert still_driven([{"rate": 500, "req_per_s": 497, "reached": True}])
    assert still_driven([{"rate": 500, "errors": 1}])  # perf_analyzer failed: try the next rate
    assert not still_driven([{"rate": 8000, "req_per_s": 7000, "reached": False}])


def test_the_targets_table_shows_only_when_a_point_of_it_ran(tmp_path: Path) -> None:
    """A run beside Triton alone (T, G, O) measures none of fngate's own targets: one line says so
    instead of a table of "not measured"; a run with S1 shows the table, with what it missed."""
    write_report(tmp_path, META, [point("T", "tiny", "json", 16, 4100)])
    text = (tmp_path / "results.md").read_text()
    assert "## Against the targets" not in text
    assert "measured none of fngate's own targets" in text
    write_report(tmp_path, META, [point("S1", "tiny", "binary", 16, 4100)])
    text = (tmp_path / "results.md").read_text()
    assert "| tiny, c=16, throughput (req/s) | 4100.00 | >= 5000 | no |" in text
    assert "| cold start, request to answer (ms) | not measured | <= 1500 | |" in text


def test_a_meter_divides_what_the_server_used_by_the_inferences_it_counted() -> None:
    """The server's CPU and wait per inference, and the client's CPU (a child process, reaped)."""
    counted = iter([1_000, 1_400])
    used = iter([{"gateway": 1.0}, {"gateway": 1.2}])
    # By thread: 11 waited 0.03 s more, 12 started meanwhile and waited 0.01 s, 13 ended (and with
    # it what it had waited): 0.04 s, never less than nothing.
    waits = iter([{"gateway": {11: 0.5, 13: 0.9}}, {"gateway": {11: 0.53, 12: 0.01}}])
    meter = Meter(cpu=lambda: next(used), waits=lambda: next(waits), served=lambda _model: next(counted))

    def client() -> dict[str, Any]:
        subprocess.run([sys.executable, "-c", "sum(range(3_000_000))"], check=True)
        return {"req_per_s": 100.0}

    row = meter.around("tiny", client)
    assert row["req_per_s"] == 100.0
    assert abs(row["cpu_us_gateway"] - 500.0) < 1e-6  # 0.2 s over 400 inferences
    assert abs(row["wait_us_gateway"] - 100.0) < 1e-6
    assert row["cpu_us_loadgen"] > 0  # the child's CPU time, counted once it was reaped


def test_the_run_queue_wait_counts_the_time_a_process_waited_for_a_busy_cpu() -> None:
    """Two busy processes on one CPU: each waits for the other about half the time."""
    cpu = min(os.sched_getaffinity(0))
    spin = "\n".join(
        [
            "import os, time",
            f"os.sched_setaffinity(0, {{{cpu}}})",
            "end = time.time() + 0.6",
            "while time.time() < end: pass",
        ]
    )
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        time.sleep(0.5)
        waited = [sum(runqueue_waits(process.pid).values()) for process in busy]
        meter = process_meter(busy[0].pid, "http://127.0.0.1:1")
        assert sum(meter.waits()["server"].values()) >= waited[0]
    finally:
        for process in busy:
            process.wait()
    assert sum(waited) > 0.1, waited


def test_the_wake_probe_leaves_its_caller_unpinned_and_its_child_reaped() -> None:
    """The bench goes on after it: on every CPU it had, with no echo process left behind."""
    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    figures = wake.measure((cpus[0], cpus[-1]), round_trips=200)
    assert os.sched_getaffinity(0) == before
    assert set(figures) == {"round_trip_us", "cpu_us_per_round_trip"}
    assert all(value > 0 for value in figures.values()), figures
    assert forks_of_this_process() == []  # the echo was reaped


def forks_of_this_process() -> list[int]:
    """Children of this process that run what it runs (forked, not started from a program)."""
    ours = Path("/proc/self/cmdline").read_bytes()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == os.getpid() and (entry / "cmdline").read_bytes() == ours:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_each_point_is_like_for_like_and_each_server_at_its_better_delay(tmp_path: Path) -> None:
    """Points at two batching delays: each pairs with Triton's at the same delay (never across
    delays), and a second table sets each server's better delay against the other's."""
    rows = [
        point("T", "tiny", "json", 16, 3651, delay_us=0),
        point("T", "tiny@triton", "json", 16, 9282, delay_us=0),
        point("T", "tiny", "json", 16, 3609, delay_us=2000),
        point("T", "tiny@triton", "json", 16, 5212, delay_us=2000),
        point("O", "tiny", "binary", 128, 1000, rate=1000, delay_us=0),
        point("O", "tiny@triton", "binary", 128, 1000, rate=1000, delay_us=0),
        point("O", "tiny", "binary", 128, 990, rate=1000, delay_us=2000),
        point("O", "tiny@triton", "binary", 128, 1000, rate=1000, delay_us=2000),
    ]
    assert [(ours["req_per_s"], theirs["req_per_s"]) for ours, theirs in pairs(rows, "T")] == [
        (3651, 9282),
        (3609, 5212),
    ]
    write_report(tmp_path, META, rows)
    text = (tmp_path / "results.md").read_text()
    assert "| HTTP, V2 JSON (T) | tiny | 16 | 0 | 3651 | 9282 | 0.39 |" in text
    assert "| HTTP, V2 JSON (T) | tiny | 16 | 2000 | 3609 | 5212 | 0.69 |" in text
    assert "| HTTP, V2 JSON (T) | tiny | 16 | 3651 (0) | 9282 (0) | 0.39 |" in text
    assert "| 0 | 1000 | 1000 |" in text and "| 2000 | 1000 | 990 |" in text


def test_a_run_beside_triton_alone_plots_each_server_at_its_better_delay(tmp_path: Path) -> None:
    """A run of the Triton scenarios (no fngate-only scenario) plots what it measured, not an
    empty chart: each server's throughput at its better delay, and their ratio, by clients."""
    rows = [
        point("T", "tiny", "json", 1, 700, delay_us=0),
        point("T", "tiny@triton", "json", 1, 1500, delay_us=0),
        point("T", "tiny", "json", 1, 730, delay_us=2000),
        point("T", "tiny@triton", "json", 1, 380, delay_us=2000),
        point("T", "tiny", "json", 16, 2200, delay_us=0),
        point("T", "tiny@triton", "json", 16, 4400, delay_us=0),
        point("T", "tiny", "json", 16, 2100, delay_us=2000),
        point("T", "tiny@triton", "json", 16, 4500, delay_us=2000),
        point("G", "tiny", "grpc", 16, 2700, delay_us=0),
        point("G", "tiny@triton", "grpc", 16, 7100, delay_us=0),
    ]
    assert against_triton_series(rows) == {
        "tiny, HTTP, V2 JSON (T)": [(1, 730.0, 1500.0), (16, 2200.0, 4500.0)],
        "tiny, gRPC, perf_analyzer (G)": [(16, 2700.0, 7100.0)],
    }
    draw(tmp_path / "throughput.png", rows)
    empty = tmp_path / "empty"
    empty.mkdir()
    draw(empty / "throughput.png", [point("O", "tiny", "binary", 128, 1000, rate=1000, delay_us=0)])
    # The plot holds the lines: larger than the empty chart a run without them draws.
    assert (tmp_path / "throughput.png").stat().st_size > (empty / "throughput.png").stat().st_size + 5_000
