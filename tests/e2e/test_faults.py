"""Faults under `fngate up` (a real process tree: Redis with its append-only file, gateway,
runners): Redis killed or paused under load, a runner or the gateway killed. Every request the
test sent gets an answer (200, or 503/504 with a JSON body), nothing that was not killed dies,
and service resumes."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from bench.h2_client import hang_up
from fngate import keys
from tests.conftest import (
    EVERY_CONNECTION_KEPT,
    ROOT,
    free_port,
    policies,
    queued_invocations,
    start_redis,
    wait_http,
)

PROBE = "/v2/models/probe/infer"
CROWD = "/v2/models/crowd/infer"


def body(first: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [first, 1, 2, 3]}]}


@dataclasses.dataclass
class Up:
    process: subprocess.Popen[bytes]
    base: str
    redis_url: str
    log: Path
    clean_exit: bool = True
    """Stopped by the fixture, and so expected to exit 0."""

    def children(self, module: str) -> list[int]:
        """Process ids of `python -m <module>` children of fngate up."""
        found = []
        for pid in _children(self.process.pid):
            with contextlib.suppress(OSError):
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if module.encode() in args or any(arg.endswith(module.encode()) for arg in args[:1]):
                    found.append(pid)
        return found

    async def redis_pid(self) -> int:
        client = aioredis.from_url(self.redis_url, socket_timeout=2)
        async with client:
            info: Any = await client.info("server")
        return int(info["process_id"])

    def alive(self) -> bool:
        return self.process.poll() is None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(child) for child in (task / "children").read_text().split()]
    return out


@pytest.fixture
def fngate_up(repo: Path, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Factory: `fngate up` as a subprocess, with its state folder in tmp_path; stopped with SIGTERM."""
    started: list[Up] = []

    def start(workers: int = 1, port: int = 0, grpc_port: int = 0, **env: str) -> Up:
        port = port or free_port()
        state = tmp_path / "state"
        log = tmp_path / f"up-{len(started)}.log"
        command = [sys.executable, "-m", "fngate.cli.main", "up", "--repo", str(repo), "--port", str(port)]
        command += ["--grpc-port", str(grpc_port)]
        command += [
            "--state-dir",
            str(state),
            "--gateway-workers",
            str(workers),
            "--idle-shutdown-s",
            "30",
            "--no-auth",
            "--no-standby-runner",  # these tests count and kill the runners that serve
            "--metrics-port",
            "0",
        ]
        clean = {key: value for key, value in os.environ.items() if not key.startswith("FNGATE_")}
        with open(log, "wb") as out:
            process = subprocess.Popen(
                command,
                env={**clean, "FNGATE_CLAIM_IDLE_MS": "500", "FNGATE_CLAIM_INTERVAL_MS": "100", **env},
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        up = Up(process, f"http://127.0.0.1:{port}", f"unix://{state / 'redis' / 'redis.sock'}", log)
        started.append(up)
        return up

    yield start
    for up in started:
        if up.process.poll() is None:
            up.process.send_signal(signal.SIGTERM)
            try:
                up.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.process.kill()
                up.process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.process.pid, signal.SIGKILL)
        if up.clean_exit:
            assert up.process.returncode == 0, up.log.read_text()[-4000:]  # a clean exit, when asked
        assert (tmp_path / "state" / "redis" / "appendonlydir").is_dir()  # the data stays


@dataclasses.dataclass
class Outcome:
    at: float
    status: int | None
    detail: str


