"""`python -m bench`: start fngate on this machine, drive it, and compare with in-process onnxruntime.

Prints a table as it goes, and writes results.json, results.md and a PNG plot to --out."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import orjson
import redis

import fngate
from bench import cluster as cluster_scenario
from bench import grpc_peer, inprocess, loadgen, wake
from bench import open_loop as bench_open_loop
from bench.deployment import (
    Deployment,
    Meter,
    cpu_seconds,
    deployment,
    free_port,
    process_meter,
)
from bench.models import PEER_DELAYS_US, build_repository, peer_function, write_poison_functions
from bench.poison import poison_rounds
from bench.soak import SOAK_S, soak
from fngate import keys

Row = dict[str, Any]


def requests_for(
    function: str, features: int, count: int, binary: bool, seed: int, output: str = "output"
) -> tuple[list[loadgen.Outgoing], np.ndarray]:
    """`count` requests of one row each, every one with distinct random input."""
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal((count, 1, features), dtype=np.float32)
    path = f"/v2/models/{function}/infer"
    out = []
    for x in inputs:
        if binary:
            header = orjson.dumps(
                {
                    "inputs": [
                        {
                            "name": "input",
                            "datatype": "FP32",
                            "shape": [1, features],
                            "parameters": {"binary_data_size": x.nbytes},
                        }
                    ],
                    "outputs": [{"name": output, "parameters": {"binary_data": True}}],
                }
            )
            out.append(
                loadgen.Outgoing(
                    path, header + x.tobytes(), (("inference-header-content-length", str(len(header))),)
                )
            )
        else:
            body = orjson.dumps(
                {
                    "inputs": [
                        {
                            "name": "input",
                            "datatype": "FP32",
                            "shape": [1, features],
                            "data": x.ravel().tolist(),
                        }
                    ]
                }
            )
            out.append(loadgen.Outgoing(path, body))
    return out, inputs


def output_of(body: bytes, features: int) -> np.ndarray:
    if body[:1] == b"{" and b'"data"' in body:
        doc = orjson.loads(body)
        return np.asarray(doc["outputs"][0]["data"], dtype=np.float32).reshape(1, features)
    # binary: the JSON header is followed by the raw output
    return np.frombuffer(body[-features * 4 :], dtype=np.float32).reshape(1, features)


def checker(
    inputs: np.ndarray, features: int, reference: Callable[[np.ndarray], np.ndarray]
) -> Callable[..., str | None]:
    def check(index: int, _status: int, body: bytes) -> str | None:
        got = output_of(body, features)
        want = reference(inputs[index])
        if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
            return f"request {index}: wrong output"
        return None

    return check


class Bench:
    def __init__(self, args: argparse.Namespace, repo: Path, logs: Path) -> None:
        self.args = args
        self.repo = repo
        self.logs = logs
        self.rows: list[Row] = []
        self.sessions = {name: inprocess.session(repo / name / "model.onnx", 1) for name in ("tiny", "wide")}

    def reference(self, name: str) -> Callable[[np.ndarray], np.ndarray]:
        session = self.sessions[name]
        return lambda x: session.run(None, {"input": x})[0]

    def record(self, row: Row) -> None:
        self.rows.append(row)
        parts = [
            f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
            for key, value in row.items()
        ]
        print("  " + " ".join(parts), flush=True)

    def drive(
        self,
        deployed: Deployment,
        scenario: str,
        function: str,
        model: str,
        features: int,
        concurrency: int,
        binary: bool,
        gateways: list[str] | None = None,
    ) -> Row:
        requests, inputs = requests_for(function, features, 20_000, binary, seed=concurrency)
        body = {"body": "binary" if binary else "json"}
        return self.drive_requests(
            deployed, scenario, function, model, features, concurrency, requests, inputs, gateways, body
        )

    def drive_requests(
        self,
        deployed: Deployment,
        scenario: str,
        function: str,
        model: str,
        features: int,
        concurrency: int,
        requests: list[loadgen.Outgoing],
        inputs: np.ndarray,
        gateways: list[str] | None = None,
        extra: dict[str, Any] | None = None,
        cycle: bool = False,
    ) -> Row:
        """Drive with these requests: each used once, or over and over with `cycle` (cache hits)."""
        urls = gateways or deployed.urls()[:1]
        check = checker(inputs, features, self.reference(model))
        meter = deployed.meter()
        since, loadgen_before = meter.read(), _own_cpu()
        limit = 200_000 if cycle else len(requests)

        async def drive_all() -> list[loadgen.Result]:
            share = max(1, concurrency // len(urls))
            return await asyncio.gather(
                *(
                    loadgen.run(
                        "127.0.0.1",
                        int(url.rsplit(":", 1)[1]),
                        requests,
                        share,
                        self.args.warmup_s,
                        self.args.measure_s,
                        check,
                        max_requests=limit,
                    )
                    for url in urls
                )
            )

        results = asyncio.run(drive_all())
        loadgen_s = _own_cpu() - loadgen_before
        completed = sum(result.completed for result in results)
        latencies = np.concatenate([result.latencies_ns for result in results]) / 1e6
        row: Row = {
            "scenario": scenario,
            "function": function,
            **(extra or {}),
            "concurrency": concurrency,
            "gateways": len(urls),
            "runners": len(deployed.runners),
            "req_per_s": sum(result.throughput for result in results),
            "p50_ms": float(np.percentile(latencies, 50)) if completed else float("nan"),
            "p90_ms": float(np.percentile(latencies, 90)) if completed else float("nan"),
            "p99_ms": float(np.percentile(latencies, 99)) if completed else float("nan"),
            "errors": sum(result.errors for result in results),
            "checked": sum(result.checked for result in results),
        }
        row.update(meter.per_request(since, completed))
        row["cpu_us_loadgen"] = loadgen_s / max(completed, 1) * 1e6  # the load generator is this process
        samples = [result.error_sample for result in results if result.error_sample]
        if samples:
            row["error_sample"] = samples[0][:120]
        self.record(row)
        return row

    def in_process(self) -> None:
        print("in-process onnxruntime (1 intra-op thread, as the runner)", flush=True)
        for name, features, batches in (("tiny", 16, (1, 16)), ("wide", 512, (1, 16, 64))):
            for batch in batches:
                figures = inprocess.measure(
                    self.repo / name / "model.onnx", features, batch, 1, self.args.measure_s
                )
                self.record(
                    {
                        "scenario": "in-process",
                        "function": name,
                        "batch": batch,
                        "req_per_s": figures["rows_per_s"],
                        "p50_ms": figures["p50_ms"],
                        "p99_ms": figures["p99_ms"],
                    }
                )

    def http_floor(self, deployed: Deployment) -> None:
        print("S0 the floors: a process waking another, on one CPU and across two", flush=True)
        for where, figures in wake.both().items():
            self.record({"scenario": "S0", "function": f"process wake, {where}", **figures})
            print(
                f"   {where}: {figures['round_trip_us']:.1f} µs a round trip, "
                f"{figures['cpu_us_per_round_trip']:.1f} µs of CPU",
                flush=True,
            )
        print("S0 HTTP floor: a fixed answer from a plain ASGI app on each server, no fngate", flush=True)
        for server_name in ("uvicorn", "hypercorn"):
            sock = socket.create_server(("127.0.0.1", 0), backlog=4096)
            port = sock.getsockname()[1]
            server = subprocess.Popen(
                [sys.executable, "-m", "bench.floor", f"fd://{sock.fileno()}", server_name],
                pass_fds=[sock.fileno()],
            )
            sock.close()
            try:
                wait_live(f"http://127.0.0.1:{port}", path="/v2/models/floor/infer", method="POST")
                requests, _inputs = requests_for("tiny", 16, 2000, True, seed=5)
                for concurrency in (1, 16):
                    before = cpu_seconds(server.pid)
                    result = asyncio.run(
                        loadgen.run(
                            "127.0.0.1", port, requests, concurrency, self.args.warmup_s, self.args.measure_s
                        )
                    )
                    used = cpu_seconds(server.pid) - before
                    self.record(
                        {
                            "scenario": "S0",
                            "function": f"http-floor-{server_name}",
                            "body": "binary",
                            "concurrency": concurrency,
                            "req_per_s": result.throughput,
                            "p50_ms": result.percentile_ms(50),
                            "p99_ms": result.percentile_ms(99),
                            "errors": result.errors,
                            "cpu_us_gateway": used / max(result.completed, 1) * 1e6,
                        }
                    )
            finally:
                server.terminate()
                server.wait()
        del deployed

    def peer(
        self,
        deployed: Deployment,
        serve_sh: Path,
        http: bool = True,
        grpc: bool = True,
        open_loop: bool = False,
        binary: bool = False,
    ) -> None:
        """fngate beside the real Triton server on the same models, the same batching (max 32 rows,
        the same max_queue_delay_us) and the same load, point by point (each fngate point right
        before the same Triton point, so that drift hits both alike), at each of the delays
        (--peer-delays): over HTTP with this bench's load generator and JSON bodies (T), over gRPC
        with perf_analyzer (G), over HTTP with perf_analyzer and binary tensors (B), and open-loop
        Poisson arrivals with perf_analyzer (O). The report gives
        each point like for like and each server at its better delay."""
        models = self.logs / "triton-models"
        models.mkdir(parents=True, exist_ok=True)
        for name, output in (("tiny", "output"), ("wide", "probabilities")):
            onnx.save(
                renamed_output(onnx.load(self.repo / name / "model.onnx"), output), models / f"{name}.onnx"
            )
        for delay_us in self.args.peer_delays:
            print(
                f"T  fngate against Triton ({serve_sh}), both batching with a delay of {delay_us} µs",
                flush=True,
            )
            self._peer_at(deployed, serve_sh, models, delay_us, http, grpc, open_loop, binary)

    def _peer_at(
        self,
        deployed: Deployment,
        serve_sh: Path,
        models: Path,
        delay_us: int,
        http: bool,
        grpc: bool,
        open_loop: bool,
        binary: bool = False,
    ) -> None:
        extra = {"delay_us": delay_us}
        port, grpc_port = free_port(), free_port()
        with open(self.logs / "triton.log", "wb") as log:
            triton = subprocess.Popen(
                [
                    "bash",
                    str(with_grpc(serve_sh, self.logs)),
                    str(models),
                    str(port),
                    "batch",
                    str(grpc_port),
                    str(delay_us),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            triton_url = f"http://127.0.0.1:{port}"
            for name in ("tiny", "wide"):
                wait_live(triton_url, path=f"/v2/models/{name}/ready", timeout_s=900)
            meters = {"fngate": deployed.meter(), "triton": process_meter(triton.pid, triton_url)}
            if http:
                points = [("tiny", 16, "output", c) for c in (1, 16, 64)]
                points += [("wide", 512, "probabilities", c) for c in (1, 16, 64)]
                for name, features, triton_output, concurrency in points:
                    requests, inputs = requests_for(
                        peer_function(name, delay_us), features, 20_000, False, seed=concurrency
                    )
                    ours = self.drive_requests(
                        deployed,
                        "T",
                        name,
                        name,
                        features,
                        concurrency,
                        requests,
                        inputs,
                        None,
                        {**extra, "body": "json"},
                    )
                    theirs = self.drive_peer(
                        meters["triton"], port, name, features, triton_output, concurrency, extra
                    )
                    ratio = ours["req_per_s"] / max(theirs["req_per_s"], 1e-9)
                    ours["triton_ratio"] = ratio
                    print(f"   {name} c={concurrency}: fngate/Triton throughput x{ratio:.2f}", flush=True)
            with_perf_analyzer = [("G", deployed.grpc_address, grpc_port)] if grpc else []
            if binary:
                with_perf_analyzer.append(("B", deployed.urls()[0].removeprefix("http://"), port))
            for scenario, ours_at, theirs_port in with_perf_analyzer:
                grpc_peer.run(
                    ours_at,
                    f"127.0.0.1:{theirs_port}",
                    self.args.measure_s,
                    self.logs,
                    self.record,
                    meters["fngate"],
                    meters["triton"],
                    lambda model: peer_function(model, delay_us),
                    extra,
                    scenario=scenario,
                )
            if open_loop:
                fngate_address = deployed.urls()[0].removeprefix("http://")
                bench_open_loop.run(
                    fngate_address,
                    f"127.0.0.1:{port}",
                    self.args.measure_s,
                    self.logs,
                    self.record,
                    meters=meters,
                    fngate_model=peer_function("tiny", delay_us),
                    extra=extra,
                )
        finally:
            triton.terminate()
            triton.wait(timeout=60)

    def drive_peer(
        self,
        meter: Meter,
        port: int,
        name: str,
        features: int,
        output: str,
        concurrency: int,
        extra: Row | None = None,
    ) -> Row:
        requests, inputs = requests_for(name, features, 20_000, False, seed=concurrency, output=output)
        check = checker(inputs, features, self.reference(name))
        since = meter.read()
        result = asyncio.run(
            loadgen.run(
                "127.0.0.1", port, requests, concurrency, self.args.warmup_s, self.args.measure_s, check
            )
        )
        row: Row = {
            "scenario": "T",
            "function": f"{name}@triton",
            **(extra or {}),
            "body": "json",
            "concurrency": concurrency,
            "req_per_s": result.throughput,
            "p50_ms": result.percentile_ms(50),
            "p90_ms": result.percentile_ms(90),
            "p99_ms": result.percentile_ms(99),
            "errors": result.errors,
            "checked": result.checked,
            **meter.per_request(since, result.completed),
        }
        self.record(row)
        return row

    def overhead_and_batching(self, deployed: Deployment) -> None:
        print("S1 overhead: tiny", flush=True)
        for binary in (False, True):
            for concurrency in (1, 16):
                self.drive(deployed, "S1", "tiny", "tiny", 16, concurrency, binary)
        print("S2 batching: wide, batching on and off", flush=True)
        for function in ("wide", "wide-nobatch"):
            for concurrency in (1, 16, 64):
                self.drive(deployed, "S2", function, "wide", 512, concurrency, True)
        self.drive(deployed, "S2", "wide", "wide", 512, 64, False)

    def cache(self, deployed: Deployment) -> None:
        print("S3 cache: hits (inputs answered before) against misses (new inputs), tiny-cached", flush=True)
        url = deployed.urls()[0]
        port = int(url.rsplit(":", 1)[1])
        warm, _ = requests_for("tiny-cached", 16, 200, True, seed=11)
        asyncio.run(loadgen.run("127.0.0.1", port, warm, 1, 0.0, 60.0, max_requests=len(warm)))
        for kind, seed in (("hit", 11), ("miss", 12)):
            requests, inputs = requests_for("tiny-cached", 16, 200 if kind == "hit" else 20_000, True, seed)
            for concurrency in (1, 16):
                self.drive_requests(
                    deployed,
                    "S3",
                    "tiny-cached",
                    "tiny",
                    16,
                    concurrency,
                    requests,
                    inputs,
                    extra={"cache": kind},
                    cycle=kind == "hit",
                )

    def cold_start(self, deployed: Deployment) -> None:
        """`fngate up` on this Redis with no runner: each request wakes the scaler, which starts a
        runner, which loads the model; phases come from the log lines of scaler and runner."""
        print("S4 cold start: fngate up, zero runners -> first answer (tiny, runner on demand)", flush=True)
        deployed.stop_runners()
        log = self.logs / "fngate-up.log"
        sock = socket.create_server(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        command = [
            sys.executable,
            "-m",
            "fngate.cli.main",
            "up",
            "--redis",
            deployed.redis_url,
            "--repo",
            str(self.repo),
            "--port",
            str(port),
            "--grpc-port",
            "0",
            "--idle-shutdown-s",
            "1",
            "--log-level",
            "INFO",
            "--no-auth",
            "--no-standby-runner",  # the runner's own start is part of this figure
        ]
        with open(log, "wb") as output:
            up = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        try:
            wait_live(f"http://127.0.0.1:{port}")
            requests, _inputs = requests_for("tiny", 16, 1, False, seed=99)
            for attempt in range(self.args.cold_starts):
                wait_for_no_runner(deployed.redis_url)
                offset = log.stat().st_size
                sent = time.time()
                run = asyncio.run(loadgen.run("127.0.0.1", port, requests, 1, 0.0, 30.0, max_requests=1))
                answered = time.time()
                phases = cold_start_phases(log.read_bytes()[offset:].decode(errors="replace"), sent)
                self.record(
                    {
                        "scenario": "S4",
                        "function": "tiny",
                        "attempt": attempt,
                        "spawn_to_answer_ms": (answered - sent) * 1e3,
                        "errors": run.errors,
                        **phases,
                    }
                )
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=60)

    def shared_queue(self, deployed: Deployment) -> None:
        print("S5 two gateways, two runners, one queue", flush=True)
        deployed.start_gateway()
        deployed.start_runner()
        urls = deployed.urls()
        self.drive(deployed, "S5", "tiny", "tiny", 16, 32, True, urls)
        self.drive(deployed, "S5", "wide", "wide", 512, 64, True, urls)


def cold_start_phases(log: str, sent: float) -> dict[str, float]:
    """Phases of one cold start from the JSON log lines of `fngate up` (scaler and runner)."""
    phases: dict[str, float] = {}
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        at = datetime.datetime.strptime(record["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC)
        since_ms = (at.timestamp() - sent) * 1e3
        message = record.get("message", "")
        if "woken with no runner" in message:
            phases.setdefault("woken_at_ms", since_ms)
        elif message.startswith("imports took"):
            phases["imports_ms"] = float(message.split()[2]) * 1e3
        elif message.startswith("runner ") and message.split("(")[0].endswith("started "):
            phases.setdefault("runner_up_at_ms", since_ms)
        elif message.startswith("loaded "):
            for phase, pattern in (
                ("download_ms", r"download ([0-9.]+) s"),
                ("model_load_ms", r", load ([0-9.]+) s"),
            ):
                found = re.search(pattern, message)
                if found:
                    phases[phase] = float(found.group(1)) * 1e3
            phases.setdefault("loaded_at_ms", since_ms)
    return phases


def renamed_output(model: Any, name: str) -> Any:
    """The model with its one output called `name` (the peer's configuration names wide's output
    `probabilities`)."""
    old = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = [name if output == old else output for output in node.output]
    model.graph.output[0].name = name
    return model


def wait_live(url: str, timeout_s: float = 30, path: str = "/v2/health/live", method: str = "GET") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.request(method, f"{url}{path}").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up")


def wait_for_no_runner(redis_url: str, timeout_s: float = 60) -> None:
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not client.zrangebyscore(keys.runners(), int(time.time() * 1000), "+inf"):
            return
        time.sleep(0.2)
    raise TimeoutError("runners did not stop")


# --- Scenarios P and M: a function hurts only itself (bench/poison.py, bench/soak.py) ------------


def robustness(deployed: Deployment, bench: Bench, wanted: Callable[[str], bool]) -> None:
    """H: hostile callers. P: one poison among fifteen innocents in a batch, Python and ONNX, with
    the innocents' latency. M: the mixed soak, on a deployment and Redis of its own (then a result
    quota's 429s)."""
    hostile_callers(deployed, bench, wanted("H"))
    if wanted("P"):
        write_poison_functions(deployed.repo)  # the gateway and runner find them within rescan_s
        poison_rounds(deployed.urls()[0], bench.record, 1 if bench.args.quick else 3)
    if wanted("M"):
        soak(deployed.repo, deployed.logs / "soak", bench.record, 30.0 if bench.args.quick else SOAK_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench/results"),
        help="where results.json, results.md and throughput.png go (default: bench/results; the "
        "committed figures are in docs/benchmarks: pass --out docs/benchmarks to replace them)",
    )
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--measure-s", type=float, default=4.0)
    parser.add_argument("--cold-starts", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="short windows, for a smoke run")
    parser.add_argument(
        "--large-model",
        action="store_true",
        help="S4 also cold-starts a 268 MB model from S3 (moto's server), empty cache and on disk, "
        "against limits measured in the same run (needs about 1.5 GB of memory and a minute or two)",
    )
    parser.add_argument(
        "--only", default="", help="comma-separated scenarios: inproc,S0,S1,S2,S3,S4,S5,T,G,B,O,H,P,M,C"
    )
    parser.add_argument(
        "--triton",
        type=Path,
        metavar="SERVE_SH",
        help="scenario T: also run the real Triton server, started by this script "
        "(`SERVE_SH MODELS_DIR PORT batch`, serving tiny.onnx and wide.onnx), on the same load, "
        "and print fngate/Triton ratios; its first run installs Triton (nvidia-pytriton)",
    )
    parser.add_argument(
        "--peer-delays",
        type=lambda text: [int(part) for part in text.split(",") if part],
        default=list(PEER_DELAYS_US),
        metavar="US,US",
        help="the dynamic batcher's max_queue_delay_us at which fngate and Triton are compared, the "
        "same on both sides at each point (default: 0,2000)",
    )
    parser.add_argument(
        "--gateway-workers",
        type=int,
        default=0,
        help="gateway processes of the main deployment (default 0: fngate up's, one per two cores, at most "
        "4)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup_s, args.measure_s, args.cold_starts = 0.3, 1.0, 1
    only = set(filter(None, args.only.split(",")))

    def wanted(name: str) -> bool:
        return not only or name in only

    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="fngate-bench-") as folder:
        repo = Path(folder) / "repo"
        build_repository(repo)
        bench = Bench(args, repo, Path(folder) / "logs")
        if wanted("inproc"):
            bench.in_process()
        with deployment(repo, Path(folder) / "logs") as deployed:
            deployed.start_gateway(workers=args.gateway_workers)
            deployed.start_runner()
            against_peers(deployed, bench, args.triton, wanted)
            if wanted("S0"):
                bench.http_floor(deployed)
            if wanted("S1") or wanted("S2"):
                bench.overhead_and_batching(deployed)
            if wanted("S3"):
                bench.cache(deployed)
            if wanted("S4"):
                bench.cold_start(deployed)
                if args.large_model:
                    from bench.coldstart import large_cold_starts

                    large_cold_starts(
                        deployed.redis_url,
                        Path(folder) / "large",
                        args.cold_starts,
                        bench.record,
                        cold_start_phases,
                        wait_for_no_runner,
                        wait_live,
                    )
            if wanted("S5"):
                deployed.stop_runners()
                deployed.start_runner()
                bench.shared_queue(deployed)
            robustness(deployed, bench, wanted)
        _with_deployments_of_their_own(bench, Path(folder), wanted)
    _write_results(args, bench.rows, round(time.time() - started, 1))
    return 0


