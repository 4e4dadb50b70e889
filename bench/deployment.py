"""A fngate deployment for the benchmark: a private redis-server, gateway and runner processes,
with their CPU time read from /proc so each run can report cost per request."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from fngate.cli.main import gateway_workers
from fngate.process import stop_processes
from fngate.up.supervisor import private_redis

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process (and its reaped children), from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15]) / CLOCK_TICKS


Waits = dict[int, float]
"""Run-queue seconds so far of each live thread, by thread id."""


def runqueue_waits(*pids: int) -> Waits:
    """How long each live thread of these processes has been runnable and waiting for a CPU (the
    run queue), from /proc/PID/task/*/schedstat: the time an invocation waits on a busy machine
    that is neither its own work nor idle. By thread, since a thread that ends takes its figure
    with it: see waited()."""
    found: Waits = {}
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # it ended
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                    found[int(task)] = int(stat.read().split()[1]) / 1e9
            except (OSError, IndexError, ValueError):
                continue
    return found


def waited(since: Waits, now: Waits) -> float:
    """Run-queue seconds between two readings: of the threads alive at the second (a thread that
    started between them counts whole; one that ended loses its last part, never more)."""
    return sum(seconds - since.get(thread, 0.0) for thread, seconds in now.items())


def tree_pids(pid: int) -> list[int]:
    """A process and every live descendant (a server that runs its models in child processes, as
    Triton's Python backend does)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and every live descendant."""
    total = 0.0
    for each in tree_pids(pid):
        with contextlib.suppress(OSError):  # it ended
            total += cpu_seconds(each)
    return total


def redis_pid(url: str) -> int:
    import redis

    return int(redis.Redis.from_url(url).info("server")["process_id"])


@dataclasses.dataclass
class Deployment:
    redis_url: str
    repo: Path
    logs: Path
    gateways: list[tuple[subprocess.Popen[bytes], str]] = dataclasses.field(default_factory=list)
    runners: list[subprocess.Popen[bytes]] = dataclasses.field(default_factory=list)
    grpc_address: str = ""
    """The gRPC port of the first gateway (its workers share it)."""
    profiles: Path | None = None
    """Where each gateway and runner writes its cProfile at exit (`gateway-N.prof`,
    `runner-N.prof`); None: no profiler (it about doubles their CPU)."""

    def _command(self, module: str, index: int) -> list[str]:
        if self.profiles is None:
            return [sys.executable, "-m", module]
        out = self.profiles / f"{module}-{index}.prof"
        return [sys.executable, "-m", "cProfile", "-o", str(out), "-m", module]

    def env(self, **extra: str) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("FNGATE_")}
        env.update(FNGATE_REDIS_URL=self.redis_url, FNGATE_REPO=str(self.repo), FNGATE_LOG_LEVEL="WARNING")
        env.update(FNGATE_AUTH="false")  # the auth check's own cost: python -m bench.auth
        env.update(FNGATE_METRICS_PORT="0")  # many gateways on one machine; the port costs nothing idle
        env.update(FNGATE_SCHED_BATCH="true")  # as fngate up runs them (--sched-batch)
        env.update(extra)
        return env

    def start_gateway(self, workers: int = 0, **extra: str) -> str:
        """A gateway of `workers` processes on one port, each on a listening socket of its own, as
        `fngate up` runs it (0: fngate up's default, one per two cores, at most 4)."""
        from gateway.__main__ import listening_sockets

        socks = listening_sockets("127.0.0.1", 0, workers or gateway_workers())
        url = f"http://127.0.0.1:{socks[0].getsockname()[1]}"
        grpc_port = free_port()
        grpc = {"FNGATE_GRPC_PORT": str(grpc_port), "FNGATE_GRPC_REUSE_PORT": "true"}
        if not self.grpc_address:
            self.grpc_address = f"127.0.0.1:{grpc_port}"
        for sock in socks:
            with open(self.logs / f"gateway-{len(self.gateways)}.log", "wb") as log:
                process = subprocess.Popen(
                    self._command("gateway", len(self.gateways)),
                    env=self.env(FNGATE_BIND=f"fd://{sock.fileno()}", **{**grpc, **extra}),
                    pass_fds=[sock.fileno()],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            self.gateways.append((process, url))
            sock.close()
        _wait_live(url)
        return url

    def urls(self) -> list[str]:
        """One URL per gateway (its worker processes share it)."""
        return list(dict.fromkeys(url for _, url in self.gateways))

    def start_runner(self, **extra: str) -> subprocess.Popen[bytes]:
        with open(self.logs / f"runner-{len(self.runners)}.log", "ab") as log:
            process = subprocess.Popen(
                self._command("runner", len(self.runners)),
                env=self.env(**extra),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.runners.append(process)
        return process

    def stop_runners(self) -> None:
        stop_processes(self.runners)
        self.runners.clear()

    def stop(self) -> None:
        stop_processes([process for process, _ in self.gateways])
        self.gateways.clear()
        self.stop_runners()

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each kind of process (gateways, runners, redis)."""
        return {
            "gateway": sum(cpu_seconds(process.pid) for process, _ in self.gateways),
            "runner": sum(cpu_seconds(process.pid) for process in self.runners if process.poll() is None),
            "redis": cpu_seconds(redis_pid(self.redis_url)),
        }

    def waits(self) -> dict[str, Waits]:
        """Run-queue seconds so far of the threads of each kind of process (gateways, runners, redis)."""
        return {
            "gateway": runqueue_waits(*(process.pid for process, _ in self.gateways)),
            "runner": runqueue_waits(*(process.pid for process in self.runners)),
            "redis": runqueue_waits(redis_pid(self.redis_url)),
        }

    def meter(self) -> Meter:
        """What this deployment uses while it is driven."""
        return Meter(cpu=self.cpu, waits=self.waits, served=lambda model: served(self.urls()[0], model))


Reading = tuple[dict[str, float], dict[str, Waits]]
"""A meter's CPU and run-queue seconds at one moment, by kind of process."""


@dataclasses.dataclass
class Meter:
    """What a server uses: CPU time and run-queue wait of each kind of its processes, per request
    (per inference its statistics counted, for a client in another process such as perf_analyzer:
    the V2 statistics extension, which fngate and Triton both serve)."""

    cpu: Callable[[], dict[str, float]]
    waits: Callable[[], dict[str, Waits]]
    served: Callable[[str], int]
    """The inferences of a model counted so far."""

    def read(self) -> Reading:
        return self.cpu(), self.waits()

    def per_request(self, since: Reading, requests: int) -> dict[str, float]:
        """cpu_us_KIND and wait_us_KIND per request since `since`."""
        cpu, waits = since
        requests = max(requests, 1)
        row = {f"cpu_us_{kind}": (now - cpu[kind]) / requests * 1e6 for kind, now in self.cpu().items()}
        row.update(
            {
                f"wait_us_{kind}": waited(waits[kind], now) / requests * 1e6
                for kind, now in self.waits().items()
            }
        )
        return row

    def around(self, model: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """`run()`'s row (a client in another process), with cpu_us_KIND, wait_us_KIND and the
        client's cpu_us_loadgen per inference counted added."""
        since, count, client = self.read(), self.served(model), _children_cpu()
        row = run()
        inferences = self.served(model) - count
        if inferences <= 0:
            return row
        row.update(self.per_request(since, inferences))
        row["cpu_us_loadgen"] = (_children_cpu() - client) / inferences * 1e6
        return row


def metered(meter: Meter | None, model: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run()`'s row, measured by `meter` where there is one."""
    return run() if meter is None else meter.around(model, run)


def served(url: str, model: str) -> int:
    """Inferences of `model` that the server at `url` counted (V2 statistics extension)."""
    stats = httpx.get(f"{url}/v2/models/{model}/stats", timeout=10).json()
    return sum(int(version["inference_count"]) for version in stats["model_stats"])


def process_meter(pid: int, url: str) -> Meter:
    """A server of one process tree (Triton), its statistics at `url`."""
    return Meter(
        cpu=lambda: {"server": tree_cpu_seconds(pid)},
        waits=lambda: {"server": runqueue_waits(*tree_pids(pid))},
        served=lambda model: served(url, model),
    )


def _children_cpu() -> float:
    """CPU time of this process's reaped children (the perf_analyzer runs)."""
    times = os.times()
    return times.children_user + times.children_system


@contextlib.contextmanager
def deployment(repo: Path, logs: Path, profiles: Path | None = None) -> Iterator[Deployment]:
    """Redis, and the gateways and runners started on it, stopped at the end; `profiles`: where
    they write their cProfile (Deployment.profiles)."""
    logs.mkdir(parents=True, exist_ok=True)
    if profiles is not None:
        profiles.mkdir(parents=True, exist_ok=True)
    with private_redis(batch=True) as url:
        deployed = Deployment(url, repo, logs, profiles=profiles)
        try:
            yield deployed
        finally:
            deployed.stop()


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
    return port


def _wait_live(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/v2/health/live").status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not come up")
