"""Functions cannot take their neighbours down: four bad Python functions (one that exits, one that
never returns, one that leaks, one that answers the wrong shape and datatype) beside `classifier` on
one runner process; an in-process model that hangs; and what a function's process can see."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import redis.asyncio as aioredis

from bench.models import write_poison_functions
from fngate import keys
from fngate.process import stop_processes
from runner import confinement
from tests.conftest import EVERY_CONNECTION_KEPT, ROOT, child_env, free_port
from tests.e2e import deployments
from tests.e2e.function_output import FunctionOutput
from tests.runner.slow_model import build_slow_model

NEIGHBOURS = ("classifier", "crasher", "hang", "leak", "misshapen")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
CLASSIFIER_CALLS = 120
CONCURRENCY = 6
RUNNER_MARGIN_BYTES = 64 * 2**20


def x_body(first: float = 1.0) -> dict[str, Any]:
    return {"inputs": {"x": [[first, 1.0, 2.0, 3.0]]}}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * PAGE_BYTES


def children(pid: int) -> dict[int, str]:
    """Live child processes of `pid` and their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry.name)] = cmdline
    return found


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for whoever adopted it to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def until_ok(call: Callable[[], Awaitable[httpx.Response]], timeout_s: float = 60) -> httpx.Response:
    """Retry while the runner is still starting (the gateway answers 503 or 504 meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await call()
        if response.status_code == 200 or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.2)


async def restarts(status: str, function: str, reason: str) -> float:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{status}/metrics")).text
    pattern = rf'fngate_function_restarts_total\{{function="{function}",reason="{reason}"\}} (\S+)'
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


async def test_bad_functions_do_not_disturb_their_neighbours(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis: aioredis.Redis,
    repo: Path,
) -> None:
    base = await serve_gateway()
    port = free_port()
    runner = runner_process(FNGATE_FUNCTIONS=json.dumps(NEIGHBOURS), FNGATE_STATUS_PORT=str(port))
    status = f"http://127.0.0.1:{port}"
    session = ort.InferenceSession(
        str(repo / "classifier" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(15)
    inputs = [
        rng.standard_normal((int(rng.integers(1, 4)), 16), dtype=np.float32) for _ in range(CLASSIFIER_CALLS)
    ]
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        def classify(index: int) -> Awaitable[httpx.Response]:
            return client.post("/v1/functions/classifier", json={"inputs": {"input": inputs[index].tolist()}})

        def call(name: str, first: float = 1.0) -> Awaitable[httpx.Response]:
            return client.post(f"/v1/functions/{name}", json=x_body(first))

        # Both loaded before the runner's memory is measured.
        assert (await until_ok(lambda: classify(0))).status_code == 200
        assert (await until_ok(lambda: call("leak"))).status_code == 200
        runner_start_bytes = rss_bytes(runner.pid)

        limit = asyncio.Semaphore(CONCURRENCY)

        async def classified(index: int) -> httpx.Response:
            async with limit:
                return await classify(index)

        async def in_turn(name: str, count: int) -> list[httpx.Response]:
            return [await call(name, float(index)) for index in range(count)]

        neighbours = asyncio.gather(*(classified(index) for index in range(CLASSIFIER_CALLS)))
        crashed, hung, leaked, misshapen = await asyncio.gather(
            in_turn("crasher", 6), in_turn("hang", 3), in_turn("leak", 12), in_turn("misshapen", 4)
        )
        answers = await neighbours

    for number, response in enumerate(answers):
        assert response.status_code == 200, response.text
        expected = session.run(["probabilities"], {"input": inputs[number]})[0]
        np.testing.assert_allclose(
            response.json()["outputs"]["probabilities"], expected, rtol=1e-5, atol=1e-7
        )

    assert crashed[0].json()["error"] == (
        "function 'crasher': its process exited with code 3 while running the batch; "
        "it starts again for the next batch"
    )
    for response in crashed:
        assert response.status_code == 500
        assert response.json()["code"] == "model_failed"
        assert "exited with code 3" in response.json()["error"]
    for response in hung:
        assert response.status_code == 504
        assert response.json() == {
            "error": "function 'hang': the batch ran past its execution timeout of 1000 ms; "
            "its process was stopped and starts again for the next batch",
            "code": "model_timeout",
        }
    # It keeps 20 MiB more a batch: its process is restarted once over its memory_limit_mb of 120
    # after a batch, or stopped in the batch that passes it (which fails, naming the limit).
    stopped = [response for response in leaked if response.status_code != 200]
    assert len(stopped) <= 3
    for response in stopped:
        assert response.status_code == 500
        assert "the batch needed more memory than its memory_limit_mb of 120 MiB" in response.json()["error"]
    for number, response in enumerate(leaked):
        if response.status_code == 200:
            assert response.json()["outputs"]["y"] == [[number * 2.0, 2.0, 4.0, 6.0]]
    for response in misshapen:
        assert response.status_code == 500
        assert response.json()["code"] == "model_failed"
        assert response.json()["error"].startswith(
            "function 'misshapen': output 'y' has shape [1, 7, 3], declared [-1, 4]: rank 3, not 2; "
            "it is float64, declared FP32"
        )

    assert runner.poll() is None
    for name in NEIGHBOURS:
        assert await redis.xlen(keys.dead_letters(name)) == 0, name
    assert await restarts(status, "leak", "memory") >= 1
    assert await restarts(status, "crasher", "exited") >= 1
    assert rss_bytes(runner.pid) < runner_start_bytes + RUNNER_MARGIN_BYTES
    for pid, cmdline in children(runner.pid).items():
        if "--function leak" in cmdline:  # recycled: never far over its memory_limit_mb of 120
            assert rss_bytes(pid) < 150 * 2**20


async def test_a_function_sees_no_secrets_and_dies_with_its_runner(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis_url: str,
    function_output: FunctionOutput,
) -> None:
    base = await serve_gateway()
    runner = runner_process(
        FNGATE_FUNCTIONS='["snoop"]',
        SNOOP_SETTING="visible",
        SERVICE_API_TOKEN="token-of-the-runner",
        AWS_SECRET_ACCESS_KEY="key-of-the-runner",
    )
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        response = await until_ok(lambda: client.post("/v1/functions/snoop", json=x_body()))
    assert response.status_code == 200, response.text
    await function_output.wait_for_any("snoop")
    view = json.loads(function_output.lines("snoop")[-1])
    seen = view["environ"]
    assert [name for name in seen if name.startswith(("FNGATE_", "AWS_"))] == []
    assert "SERVICE_API_TOKEN" not in seen
    assert redis_url not in json.dumps(seen)  # the Redis URL (and its password) stays with the runner
    assert seen["SNOOP_SETTING"] == "visible"  # a function's own settings pass
    assert view["ppid"] == runner.pid
    assert view["cwd"] == view["tempdir"]
    assert Path(view["cwd"]) != Path.cwd()

    runner.send_signal(signal.SIGKILL)
    runner.wait(timeout=10)
    for _ in range(100):  # it notices within half a second
        if not alive(view["pid"]):
            break
        await asyncio.sleep(0.1)
    assert not alive(view["pid"])


@dataclasses.dataclass(frozen=True)
class Secrets:
    """What a function must not reach: files of its runner's user (a state folder, a web identity
    token), a TCP port on loopback, and a folder it may not write in."""

    folder: Path
    state_file: Path
    token_file: Path
    tcp: tuple[str, int]

    def targets(self, redis_socket: str, other_model: Path, tcp: tuple[str, int] | None = None) -> str:
        files = [str(self.state_file), str(self.token_file), str(other_model), "/root/.bashrc"]
        return json.dumps(
            {
                "socket": redis_socket,
                "tcp": tcp or self.tcp,
                "files": files,
                "outside": str(self.folder / "planted"),
            }
        )

    def own(self, uid: int, gid: int) -> None:
        """Make them the files of user uid:gid (what a plain user's runner would hold)."""
        for path in [self.folder, *self.folder.rglob("*")]:
            os.chown(path, uid, gid)


@pytest.fixture
def secrets() -> Iterator[Secrets]:
    """In a folder any user can search (tmp_path's parents are root's alone), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="fngate-secrets-"))
    folder.chmod(0o755)
    state, token = folder / "state" / "admin.key", folder / "token"
    state.parent.mkdir(mode=0o700)
    state.write_text("fng_admin_key")
    token.write_text("web-identity-token")
    token.chmod(0o600)
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener:  # what a function must not connect to
            yield Secrets(folder, state, token, listener.getsockname())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def refused_everything(report: dict[str, str]) -> None:
    """Every try refused, but writing its own working folder."""
    assert report.pop("write its working folder") == "done: 1"
    allowed = {what: outcome for what, outcome in report.items() if not outcome.startswith("refused")}
    assert allowed == {}
    assert len(report) == 10


async def intrude(base: str) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        response = await until_ok(lambda: client.post("/v1/functions/intruder", json=x_body()))
    assert response.status_code == 200, response.text
    report: dict[str, str] = json.loads(response.json()["outputs"]["report"][0][0])
    return report


async def test_a_function_reaches_nothing_of_its_root_runner_and_cannot_flood_its_log(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis_url: str,
    repo: Path,
    secrets: Secrets,
    function_output: FunctionOutput,
    tmp_path: Path,
) -> None:
    """A root runner, as the tests run: its function's process (uid 0 without capabilities where
    the Python it runs is root's alone, as here; else FUNCTION_UID) cannot read the runner's
    environment or memory, reach Redis (socket or TCP), signal the runner, read root's files or
    another function's model, or write outside its folder. What it prints reaches the log as fields
    of records that name it, 64 KiB of it a batch, the rest counted."""
    base = await serve_gateway()
    runner = runner_process(
        FNGATE_FUNCTIONS='["intruder"]',
        INTRUDER_TARGETS=secrets.targets(
            redis_url.removeprefix("unix://"), repo / "classifier" / "model.onnx"
        ),
        AWS_WEB_IDENTITY_TOKEN_FILE=str(secrets.token_file),
    )
    refused_everything(await intrude(base))
    assert not (secrets.folder / "planted").exists()
    assert runner.poll() is None
    # A second batch within the minute: nothing more of it is logged, and by its start what the
    # first dropped has been said.
    refused_everything(await intrude(base))

    await function_output.wait_for_any("intruder", "to stderr")
    records = [record for record in function_output.records() if record["function"] == "intruder"]
    assert {(record["version"], record["stream"]) for record in records} == {("1", "stdout"), ("1", "stderr")}
    forged = [record["line"] for record in records if "forged" in record["line"]]
    assert json.loads(forged[0])["message"] == "forged"  # only ever a field of a record
    logged = sum(len(record["line"]) + 1 for record in records)
    assert 60 * 1024 < logged <= 64 * 1024  # of the 2 x 256 KiB it printed: the minute's budget
    for _ in range(200):
        log_lines = [json.loads(line) for line in (tmp_path / "runner-0.log").read_text().splitlines()]
        dropped = [line for line in log_lines if "dropped_lines" in line]
        if sum(line["dropped_bytes"] for line in dropped) >= 190 * 1024:
            break
        await asyncio.sleep(0.05)
    assert {line["function"] for line in dropped} == {"intruder"}
    assert sum(line["dropped_bytes"] for line in dropped) >= 190 * 1024  # the first batch's, at least
    assert [line for line in log_lines if line.get("message") == "forged"] == []


def python_for(uid: int, gid: int, stash: Path) -> list[str]:
    """A command prefix that runs a command as uid:gid (setpriv), in a mount namespace of its own
    where that user can run this interpreter: where the interpreter lives below a folder others
    cannot search (pyenv in /root, here), that folder is a world-searchable tmpfs holding only the
    interpreter's tree. Root only."""
    python = Path(sys.executable).resolve()
    hidden = next((folder for folder in reversed(python.parents) if not folder.stat().st_mode & 0o001), None)
    switch = [] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
    if hidden is None:
        return switch
    shown = python.parents[len(python.parents) - len(hidden.parts) - 1]
    script = (
        f"mount --bind {shown} {stash} && mount -t tmpfs -o mode=0755,size=1m fngate-test {hidden} && "
        f'mkdir -p {shown} && mount --bind {stash} {shown} && exec "$@"'
    )
    return ["unshare", "--mount", "--", "sh", "-c", script, "sh", *switch]


@pytest.fixture
def plain_user() -> Iterator[tuple[int, int]]:
    """A user made for the test (and deleted after it): uid and gid."""
    name = f"fngate-test-{os.getpid()}"
    add = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
    subprocess.run(add, check=True)
    try:
        yield pwd.getpwnam(name).pw_uid, pwd.getpwnam(name).pw_gid
    finally:
        subprocess.run(["userdel", name], check=False)


@dataclasses.dataclass(frozen=True)
class UserRunner:
    uid: int
    repo: Path
    log: Path


@pytest.fixture
def user_runner(
    plain_user: tuple[int, int], secrets: Secrets, tmp_path: Path
) -> Iterator[Callable[[str, str], UserRunner]]:
    """Factory: `python -m runner` as root ('root') or as plain_user ('plain'), in a namespace where
    that user can run this Python (python_for), on a repository that user can read (intruder and
    the poison functions), with the secrets that user's own; stopped and its folder removed after."""
    started: list[subprocess.Popen[bytes]] = []
    home = Path(tempfile.mkdtemp(prefix="fngate-user-"))  # readable by that user, unlike tmp_path
    home.chmod(0o755)

    def start(as_user: str, redis_url: str) -> UserRunner:
        """`redis_url`: a Redis on TCP (redis://127.0.0.1:PORT), which the function tries too."""
        address = redis_url.removeprefix("redis://").split(":")
        tcp = (address[0], int(address[1]))
        uid, gid = plain_user if as_user == "plain" else (0, 0)
        folder = home / "repo"
        # Only its memory hog is sent here: a long execution timeout, so that a busy machine's
        # slow batch still meets the memory limit first.
        write_poison_functions(folder, execution_timeout_ms=20_000)
        shutil.copytree(ROOT / "tests" / "functions" / "intruder", folder / "intruder")
        (home / "stash").mkdir()
        for path in [home, *home.rglob("*")]:
            os.chown(path, uid, gid)
        secrets.own(uid, gid)
        other_model = folder / "pick" / "model.onnx"
        env = child_env(
            redis_url,
            folder,
            FNGATE_FUNCTIONS='["intruder", "poison"]',
            FNGATE_ARTIFACT_DIR=str(home / "artifacts"),
            HOME=str(home),
            INTRUDER_TARGETS=secrets.targets(str(secrets.folder / "redis.sock"), other_model, tcp),
            AWS_WEB_IDENTITY_TOKEN_FILE=str(secrets.token_file),
        )
        log = tmp_path / "runner-0.log"
        with open(log, "wb") as out:
            command = [*python_for(uid, gid, home / "stash"), sys.executable, "-m", "runner"]
            started.append(subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
        return UserRunner(uid, folder, log)

    yield start
    stop_processes(started)
    shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("as_user", ["root", "plain"])
async def test_a_function_reaches_nothing_of_its_runner_whoever_runs_it(
    serve_gateway: Callable[..., Any],
    extra_redis: Callable[..., tuple[subprocess.Popen[bytes], str]],
    user_runner: Callable[[str, str], UserRunner],
    secrets: Secrets,
    as_user: str,
) -> None:
    """The same tries under a root runner whose Python FUNCTION_UID can run (its process is that
    user's) and under a runner of a plain user (its process is the runner's user; Landlock, the
    seccomp filter and the runner's non-dumpable state hold it), with Redis on TCP and the secrets
    the runner's user's own. The plain user's runner holds memory_limit_mb with RLIMIT_DATA."""
    port = free_port()
    extra_redis("--port", str(port), "--bind", "127.0.0.1")
    redis_url = f"redis://127.0.0.1:{port}"
    runner = user_runner(as_user, redis_url)
    base = await serve_gateway(redis_url=redis_url, repo=str(runner.repo))
    refused_everything(await intrude(base))
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        hog = await client.post("/v1/functions/poison", json=x_body(-5.0))
    assert hog.status_code == 500
    assert "needed more memory than its memory_limit_mb of 200 MiB" in hog.json()["error"]
    assert not (secrets.folder / "planted").exists()
    log = runner.log.read_text()
    who = f"as uid {confinement.FUNCTION_UID}:" if runner.uid == 0 else f"as uid {runner.uid}, as its runner"
    assert "function intruder runs in process" in log and who in log
    assert ("RLIMIT_DATA 200 MiB" in log) == bool(runner.uid)


async def test_a_stuck_in_process_model_gets_no_more_work_and_unload_says_so(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    repo: Path,
    tmp_path: Path,
) -> None:
    folder = tmp_path / "repo"
    build_slow_model(folder / "slow", execution_timeout_ms=300)
    shutil.copytree(repo / "classifier", folder / "classifier")
    base = await serve_gateway(repo=str(folder))
    runner = runner_process(FNGATE_REPO=str(folder), FNGATE_FUNCTIONS='["slow", "classifier"]')
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        loaded = await until_ok(lambda: client.post("/v1/functions/slow", json=x_body(1.0)))
        assert loaded.json()["outputs"]["y"] == [[1.0, 1.0, 2.0, 3.0]]

        # Twenty million turns of onnxruntime's loop: far past the function's 300 ms, and still
        # running at the unload below however fast the machine (the runner is killed at the end).
        stuck = await client.post("/v1/functions/slow", json=x_body(2e7))
        assert stuck.status_code == 504
        assert stuck.json()["code"] == "model_timeout"
        assert "ran past its execution timeout of 300 ms" in stuck.json()["error"]
        assert (await deployments.index(client))[("slow", "1")]["reason"].startswith(
            "stuck: a batch has run for"
        )

        # What a read already under way brought in is refused at once (503, retry)...
        early = await client.post("/v1/functions/slow", json={**x_body(2.0), "timeout_ms": 500})
        if early.status_code == 503:
            assert "this runner gives the function no work until it returns" in early.json()["error"]
        else:
            assert early.json()["code"] == "deadline_exceeded", early.text
        # ...then the runner leaves the function's work in the queue, for other runners...
        left = await client.post("/v1/functions/slow", json={**x_body(3.0), "timeout_ms": 500})
        assert left.status_code == 504, left.text
        assert left.json()["code"] == "deadline_exceeded"
        # ...and serves its other functions.
        classified = await client.post("/v1/functions/classifier", json={"inputs": {"input": [[0.5] * 16]}})
        assert classified.status_code == 200, classified.text

        unloaded = await client.post("/v2/repository/models/slow/unload")
        assert unloaded.status_code == 200, unloaded.text
        state = (await deployments.index(client))[("slow", "1")]
        assert state["state"] == "UNAVAILABLE"
        assert state["reason"].startswith("unloading: a batch has run for")
    runner.kill()  # its thread is still in the loop: it could only be killed at the drain timeout
    runner.wait()


def escapee_body(*rows: tuple[float, float]) -> dict[str, Any]:
    """tests/functions/escapee: each row's x[0] says what it tries, x[1] how much."""
    return {"inputs": {"x": [list(row) for row in rows]}}


async def daemon_of_a_runner(
    serve_gateway: Callable[..., Any], runner_process: Callable[..., subprocess.Popen[bytes]]
) -> tuple[subprocess.Popen[bytes], int]:
    """A runner serving escapee, and the pid of the setsid daemon its function started (alive, and
    no child of the runner's)."""
    base = await serve_gateway()
    runner = runner_process(FNGATE_FUNCTIONS='["escapee"]')
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        started = await until_ok(lambda: client.post("/v1/functions/escapee", json=escapee_body((1, 0))))
    assert started.status_code == 200, started.text
    daemon = int(started.json()["outputs"]["y"][0][0])
    assert alive(daemon) and daemon not in children(runner.pid)
    return runner, daemon


async def test_a_daemon_a_function_starts_is_killed_by_the_next_runner_after_its_runner_is_killed(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    runner, daemon = await daemon_of_a_runner(serve_gateway, runner_process)

    runner.send_signal(signal.SIGKILL)
    runner.wait(timeout=10)
    runner_process(FNGATE_FUNCTIONS="[]")  # the next runner on this machine
    # Any runner that starts on the machine reaps what a dead runner left (in a parallel test run
    # another test's runner may be first), so the daemon's end is what is asserted, not whose log
    # says it.
    for _ in range(300):
        if not alive(daemon):
            break
        await asyncio.sleep(0.1)
    assert not alive(daemon)


async def test_a_daemon_a_function_starts_goes_with_its_runners_exit(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    runner, daemon = await daemon_of_a_runner(serve_gateway, runner_process)
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(timeout=60) == 0
    assert not alive(daemon)


async def test_forks_stop_at_pids_limit_and_fail_their_batch_while_other_functions_answer(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
) -> None:
    base = await serve_gateway()
    runner_process(FNGATE_FUNCTIONS='["escapee", "classifier"]')
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=EVERY_CONNECTION_KEPT) as client:

        def classify() -> Awaitable[httpx.Response]:
            return client.post("/v1/functions/classifier", json={"inputs": {"input": [[0.5] * 16]}})

        assert (await until_ok(classify)).status_code == 200
        assert (
            await until_ok(lambda: client.post("/v1/functions/escapee", json=escapee_body((0, 0))))
        ).status_code == 200
        bomb = client.post("/v1/functions/escapee", json=escapee_body((2, 100_000)))
        *classified, bombed = await asyncio.gather(*(classify() for _ in range(40)), bomb)
        again = await client.post("/v1/functions/escapee", json=escapee_body((0, 0)))
    assert [response.status_code for response in classified] == [200] * 40
    assert bombed.status_code == 500, bombed.text
    assert bombed.json()["code"] == "model_failed"
    message = bombed.json()["error"]
    found = re.search(r"forked (\d+) processes, then: \[Errno 11\] Resource temporarily unavailable", message)
    assert found is not None and int(found.group(1)) < 32, message
    assert "its processes reached its pids_limit of 32: they were stopped" in message
    assert again.status_code == 200 and again.json()["outputs"]["y"] == [["ok"]]


async def test_an_answer_past_max_output_bytes_fails_alone_and_its_batch_mates_are_answered(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    redis: aioredis.Redis,
) -> None:
    """escapee's max_output_bytes is 1 MiB: one invocation answers 2 MB (its batch passes the
    process's own check: the runner refuses it alone), another 10 MB (its batch is refused in the
    process, then split: each alone)."""
    base = await serve_gateway()
    runner = runner_process(FNGATE_FUNCTIONS='["escapee"]')
    sizes = [100, 2_000_000, 100, 10_000_000, 100, 100]
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        assert (
            await until_ok(lambda: client.post("/v1/functions/escapee", json=escapee_body((0, 0))))
        ).status_code == 200
        answers = await asyncio.gather(
            *(client.post("/v1/functions/escapee", json=escapee_body((3, size))) for size in sizes)
        )
    for size, response in zip(sizes, answers, strict=True):
        if size == 100:
            assert response.status_code == 200, response.text
            assert response.json()["outputs"]["y"] == [["x" * 100]]
            continue
        assert response.status_code == 500
        assert response.json() == {
            "error": f"function 'escapee': the outputs of this invocation are {size + 4} bytes, over its "
            "max_output_bytes of 1048576",
            "code": "model_failed",
        }
    assert runner.poll() is None
    assert await redis.xlen(keys.dead_letters("escapee")) == 0
