"""`fngate up`: a whole deployment on one machine. Starts a private redis-server (unless given a
URL) that keeps its data in an append-only file in the state folder, the gateway, and the local
scaler, which starts runner processes when work arrives and reaps them when they stop idle. A Redis
or gateway that dies is restarted with backoff; Ctrl-C or SIGTERM stops everything in order: the
gateway first, then the runners drain, then Redis. The gateway's HTTP and gRPC ports are listened
on here and handed to each gateway process it starts: a gateway that dies leaves them open, and
the connections that arrive while it restarts wait in their backlog for the next one."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import redis

from fngate import __version__, apikeys, clients, telemetry
from fngate.backoff import Backoff
from fngate.cli.examples import example_body
from fngate.errors import FunctionError
from fngate.process import batch_at_exec, ends_with_parent, module_command, stop_processes
from fngate.registry import function_source
from fngate.repository import is_remote, open_repository
from fngate.up.scaler import LocalScaler, PoolSpec, pool_specs
from fngate.up.state import UpState, clear_up, read_up, state_dir, write_up

log = logging.getLogger("fngate.up")
POLL_S = 0.5
STABLE_S = 30.0
"""A process that ran this long before it died is restarted after the shortest backoff again."""


class LocalError(Exception):
    pass


MAX_SOCKET_PATH = 107
"""The longest path a unix socket may have on Linux (sun_path holds 108 bytes with its NUL)."""


def durable_options(max_memory: str) -> list[str]:
    """Every write in an append-only file (written before the client hears OK; flushed to disk
    every second), and a memory limit with nothing ever evicted (noeviction: past it, writes fail):
    an evicted key could be a result, a heartbeat or a queue's marker, never just a cache entry.
    Asynchronous submissions are refused from ASYNC_MEMORY_RATIO of it (fngate.queue), so that
    results never crowd out what the queue needs."""
    return [
        "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
        "--maxmemory", max_memory, "--maxmemory-policy", "noeviction",
    ]  # fmt: skip


def start_redis(
    folder: Path, *args: str, keep_fds: tuple[int, ...] = (), batch: bool = False
) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server on a unix socket in `folder`, no persistence unless `args` turn it on,
    answering; returns it and its URL. `args` are extra server options (a memory limit, say); it
    holds `keep_fds` open (a lock) for as long as it runs, writes its files for its user alone,
    ends when this process dies, and runs under SCHED_BATCH with `batch` (as fngate up's gateway
    and runners do: fngate.process.batch_at_exec)."""
    server = shutil.which("redis-server")
    if server is None:
        raise LocalError("redis-server is not installed: run scripts/bootstrap, or pass --redis URL")
    sock = folder / "redis.sock"
    if len(os.fsencode(sock)) > MAX_SOCKET_PATH:
        raise LocalError(
            f"the Redis socket's path {sock} is longer than a unix socket's {MAX_SOCKET_PATH} bytes: "
            "use a shorter state folder (XDG_STATE_HOME), or pass --redis URL"
        )
    options = ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
    if "--appendonly" not in args:
        options += ["--save", "", "--appendonly", "no"]
    options += ["--dir", str(folder), "--loglevel", "warning", *args]
    arm = ends_with_parent(signal.SIGTERM)
    process = subprocess.Popen(
        [server, *options],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        pass_fds=keep_fds,
        umask=0o077,
        preexec_fn=batch_at_exec(arm) if batch else arm,  # noqa: PLW1509 (a prctl and a policy only)
    )
    url = f"unix://{sock}"
    if batch and hasattr(os, "SCHED_BATCH") and os.sched_getscheduler(process.pid) != os.SCHED_BATCH:
        log.warning("redis-server is not under SCHED_BATCH: this system refused it")
    try:
        _wait_for_redis(url, process)
    except LocalError:
        process.kill()
        raise
    return process, url


@contextlib.contextmanager
def private_redis(batch: bool = False) -> Iterator[str]:
    """A throwaway redis-server in a private folder, stopped and deleted on exit (the benchmark's).
    Yields its URL."""
    with tempfile.TemporaryDirectory(prefix="fngate-redis-") as folder:
        process, url = start_redis(Path(folder), batch=batch)
        try:
            yield url
        finally:
            process.terminate()
            process.wait(timeout=10)


