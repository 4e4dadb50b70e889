"""Shared fixtures: one real redis-server per session, flushed before each test; factories for
gateways (in-process Hypercorn, or processes) and runners (in-process, or processes). A test
marked `on_cluster_too` runs a second time with a Redis Cluster on loopback as its queue (one per
session, started by the first such test)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from fngate import clients, queue
from fngate.config import GatewaySettings, RunnerSettings
from fngate.process import stop_processes
from fngate.up import supervisor
from fngate.up.redis_cluster import PORTS_FROM as CLUSTER_PORTS_FROM
from fngate.up.redis_cluster import ClusterError, LocalCluster, start_cluster
from gateway.app import create_app
from gateway.http.server import SERVERS
from runner.worker import main as runner_main

ROOT = Path(__file__).resolve().parent.parent

EVERY_CONNECTION_KEPT = httpx.Limits(
    max_connections=None, max_keepalive_connections=None, keepalive_expiry=None
)
"""Limits for a test's httpx client that has many requests under way at once. httpcore 1.0
(encode/httpcore#1110) can close a pooled connection it takes for idle (past
max_keepalive_connections, 20 by default; to make room at max_connections; or idle past
keepalive_expiry, 5 s by default) after it has handed the connection to a waiting request that has
not started on it yet: that request then fails with ReadError though the server did nothing wrong.
With none of the three limits the pool closes a connection only when the server has; the test
bounds how many requests it sends at once."""


# The suite's own home: nothing in it reads or writes the user's state folder (where a running
# `fngate up` leaves its gateway, Redis and admin key) or follows the user's FNGATE_*, OTEL_* and AWS_*
# variables to the user's processes. Downloads of test tools (XDG_CACHE_HOME) are kept across runs.
SUITE_VARIABLES_KEPT = frozenset({"FNGATE_SERVER"})
"""The one FNGATE_* variable the suite follows: the HTTP server every gateway of the run uses."""


TOOL_CONFIGS = {".terraformrc": "TF_CLI_CONFIG_FILE", ".docker": "DOCKER_CONFIG"}
"""Test tools' own settings in the user's home (a provider mirror, registry logins), kept."""


@pytest.fixture(scope="session", autouse=True)
def suite_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("home")
    user_home = Path("~").expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(user_home / ".cache")
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith(("FNGATE_", "OTEL_", "AWS_")) and name not in SUITE_VARIABLES_KEPT:
                patch.delenv(name)
        for name, variable in TOOL_CONFIGS.items():
            if (user_home / name).exists() and variable not in os.environ:
                patch.setenv(variable, str(user_home / name))
        if (user_home / ".terraform.d" / "plugins").is_dir():  # terraform's implied provider mirror
            (home / ".terraform.d").mkdir()
            (home / ".terraform.d" / "plugins").symlink_to(user_home / ".terraform.d" / "plugins")
        patch.setenv("HOME", str(home))
        patch.setenv("XDG_STATE_HOME", str(home / ".local" / "state"))
        patch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
        patch.setenv("XDG_CACHE_HOME", cache)
        yield home


def start_redis(folder: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    try:
        return supervisor.start_redis(folder, *args)
    except supervisor.LocalError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def single_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """3 primaries and 3 replicas of `redis-server --cluster-enabled yes` on loopback."""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("cluster"))
    except ClusterError as exc:
        pytest.fail(str(exc))
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> str:
    """The queue's URL: the session's Redis, emptied for the test (what an earlier test left there,
    an unloaded mark or a key, is not this test's), or its Redis Cluster where the test is
    parametrized so (on_cluster_too; the `redis` fixture empties that)."""
    if getattr(request, "param", "redis") == "cluster":
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        return cluster.url
    url: str = request.getfixturevalue("single_redis_url")
    client = sync_redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()
    return url


on_cluster_too = pytest.mark.parametrize(
    "redis_url", ["redis", pytest.param("cluster", marks=pytest.mark.cluster)], indirect=True
)
"""Run the test on one Redis and on the session's Redis Cluster."""


@pytest.fixture
def extra_redis(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], str]]]:
    """Factory: another redis-server with extra arguments (a cache of its own, a memory limit)."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> tuple[subprocess.Popen[bytes], str]:
        process, url = start_redis(tmp_path_factory.mktemp("redis-extra"), *args)
        started.append(process)
        return process, url

    yield start
    for process in started:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=10)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = clients.connect(redis_url)
    await client.flushall()  # on a cluster, every primary's
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository folder with the example functions and the test functions."""
    folder = tmp_path_factory.mktemp("repo")
    for source in [
        *sorted((ROOT / "functions").iterdir()),
        *sorted((ROOT / "tests" / "functions").iterdir()),
    ]:
        if (source / "function.yaml").is_file():
            shutil.copytree(source, folder / source.name)
    return folder


def free_socket() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
    sock.set_inheritable(True)
    return sock


def policies(pid: int) -> set[int]:
    """The scheduling policy of each live thread of a process."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found.add(os.sched_getscheduler(int(task.name)))
        except ProcessLookupError:
            continue
    return found


PORTS_FROM = 3000
PORT_BLOCK = 1000
"""free_port's ports: a block of this many for each pytest worker, from PORTS_FROM up, below the
kernel's ephemeral range and the ports a local Redis Cluster draws (fngate.up.redis_cluster)."""
_ports = itertools.count()