def _write_results(args: argparse.Namespace, rows: list[Row], duration_s: float) -> None:
    """results.json, results.md and throughput.png in `--out`."""
    from bench.plot import draw
    from bench.report import write_report

    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {_cpu_model()}, {_cores()} cores",
        "python": platform.python_version(),
        "fngate": fngate.__version__,
        "onnxruntime": ort.__version__,
        "duration_s": duration_s,
        "warmup_s": args.warmup_s,
        "measure_s": args.measure_s,
    }
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_report(args.out, meta, rows)
    draw(args.out / "throughput.png", rows)
    print(f"wrote {args.out}/results.json, results.md and throughput.png in {duration_s} s")


GRPC_OFF = "--allow-grpc=false"


def with_grpc(serve_sh: Path, logs: Path) -> Path:
    """A peer script that opens Triton's gRPC port at its 4th argument. One that does not take it
    (its server starts with --allow-grpc=false) is copied, with the files beside it, into `logs`,
    and its copy starts the server with gRPC on 127.0.0.1 at that port instead."""
    text = serve_sh.read_text()
    if GRPC_OFF not in text:
        return serve_sh
    copy = logs / "triton-peer"
    shutil.copytree(serve_sh.parent, copy, dirs_exist_ok=True)
    grpc = '--allow-grpc=true --grpc-address=127.0.0.1 --grpc-port="$4"'
    (copy / serve_sh.name).write_text(text.replace(GRPC_OFF, grpc))
    return copy / serve_sh.name