LOCK_WAIT_S = 15.0
"""How long a new `fngate up` waits for the processes of one that died (they end with it) to let
go of its state folder."""


@contextlib.contextmanager
def state_folder(path: Path) -> Iterator[tuple[Path, int]]:
    """The state folder (mode 0700, its files 0600), created if missing and locked for this
    `fngate up`; never deleted. Yields it and the lock's descriptor: a child that holds it open
    keeps the folder locked until it exits."""
    folder = path.expanduser().resolve()
    for private in (folder, folder / "redis"):
        private.mkdir(parents=True, exist_ok=True, mode=0o700)
        private.chmod(0o700)
    earlier = [*(folder / "redis").rglob("*"), *(folder / name for name in ("admin.key", "callback.secret"))]
    for item in earlier:  # written before, by another umask
        with contextlib.suppress(FileNotFoundError):
            item.chmod(0o700 if item.is_dir() else 0o600)
    descriptor = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(descriptor, "w") as lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # A live fngate up: refused at once. One that died: its children are ending.
                if read_up(state_dir(path)) is not None or time.monotonic() > deadline:
                    raise LocalError(
                        f"another fngate up uses the state folder {folder}; pass --state-dir"
                    ) from None
                time.sleep(0.2)
        yield folder, lock.fileno()