def free_port() -> int:
    """A port free on loopback now, for servers that bind their own (gRPC's, metrics'). A port of
    the kernel's ephemeral range, free a moment ago, may be taken before the server binds it: by
    any outgoing connection, or by another worker's server (a gRPC server binds with SO_REUSEPORT,
    so two would share it and each take half of the other's connections). So each worker draws
    from a block of its own below that range, in turn, skipping what is taken."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    first = PORTS_FROM + worker * PORT_BLOCK
    assert first + PORT_BLOCK <= CLUSTER_PORTS_FROM, "more pytest workers than free_port has blocks for"
    for _ in range(PORT_BLOCK):
        port = first + next(_ports) % PORT_BLOCK
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError(f"no free port in {first}-{first + PORT_BLOCK - 1}")


@pytest.fixture
async def serve_gateway(redis_url: str, repo: Path) -> AsyncIterator[Callable[..., Any]]:
    """Factory: serve the real gateway app in this process on a socket bound to port 0."""
    stops: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(**overrides: Any) -> str:
        sock = free_socket()
        port = sock.getsockname()[1]
        # Detached: the server owns the descriptor from here on and closes it. The server is the
        # settings' (FNGATE_SERVER=hypercorn runs the whole suite on Hypercorn).
        # Auth off unless a test asks for it: the tests about auth are tests/*/test_auth*.py.
        # No gRPC unless asked for (grpc_port=free_port()): 8001 may be the user's own fngate up.
        fields = {"redis_url": redis_url, "repo": str(repo), "auth": False, "grpc_port": 0, **overrides}
        fields["bind"] = f"fd://{sock.detach()}"
        settings = GatewaySettings(**fields)
        stopping = asyncio.Event()
        app = create_app(settings, stopping)
        task = asyncio.create_task(SERVERS[settings.server](app, settings, stopping))
        stops.append((stopping, task))
        base = f"http://127.0.0.1:{port}"
        await wait_http(base)
        return base

    yield start
    for stopping, task in stops:
        stopping.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)


@dataclasses.dataclass(frozen=True)
class RunnerHandle:
    stopping: asyncio.Event
    task: asyncio.Task[None]


@pytest.fixture
async def inprocess_runner(redis_url: str, repo: Path) -> AsyncIterator[Callable[..., Any]]:
    """Factory: run runner.worker.main() in this event loop."""
    runs: list[RunnerHandle] = []

    async def start(**overrides: Any) -> RunnerHandle:
        settings = RunnerSettings(
            **{"redis_url": redis_url, "repo": str(repo), "status_port": 0, **overrides}
        )
        stopping = asyncio.Event()
        handle = RunnerHandle(stopping, asyncio.create_task(runner_main(settings, stopping)))
        runs.append(handle)
        return handle

    yield start
    for run in runs:
        run.stopping.set()
        await asyncio.wait_for(run.task, 30)


def child_env(redis_url: str, repo: Path, **extra: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("FNGATE_") or key == "FNGATE_SERVER"  # the server the suite runs on
    }
    env.update(
        FNGATE_REDIS_URL=redis_url,
        FNGATE_REPO=str(repo),
        FNGATE_LOG_LEVEL="INFO",
        FNGATE_STATUS_PORT="0",
        FNGATE_GRPC_PORT="0",
        FNGATE_METRICS_PORT="0",  # a gateway's metrics port only where a test asks for one
    )
    env.update(extra)
    return env


@pytest.fixture
def runner_process(
    redis_url: str, repo: Path, tmp_path: Path
) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Factory: start `python -m runner` processes; each is stopped (then killed) at the end."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(**env: str) -> subprocess.Popen[bytes]:
        with open(tmp_path / f"runner-{len(processes)}.log", "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "runner"],
                env=child_env(redis_url, repo, **env),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        processes.append(process)
        return process

    yield start
    stop_processes(processes)


@pytest.fixture
def gateway_process(redis_url: str, repo: Path, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Factory: start `python -m gateway` on a socket this test bound to port 0; returns its URL.
    Auth is off unless `FNGATE_AUTH="true"` is passed."""
    processes: list[subprocess.Popen[bytes]] = []
    sockets: list[socket.socket] = []

    def start(**env: str) -> str:
        sock = free_socket()
        sockets.append(sock)
        with open(tmp_path / f"gateway-{len(processes)}.log", "wb") as log:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "gateway"],
                    env=child_env(
                        redis_url,
                        repo,
                        **{"FNGATE_AUTH": "false", **env},
                        FNGATE_BIND=f"fd://{sock.fileno()}",
                    ),
                    pass_fds=[sock.fileno()],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    stop_processes(processes)
    for sock in sockets:
        sock.close()


async def queued_invocations(redis: Any, stream: str) -> int:
    """The invocations on a function's stream: its entries, and what the entries a gateway's turn
    shares hold beyond one each (fngate.queue.extra_count)."""
    length, extra = await asyncio.gather(redis.xlen(stream), redis.get(queue.extra_count(stream)))
    return int(length) + int(extra or 0)


async def wait_http(base: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while True:
            try:
                if (await client.get(f"{base}/v2/health/live")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base} did not come up within {timeout_s} s")
            await asyncio.sleep(0.05)