def against_peers(
    deployed: Deployment, bench: Bench, triton: Path | None, wanted: Callable[[str], bool]
) -> None:
    """T, G, B and O beside the real Triton (--triton); G alone without it."""
    if triton is not None and any(wanted(scenario) for scenario in "TGBO"):
        bench.peer(
            deployed,
            triton.resolve(),
            http=wanted("T"),
            grpc=wanted("G"),
            open_loop=wanted("O"),
            binary=wanted("B"),
        )
    elif wanted("G"):
        grpc_peer.run(
            deployed.grpc_address, None, bench.args.measure_s, bench.logs, bench.record, deployed.meter()
        )


def hostile_callers(deployed: Deployment, bench: Bench, wanted: bool) -> None:
    """Scenario H, when wanted: what hostile requests cost a gateway process (bench/hostile.py)."""
    if not wanted:
        return
    from bench import hostile

    print("H: hostile callers (time to the answer, the gateway process's peak memory)", flush=True)
    hostile.run(deployed, bench.record)


def _with_deployments_of_their_own(bench: Bench, folder: Path, wanted: Callable[[str], bool]) -> None:
    """Scenarios that start deployments of their own, after the shared one has stopped."""
    if wanted("C"):  # one Redis against a Redis Cluster
        cluster_scenario.run(folder, requests_for, bench.args.measure_s, bench.record)


def _own_cpu() -> float:
    """CPU seconds of this process so far (the load generator runs in it)."""
    times = os.times()
    return times.user + times.system


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