class Supervised:
    """A child process that is started again, after a growing delay, when it dies unasked."""

    def __init__(
        self,
        name: str,
        start: Callable[[], subprocess.Popen[bytes]],
        process: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.name = name
        self._start = start
        self.process = process or start()
        self._started_at = time.monotonic()
        self._backoff = Backoff(base_s=0.2, cap_s=10.0)
        self.restarts = 0

    async def watch(self, stopping: asyncio.Event, before_restart: Callable[[], None] | None = None) -> None:
        """Until `stopping`: whenever the process has exited, log it and start it again."""
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await stopping.wait()
            code = self.process.poll()
            if code is None or stopping.is_set():
                continue
            if time.monotonic() - self._started_at >= STABLE_S:
                self._backoff.succeeded()
            delay_s = self._backoff.failed()
            log.error("%s exited with %s; restarting it in %.1f s", self.name, _describe(code), delay_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_s):
                    await stopping.wait()
            if stopping.is_set():
                return
            if before_restart is not None:
                before_restart()
            try:
                self.process = await asyncio.to_thread(self._start)
            except LocalError as exc:
                log.error("%s did not start again: %s", self.name, exc)
                continue
            self._started_at = time.monotonic()
            self.restarts += 1
            log.info("%s restarted (pid %d)", self.name, self.process.pid)


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def _wait_for_redis(url: str, process: subprocess.Popen[bytes], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis.from_url(url)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LocalError(f"redis-server exited with code {process.returncode}")
        with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError, FileNotFoundError):
            if client.ping():
                return
        time.sleep(0.05)
    raise LocalError(f"redis-server did not answer within {timeout_s:.0f} s")


def _spawn(
    module: str,
    env: dict[str, str],
    pass_fds: tuple[int, ...] = (),
    args: tuple[str, ...] = (),
    python: str = "",
) -> subprocess.Popen[bytes]:
    # A session of its own: Ctrl-C reaches only us, and we stop the children in order. Killed
    # with us, so that a restart finds the port free.
    return subprocess.Popen(
        module_command(module, *args, python=python),
        env=env,
        start_new_session=True,
        pass_fds=pass_fds,
        preexec_fn=ends_with_parent(signal.SIGKILL),  # noqa: PLW1509 (a prctl only)
    )


BACKLOG = 2048
"""Connections a listening port holds for the gateway: those that arrive while it restarts wait
here (a second or two), then the new process accepts them."""


def listen(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A socket listening on host:port for the gateway processes to come (port 0: any free one);
    LocalError with port_problem's message when it cannot be."""
    try:
        return socket.create_server((host, port), family=_family(host), backlog=BACKLOG)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise LocalError(
            f"cannot listen on {host}:{port} ({reason}); is another fngate running? pass {flag} N"
        ) from None


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a name: what it resolves to first
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]


def runner_python(python: str) -> str:
    """`--runner-python`: the interpreter runners start with, checked before anything starts (it
    must import this very fngate); '' for this one's. LocalError says what is wrong."""
    if not python:
        return ""
    path = Path(python).expanduser()
    if not path.is_file() or not os.access(path, os.X_OK):
        raise LocalError(f"--runner-python {python}: no executable file there")
    check = "import fngate, runner; print(fngate.__version__)"
    try:
        done = subprocess.run(
            [str(path), "-P", "-c", check], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LocalError(f"--runner-python {python} could not be run: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise LocalError(
            f"--runner-python {python} cannot import fngate's runner ({last}): install fngate into "
            f"that environment (`{python} -m pip install fngate[cpu]`, or `-e .` from a checkout)"
        )
    if done.stdout.strip() != __version__:
        raise LocalError(
            f"--runner-python {python} has fngate {done.stdout.strip()}, and this fngate up is "
            f"{__version__}: install the same version there"
        )
    return str(path.absolute())


def run_local(args: argparse.Namespace) -> int:
    repo = str(args.repo)
    if not is_remote(repo) and not Path(repo).is_dir():
        print(f"fngate up: repository folder {repo} does not exist", file=sys.stderr)
        return 2
    try:
        args.runner_python = runner_python(getattr(args, "runner_python", "") or "")
    except LocalError as exc:
        print(f"fngate up: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "reload", False) and is_remote(repo):
        print(f"fngate up: --reload watches a folder; {repo} is not one", file=sys.stderr)
        return 2
    busy = port_problem("127.0.0.1", args.metrics_port, "--metrics-port")
    try:
        # Before anything starts: a port in use stops fngate up at once, by its flag.
        listeners = [listen(args.host, args.port)]
        if args.grpc_port:
            listeners.append(listen(args.host, args.grpc_port, "--grpc-port"))
    except LocalError as exc:
        busy = busy or str(exc)
    if busy:
        print(f"fngate up: {busy}", file=sys.stderr)
        return 2
    telemetry.configure("up", args.log_level)
    try:
        with contextlib.ExitStack() as stack:
            for listener in listeners:
                stack.enter_context(listener)
            redis_server: Supervised | None = None
            if args.redis:
                redis_url = args.redis
            else:
                folder, lock = stack.enter_context(state_folder(Path(args.state_dir)))
                options = durable_options(args.redis_max_memory)
                # Redis holds the lock too: a new fngate up waits until this one's Redis is gone.
                batch = args.sched_batch
                process, redis_url = start_redis(folder / "redis", *options, keep_fds=(lock,), batch=batch)
                redis_server = Supervised(
                    "redis-server",
                    lambda: start_redis(folder / "redis", *options, keep_fds=(lock,), batch=batch)[0],
                    process,
                )
            port = listeners[0].getsockname()[1]
            state = stack.enter_context(_state(args, repo, redis_url, port))
            try:
                return _run(args, state, redis_server, listeners)
            finally:
                if redis_server is not None:
                    stop_processes([redis_server.process], timeout_s=10)
    except LocalError as exc:
        print(f"fngate up: {exc}", file=sys.stderr)
        return 1


def _run(
    args: argparse.Namespace, state: UpState, redis_server: Supervised | None, listeners: list[socket.socket]
) -> int:
    """`listeners`: the HTTP port's socket, then gRPC's when it has one."""
    env = {
        **os.environ,
        "FNGATE_REDIS_URL": state.redis_url,
        "FNGATE_REPO": state.repo,
        "FNGATE_LOG_LEVEL": args.log_level,
        "FNGATE_SCHED_BATCH": str(args.sched_batch).lower(),
    }
    api_key = _auth(args, state.redis_url, env)
    gateway_env = {
        **env,
        **_callbacks(args),
        "FNGATE_HOST": args.host,
        "FNGATE_PORT": str(listeners[0].getsockname()[1]),
        "FNGATE_BIND": f"fd://{listeners[0].fileno()}",
        "FNGATE_GRPC_PORT": str(args.grpc_port),
        "FNGATE_GRPC_BIND": f"fd://{listeners[1].fileno()}" if len(listeners) > 1 else "",
        "FNGATE_WORKERS": str(args.gateway_workers),
        "FNGATE_SERVER": args.server,
        **({"FNGATE_SERVER_NAME": args.server_name} if args.server_name else {}),
        **({"FNGATE_ALLOW_CLIENT_SHM": "true"} if args.allow_client_shm else {}),
        "FNGATE_METRICS_PORT": str(args.metrics_port),
        "FNGATE_METRICS_HOST": "127.0.0.1",  # no key on it: this machine only
    }
    fds = tuple(listener.fileno() for listener in listeners)
    gateway = Supervised("the gateway", lambda: _spawn("gateway", gateway_env, fds))
    try:
        grpc_port = listeners[1].getsockname()[1] if len(listeners) > 1 else 0
        _banner(state, api_key, grpc_port, args.metrics_port)
        asyncio.run(_serve(gateway, redis_server, env, args))
        return 0
    finally:
        _stop_group(gateway.process, timeout_s=15)


def _stop_group(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Stop a process we started in a session of its own, and whatever it left behind (a gateway
    killed with SIGKILL leaves its workers holding the port)."""
    stop_processes([process], timeout_s=timeout_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


async def _serve(
    gateway: Supervised, redis_server: Supervised | None, env: dict[str, str], args: argparse.Namespace
) -> None:
    """The scaler starts and reaps runners, and dead processes are started again, until Ctrl-C or
    SIGTERM."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    client = clients.connect(env["FNGATE_REDIS_URL"], socket_connect_timeout=2, socket_timeout=5)
    source = function_source(env["FNGATE_REPO"], client)

    async def pools() -> dict[str, PoolSpec]:
        return pool_specs(await source())

    scaler = LocalScaler(
        client,
        pools,
        env,
        idle_shutdown_s=args.idle_shutdown_s,
        standby=getattr(args, "standby_runner", True),
        python=args.runner_python,
    )
    gateway_down = asyncio.Event()

    async def gateway_first() -> None:
        """Until asked to stop; then the gateway goes first, so nothing new arrives while runners drain."""
        await gateway.watch(stopping, before_restart=lambda: _stop_group(gateway.process, 1))
        await asyncio.to_thread(_stop_group, gateway.process, 15)
        gateway_down.set()

    completer = None
    if not is_remote(env["FNGATE_REPO"]):
        # Python models with no config.pbtxt: their auto_complete_config, run confined, recorded in Redis.
        repo_args = ("--repo", env["FNGATE_REPO"], "--redis", env["FNGATE_REDIS_URL"])
        completer = Supervised(
            "the auto-complete of Python models",
            lambda: _spawn("runner.triton.complete", env, args=repo_args, python=args.runner_python),
        )
    try:
        async with client, asyncio.TaskGroup() as tasks:
            tasks.create_task(gateway_first())
            tasks.create_task(scaler.run(gateway_down))
            if completer is not None:
                tasks.create_task(completer.watch(stopping))
            if redis_server is not None:
                tasks.create_task(redis_server.watch(stopping))
            if getattr(args, "reload", False):
                from fngate.up.reload import ReloadWatch

                tasks.create_task(ReloadWatch(open_repository(env["FNGATE_REPO"]), client).run(stopping))
    finally:
        if completer is not None:
            await asyncio.to_thread(_stop_group, completer.process, 5)


def port_problem(host: str, port: int, flag: str = "--port") -> str:
    """Why the gateway could not bind host:port, checked before anything starts ('' if it can)."""
    if port == 0:
        return ""
    try:
        socket.create_server((host, port)).close()
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        return f"cannot listen on {host}:{port} ({reason}); is another fngate running? pass {flag} N"
    return ""


@contextlib.contextmanager
def _state(args: argparse.Namespace, repo: str, redis_url: str, port: int) -> Iterator[UpState]:
    """Leave the gateway, Redis and repository in the state folder while we run, for other commands."""
    folder = state_dir(getattr(args, "state_dir", None))
    host = f"[{args.host}]" if ":" in args.host else args.host
    state = UpState(
        gateway_url=f"http://{host}:{port}",
        redis_url=redis_url,
        repo=repo if is_remote(repo) else str(Path(repo).resolve()),
        pid=os.getpid(),
    )
    try:
        write_up(state, folder)
    except OSError as exc:
        print(
            f"fngate up: cannot write {folder} ({exc.strerror}); other commands need --redis", file=sys.stderr
        )
    try:
        yield state
    finally:
        clear_up(folder, state.pid)


# Private by default: auth on with an admin key kept in the state folder; runners' status ports on
# loopback. --no-auth only when nothing but this machine can reach the gateway.
def _auth(args: argparse.Namespace, redis_url: str, env: dict[str, str]) -> str | None:
    """Set the gateway's and runners' variables; the admin key, or None with auth off."""
    env["FNGATE_STATUS_HOST"] = "127.0.0.1"
    if args.no_auth:
        if not _is_loopback(args.host):
            raise LocalError(
                f"--no-auth needs a loopback --host (127.0.0.1, ::1, localhost), not {args.host}"
            )
        env["FNGATE_AUTH"] = "false"
        return None
    env["FNGATE_AUTH"] = "true"
    path = Path(args.state_dir).expanduser() / "admin.key"
    try:
        key, created = apikeys.admin_key(clients.connect_sync(redis_url, socket_connect_timeout=3), path)
    except (redis.RedisError, OSError) as exc:
        raise LocalError(f"could not set up the admin API key in {path}: {exc}") from exc
    print(f"fngate up: {'created the admin API key' if created else 'admin API key'} in {path}", flush=True)
    return key


def _callbacks(args: argparse.Namespace) -> dict[str, str]:
    """The gateway's callback settings: always signed, with a secret kept in the state folder
    (0600; FNGATE_CALLBACK_SECRET overrides it), and the receivers --callback-allow lets in."""
    env = {"FNGATE_CALLBACK_ALLOW": args.callback_allow} if getattr(args, "callback_allow", None) else {}
    if os.environ.get("FNGATE_CALLBACK_SECRET"):
        return env
    path = Path(args.state_dir).expanduser() / "callback.secret"
    try:
        secret = path.read_text().strip()
        if not secret:
            raise FileNotFoundError(path)
    except FileNotFoundError:
        secret = secrets.token_urlsafe(32)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as file:
            file.write(secret + "\n")
    except OSError as exc:
        raise LocalError(f"could not read the callback signing secret in {path}: {exc}") from exc
    print(f"fngate up: callbacks are signed (X-Fngate-Signature) with the secret in {path}", flush=True)
    return {**env, "FNGATE_CALLBACK_SECRET": secret}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _banner(state: UpState, api_key: str | None, grpc_port: int = 0, metrics_port: int = 0) -> None:
    base = state.gateway_url
    auth = f' -H "Authorization: Bearer {api_key}"' if api_key else ""
    key_line = f"  admin API key: {api_key} (FNGATE_API_KEY for fngate deploy --gateway)\n" if api_key else ""
    host = base.removeprefix("http://").rpartition(":")[0]
    grpc_line = f"  gRPC (Open Inference Protocol, as Triton's): {host}:{grpc_port}\n" if grpc_port else ""
    metrics = (
        f"  Prometheus metrics, Triton's names too: http://127.0.0.1:{metrics_port}/metrics\n"
        if metrics_port
        else ""
    )
    print(
        f"fngate up: gateway {base}, repository {state.repo}, redis {state.redis_url}\n"
        f"{grpc_line}{metrics}"
        f"{key_line}"
        "  runners start on the first invocation of their pool and stop when idle\n"
        f"  curl -s{auth} {base}/v1/functions",
        flush=True,
    )
    example = example_invocation(state.repo)
    if example is not None:
        name, body = example
        print(f"  curl -s -X POST{auth} {base}/v1/functions/{name} -d '{body}'", flush=True)
    else:
        print("  no function in the repository yet: fngate deploy FILE adds one", flush=True)
    print("  Ctrl-C stops everything.", flush=True)


def example_invocation(repo: str) -> tuple[str, str] | None:
    """A function of the repository and a body to call it with (the classifier when there is one)."""
    if is_remote(repo):
        return None
    try:
        records = open_repository(repo).scan()
    except (FunctionError, OSError):
        return None
    for name in sorted(records, key=lambda name: (name != "classifier", name)):
        record = records[name]
        body = example_body((record.default or record.newest()).manifest)
        if body is not None:
            return name, body
    return None