class Load:
    """A few clients posting probe invocations in a loop; every outcome is recorded."""

    def __init__(self, base: str, path: str = PROBE, clients: int = 4) -> None:
        self.base = base
        self.path = path
        self.clients = clients
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]

    async def stop(self) -> list[Outcome]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes

    async def _client(self, index: int) -> None:
        async with httpx.AsyncClient(base_url=self.base, timeout=40) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    response = await client.post(self.path, json=body(float(index * 10_000 + n)))
                except httpx.TransportError as exc:
                    self.outcomes.append(Outcome(time.monotonic(), None, repr(exc)))
                    await asyncio.sleep(0.05)
                    continue
                self.outcomes.append(Outcome(time.monotonic(), response.status_code, response.text[:300]))
                if response.status_code != 200:
                    await asyncio.sleep(0.02)

    async def wait_for_success_after(self, since: float, timeout_s: float) -> float:
        """When the first 200 after `since` came."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for outcome in list(self.outcomes):
                if outcome.at > since and outcome.status == 200:
                    return outcome.at
            await asyncio.sleep(0.05)
        raise AssertionError(f"no success within {timeout_s} s: {self.outcomes[-5:]}")


async def serving(up: Up) -> Up:
    await wait_http(up.base, timeout_s=30)
    return up


async def first_success(base: str, path: str = PROBE, timeout_s: float = 60) -> None:
    """Until one invocation succeeds (the first one pays the runner's cold start)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        while True:
            with contextlib.suppress(httpx.TransportError):
                response = await client.post(path, json=body(1.0))
                if response.status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise AssertionError("the deployment never answered")
            await asyncio.sleep(0.2)


def check_answered(outcomes: list[Outcome]) -> dict[str, int]:
    """Every request has an answer: 200, or 503/504 with a JSON error body. Returns counts."""
    counts: dict[str, int] = {}
    for outcome in outcomes:
        key = str(outcome.status)
        counts[key] = counts.get(key, 0) + 1
        assert outcome.status in (200, 503, 504), outcome
        if outcome.status != 200:
            assert '"code":' in outcome.detail, outcome
    return counts


def report(name: str, counts: dict[str, int], outage_s: float) -> None:
    print(f"{name}: answers by status {counts}; {outage_s:.2f} s without service")


async def test_redis_killed_under_load(fngate_up: Callable[..., Any]) -> None:
    up = await serving(fngate_up())
    await first_success(up.base)
    before = await up.redis_pid()
    load = Load(up.base)
    load.start()
    await asyncio.sleep(1.0)
    killed_at = time.monotonic()
    os.kill(before, signal.SIGKILL)
    back_at = await load.wait_for_success_after(killed_at + 0.5, timeout_s=30)
    await asyncio.sleep(1.0)
    outcomes = await load.stop()
    report("redis SIGKILL", check_answered(outcomes), back_at - killed_at)
    assert up.alive()
    after = await up.redis_pid()
    assert after != before  # restarted by fngate up
    assert policies(after) == {os.SCHED_BATCH}  # as it first was (fngate up --sched-batch)
    assert up.children("gateway"), "the gateway is gone"


async def test_redis_paused_under_load(fngate_up: Callable[..., Any]) -> None:
    up = await serving(fngate_up())
    await first_success(up.base)
    pid = await up.redis_pid()
    gateway = up.children("gateway")
    load = Load(up.base)
    load.start()
    await asyncio.sleep(0.5)
    os.kill(pid, signal.SIGSTOP)
    await asyncio.sleep(4.0)
    resumed_at = time.monotonic()
    os.kill(pid, signal.SIGCONT)
    back_at = await load.wait_for_success_after(resumed_at, timeout_s=30)
    await asyncio.sleep(1.0)
    outcomes = await load.stop()
    report("redis SIGSTOP 4 s", check_answered(outcomes), back_at - resumed_at)
    assert up.alive()
    assert await up.redis_pid() == pid  # a pause is not a crash: nobody restarted it
    assert up.children("gateway") == gateway  # and nobody exited


async def test_runner_killed_comes_back(fngate_up: Callable[..., Any]) -> None:
    up = await serving(fngate_up(PROBE_SLEEP_S="0.3"))
    await first_success(up.base)
    stream = keys.invocations("probe")
    client = aioredis.from_url(up.redis_url)
    async with client, httpx.AsyncClient(base_url=up.base, timeout=40, limits=EVERY_CONNECTION_KEPT) as http:
        [victim] = up.children("runner")
        calls = [asyncio.create_task(http.post(PROBE, json=body(float(i)))) for i in range(48)]
        for _ in range(400):  # until the runner holds invocations it has not answered
            if (await client.xpending(stream, keys.RUNNER_GROUP))["pending"] > 0:
                break
            await asyncio.sleep(0.01)
        os.kill(victim, signal.SIGKILL)
        responses = await asyncio.gather(*calls)
        assert [r.status_code for r in responses] == [200] * 48, [r.text for r in responses if r.is_error]
        for index, response in enumerate(responses):
            assert response.json()["outputs"][0]["data"][:1] == [index * 2.0]
        runners = up.children("runner")
        assert runners and victim not in runners  # another runner took the killed one's place
        assert policies(runners[0]) == {os.SCHED_BATCH}  # its threads too (onnxruntime's)
        names: Any = await client.zrange(keys.runners(), 0, -1)
        assert any(f"-{runners[0]}-" in name.decode() for name in names)  # and heart-beats
    assert "died (signal 9)" in up.log.read_text()


async def test_queued_invocations_survive_a_redis_crash(fngate_up: Callable[..., Any]) -> None:
    up = await serving(fngate_up(PROBE_SLEEP_S="1"))
    await first_success(up.base, CROWD)
    client = aioredis.from_url(up.redis_url, socket_timeout=2)
    async with httpx.AsyncClient(base_url=up.base, timeout=70) as http:
        calls = [asyncio.create_task(http.post(CROWD, json=body(float(i)))) for i in range(12)]
        async with client:
            for _ in range(200):
                if await queued_invocations(client, keys.invocations("crowd")) >= 8:
                    break
                await asyncio.sleep(0.02)
            waiting = await queued_invocations(client, keys.invocations("crowd"))
            pid = int((await client.info("server"))["process_id"])
        os.kill(pid, signal.SIGKILL)
        assert waiting >= 8
        restarted = aioredis.from_url(up.redis_url, socket_timeout=2)
        async with restarted:
            for _ in range(200):  # fngate up starts it again, from its append-only file
                with contextlib.suppress(OSError, RedisError):
                    if await restarted.ping():
                        break
                await asyncio.sleep(0.05)
            assert await queued_invocations(restarted, keys.invocations("crowd")) >= 1
        responses = await asyncio.gather(*calls)
    assert [r.status_code for r in responses] == [200] * 12, [r.text for r in responses if r.is_error]


async def test_gateway_killed_comes_back(fngate_up: Callable[..., Any]) -> None:
    up = await serving(fngate_up())
    [gateway] = up.children("gateway")
    os.kill(gateway, signal.SIGKILL)
    await first_success(up.base, timeout_s=60)
    assert up.alive()
    assert up.children("gateway") not in ([], [gateway])
    assert "the gateway exited with signal SIGKILL; restarting it" in up.log.read_text()


class Connections:
    """Clients that each open a new connection per request, in a loop, to the HTTP port (GET
    /v2/health/live) and to the gRPC port (the server's first SETTINGS frame): what a gateway
    restart costs a client that connects meanwhile. Each outcome is counted: 'served', 'refused'
    (the connection itself), or 'cut' (accepted, then lost: in flight on a process killed)."""

    PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"

    def __init__(self, http_port: int, grpc_port: int) -> None:
        self.ports = {"http": http_port, "grpc": grpc_port}
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.served_at: list[float] = []
        self.longest_s = 0.0
        """The longest a connection took to be served (one that waited out the restart)."""
        self._stop = asyncio.Event()

    async def _once(self, kind: str) -> str:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.ports[kind])
        except ConnectionRefusedError:
            return "refused"
        try:
            async with asyncio.timeout(30):
                if kind == "http":
                    writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                    answer = await reader.read()
                    return "served" if answer.startswith(b"HTTP/1.1 200") else "cut"
                writer.write(self.PREFACE)
                frame = await reader.readexactly(9)
                return "served" if frame[3] == 4 else "cut"  # SETTINGS
        except (OSError, asyncio.IncompleteReadError):
            return "cut"
        finally:
            await hang_up(writer)

    async def _client(self, kind: str) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            outcome = await self._once(kind)
            self.outcomes[f"{kind} {outcome}"] += 1
            if outcome == "served":
                self.served_at.append(time.monotonic())
                self.longest_s = max(self.longest_s, self.served_at[-1] - started)
            else:
                await asyncio.sleep(0.01)

    async def run_until(self, done: Callable[[], bool], timeout_s: float) -> None:
        clients = [asyncio.create_task(self._client(kind)) for kind in ["http"] * 6 + ["grpc"] * 2]
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        self._stop.set()
        await asyncio.gather(*clients)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_gateway_killed_refuses_no_connection(fngate_up: Callable[..., Any], workers: int) -> None:
    """fngate up holds the gateway's listening sockets: SIGKILL the gateway under a loopback load
    of new connections (HTTP and gRPC), and none is refused while it restarts; they wait in the
    backlog and the next gateway serves them. Only connections in flight on the killed process
    may be cut (at most one per client). With 2 workers, both serve fngate up's sockets, and the
    gateway killed is their supervisor (they end with it)."""
    grpc_port = free_port()
    up = await serving(fngate_up(workers=workers, grpc_port=grpc_port))
    [gateway] = up.children("gateway")
    load = Connections(int(up.base.rsplit(":", 1)[1]), grpc_port)
    killed: list[float] = []

    async def kill_then_wait() -> None:
        await asyncio.sleep(1.0)
        os.kill(gateway, signal.SIGKILL)
        killed.append(time.monotonic())

    reborn: list[float] = []

    def served_again() -> bool:
        """2 s of load after the first connection served once the new gateway exists (with 2
        workers, those of the killed one may serve a moment longer before they end with it)."""
        if killed and not reborn and up.children("gateway") not in ([], [gateway]):
            reborn.append(time.monotonic())
        after = [at for at in load.served_at if reborn and at > reborn[0]]
        return bool(after) and time.monotonic() > after[0] + 2.0

    killing = asyncio.create_task(kill_then_wait())
    await load.run_until(served_again, timeout_s=60)
    await killing
    print(f"\ngateway SIGKILL under new connections: {dict(load.outcomes)}; longest {load.longest_s:.2f} s")
    assert up.children("gateway") not in ([], [gateway])  # a new gateway serves
    assert load.outcomes["http refused"] == 0 and load.outcomes["grpc refused"] == 0, load.outcomes
    assert load.outcomes["http cut"] + load.outcomes["grpc cut"] <= 8, load.outcomes  # in flight at the kill
    after = [at for at in load.served_at if at > killed[0]]
    assert len(after) > 10, load.outcomes


