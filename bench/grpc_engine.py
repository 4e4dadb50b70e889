"""The gateway's own HTTP/2 engine for gRPC against grpcio's server (C-core), by evidence: for a
trivial unary RPC (ServerLive: no key, no Redis, no queue), each server's CPU time per RPC (its
process's utime and stime from /proc/PID/stat) and RPCs per second, driven by grpcio's own client
with 1 and 16 RPCs in flight on one channel; and how many of RFC 9113's requirements
(bench.rfc9113's probes) each server meets.

    python -m bench.grpc_engine [--seconds S] [--rounds N] [--no-probes]

Each server is a process of its own: `python -m gateway` on uvicorn (its gRPC port; a private
redis-server beside it, which ServerLive never touches) and this module's grpcio server
(`--serve-grpcio PORT`: grpc.aio serving tritonclient's GRPCInferenceService, ServerLive alone,
PINGs tolerated). The client runs in this process, the same for both; the servers' points are
interleaved, round by round, and each figure is the median of its rounds. The probes count a
connection error that closes without GOAWAY apart (RFC 9113 asks a GOAWAY only as a SHOULD).
Loopback only; about 90 s with the defaults. On a shared machine the figures move between runs:
compare the two servers within one run only."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bench import h2_peer, rfc9113

ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 16)
READY_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for an answer on loopback here (the tests wait longer, for a loaded
machine): what a server does not do within a second, it does not do at all."""
GRPCIO_OPTIONS = [("grpc.http2.max_ping_strikes", 0), ("grpc.http2.min_ping_interval_without_data_ms", 0)]
"""PINGs taken as they come (C-core's server otherwise ends a connection after two PINGs without
data in 5 minutes), so that the probes' PINGs (bench.h2_peer's barrier) do not decide what they
find; the RPCs measured send none."""


def cpu_s(pid: int) -> float:
    """The process's user and system CPU time so far, all its threads, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
    return port


class _Live(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=True)


async def serve_grpcio(port: int) -> None:
    """grpcio's aio server of ServerLive on loopback, until it is terminated."""
    server = grpc.aio.server(options=GRPCIO_OPTIONS)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Live(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


@contextlib.contextmanager
def servers() -> Iterator[dict[str, tuple[int, int]]]:
    """Both servers running: {name: (gRPC port, pid)}."""
    with tempfile.TemporaryDirectory(prefix="fngate-grpc-engine-") as folder:
        socket_path = Path(folder) / "redis.sock"
        redis = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", str(socket_path), "--save", ""],
            stdout=subprocess.DEVNULL,
        )
        own_port, grpcio_port = free_port(), free_port()
        env = {key: value for key, value in os.environ.items() if not key.startswith("FNGATE_")}
        env.update(
            FNGATE_REDIS_URL=f"unix://{socket_path}",
            FNGATE_REPO=str(ROOT / "functions"),
            FNGATE_AUTH="false",
            FNGATE_SERVER="uvicorn",
            FNGATE_GRPC_PORT=str(own_port),
            FNGATE_PORT=str(free_port()),
            FNGATE_STATUS_PORT="0",
            FNGATE_METRICS_PORT="0",
            FNGATE_LOG_LEVEL="WARNING",
        )
        started: list[subprocess.Popen[bytes]] = [redis]
        try:
            with open(Path(folder) / "gateway.log", "wb") as log:
                started.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "gateway"],
                        env=env,
                        cwd=ROOT,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            quiet = {**os.environ, "GRPC_VERBOSITY": "NONE"}  # C-core logs each broken probe
            started.append(
                subprocess.Popen(
                    [sys.executable, "-m", "bench.grpc_engine", "--serve-grpcio", str(grpcio_port)],
                    cwd=ROOT,
                    env=quiet,
                )
            )
            yield {"own engine": (own_port, started[1].pid), "grpcio": (grpcio_port, started[2].pid)}
        finally:
            for process in reversed(started):
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


async def live(port: int) -> None:
    """Returns once the server answers ServerLive (bounded)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        while True:
            try:
                await stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=2)
                return
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


async def measure(port: int, pid: int, concurrency: int, seconds: float) -> tuple[float, float]:
    """(RPCs per second, the server's CPU µs per RPC) over `seconds`, after a second of warm-up."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ServerLiveRequest()
        counting = False
        done = 0
        stop = asyncio.Event()

        async def caller() -> None:
            nonlocal done
            while not stop.is_set():
                answer = await stub.ServerLive(request, timeout=10)
                assert answer.live
                if counting:
                    done += 1

        async with asyncio.TaskGroup() as callers:
            for _ in range(concurrency):
                callers.create_task(caller())
            await asyncio.sleep(1.0)
            counting, cpu_before, started = True, cpu_s(pid), time.perf_counter()
            await asyncio.sleep(seconds)
            counting, cpu_after, elapsed = False, cpu_s(pid), time.perf_counter() - started
            stop.set()
    return done / elapsed, (cpu_after - cpu_before) / max(done, 1) * 1e6


async def run(running: dict[str, tuple[int, int]], seconds: float, rounds: int, probes: bool) -> None:
    for port, _ in running.values():
        await live(port)
    points: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for index in range(rounds):
        for concurrency in CONCURRENCY:
            for name, (port, pid) in running.items():
                rate, cpu_us = await measure(port, pid, concurrency, seconds)
                points.setdefault((name, concurrency), []).append((rate, cpu_us))
                print(
                    f"round {index + 1}, c={concurrency:2}, {name:10}: "
                    f"{rate:7.0f} RPC/s, {cpu_us:6.1f} µs CPU/RPC"
                )
    print("\n| server | c | RPC/s | server CPU µs per RPC |\n| --- | --- | --- | --- |")
    medians = {
        key: (statistics.median(rate for rate, _ in found), statistics.median(cpu for _, cpu in found))
        for key, found in points.items()
    }
    for (name, concurrency), (rate, cpu_us) in medians.items():
        print(f"| {name} | {concurrency} | {rate:.0f} | {cpu_us:.1f} |")
    for concurrency in CONCURRENCY:
        own, other = medians[("own engine", concurrency)], medians[("grpcio", concurrency)]
        print(
            f"c={concurrency}: own/grpcio RPC/s {own[0] / other[0]:.2f}, CPU per RPC {own[1] / other[1]:.2f}"
        )
    if probes:
        h2_peer.TIMEOUT_S = PROBE_TIMEOUT_S
        for name, (port, _) in running.items():
            h2_peer.bare_closes = []
            outcomes = await rfc9113.run_all(port)
            counts = collections.Counter(outcome.split(":")[0] for _, _, outcome in outcomes)
            print(
                f"\n{name}: of RFC 9113's {len(outcomes)} probes, "
                + ", ".join(f"{n} {k}" for k, n in counts.items())
            )
            for section, probe, outcome in outcomes:
                if outcome != "met":
                    print(f"  {section} {probe}: {outcome[:120]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grpc_engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per point")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every point, interleaved")
    parser.add_argument("--no-probes", action="store_true", help="leave out RFC 9113's probes")
    parser.add_argument("--serve-grpcio", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_grpcio:
        asyncio.run(serve_grpcio(args.serve_grpcio))
        return 0
    with servers() as running:
        asyncio.run(run(running, args.seconds, args.rounds, not args.no_probes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