async def test_a_gateway_worker_killed_is_started_again(fngate_up: Callable[..., Any]) -> None:
    up = await serving(fngate_up(workers=2))
    [gateway] = up.children("gateway")
    workers = _children(gateway)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    for _ in range(100):
        now = _children(gateway)
        if len(now) == 2 and workers[0] not in now:
            break
        await asyncio.sleep(0.1)
    assert len(now) == 2 and workers[0] not in now, now
    assert up.children("gateway") == [gateway]  # the supervisor itself went on
    assert all(policies(worker) == {os.SCHED_BATCH} for worker in now)  # the new one too
    await first_success(up.base, timeout_s=30)


async def test_one_fngate_up_per_state_folder(fngate_up: Callable[..., Any], repo: Path) -> None:
    up = await serving(fngate_up())
    state = Path(up.redis_url.removeprefix("unix://")).parent.parent
    second = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fngate.cli.main", "up", "--repo", str(repo), "--port", str(free_port()),
        "--grpc-port", "0", "--metrics-port", "0", "--state-dir", str(state), "--no-auth",
        cwd=ROOT, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(second.communicate(), 60)
    assert second.returncode == 1
    assert b"another fngate up uses the state folder" in err
    assert up.alive()


async def test_redis_restarted_empty_under_a_standalone_gateway_and_runner(
    gateway_process: Callable[..., str],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    """Redis without persistence, killed and started again empty (as a pod without a volume would
    be): queued invocations are gone, but every request is answered and both processes go on."""
    folder = tmp_path / "external-redis"
    folder.mkdir()
    redis_process, url = start_redis(folder)
    try:
        base = gateway_process(FNGATE_REDIS_URL=url)
        runner = runner_process(FNGATE_REDIS_URL=url, FNGATE_FUNCTIONS='["probe"]')
        await wait_http(base)
        await first_success(base)
        load = Load(base)
        load.start()
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        redis_process.kill()
        redis_process.wait()
        await asyncio.sleep(1.0)
        redis_process, _ = start_redis(folder)  # the same address, nothing in it
        back_at = await load.wait_for_success_after(time.monotonic(), timeout_s=30)
        await asyncio.sleep(1.0)
        outcomes = await load.stop()
        report("external redis SIGKILL + empty restart", check_answered(outcomes), back_at - killed_at)
        assert runner.poll() is None
    finally:
        redis_process.kill()
        redis_process.wait()


async def test_fngate_up_killed_takes_its_processes_with_it_and_restarts_on_the_same_port(
    fngate_up: Callable[..., Any],
) -> None:
    """SIGKILL fngate up: Redis, the gateway and the runners end too (none serves without its
    supervisor), and a new fngate up on the same port and state folder serves, with one Redis. The
    state folder is its user's alone."""
    up = await serving(fngate_up())
    await first_success(up.base)  # a runner serves
    state = Path(up.redis_url.removeprefix("unix://")).parent.parent
    assert state.stat().st_mode & 0o777 == 0o700
    private = [state / "redis", *(state / "redis").rglob("*"), state / "lock", state / "up.json"]
    assert all(path.stat().st_mode & 0o077 == 0 for path in private), [
        (str(path), oct(path.stat().st_mode)) for path in private if path.stat().st_mode & 0o077
    ]
    redis_pid = await up.redis_pid()
    children = [*up.children("gateway"), *up.children("runner"), redis_pid]
    up.process.kill()
    up.process.wait()
    up.clean_exit = False
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in children):
        assert time.monotonic() < deadline, [pid for pid in children if _alive(pid)]
        await asyncio.sleep(0.1)
    again = await serving(fngate_up(port=int(up.base.rsplit(":", 1)[1])))
    assert again.base == up.base
    assert await again.redis_pid() != redis_pid
    assert _redis_servers_in(state / "redis") == [await again.redis_pid()]


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def _redis_servers_in(folder: Path) -> list[int]:
    """The redis-server processes working in `folder` (Redis works in its --dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if (
                entry.name.isdigit()
                and (entry / "comm").read_text().strip() == "redis-server"
                and Path(os.readlink(entry / "cwd")) == folder.resolve()
            ):
                found.append(int(entry.name))
    return found
