"""`fngate up`: a whole deployment on one machine. Starts a private redis-server (unless given a
URL) and the gateway, and runs the local scaler, which starts runner processes when work arrives
and reaps them when they stop idle. Ctrl-C or SIGTERM stops everything in order: the gateway first,
then the runners drain, then Redis."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis
import redis.asyncio as aioredis

from fngate import apikeys, telemetry
from fngate.deploy import example_body
from fngate.errors import FunctionError
from fngate.process import stop_processes
from fngate.registry import function_source
from fngate.repository import is_remote, open_repository
from fngate.scaler import LocalScaler, PoolSpec, pool_specs
from fngate.state import UpState, clear_up, state_dir, write_up

POLL_S = 0.5


class LocalError(Exception):
    pass


def start_redis(folder: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server on a unix socket in `folder`, no persistence, answering; returns it and its URL.
    `args` are extra server options (a memory limit, say)."""
    server = shutil.which("redis-server")
    if server is None:
        raise LocalError("redis-server is not installed: run scripts/bootstrap, or pass --redis URL")
    sock = folder / "redis.sock"
    options = ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700", "--save", ""]
    options += ["--appendonly", "no", "--dir", str(folder), "--loglevel", "warning", *args]
    process = subprocess.Popen([server, *options], stdout=subprocess.DEVNULL, start_new_session=True)
    url = f"unix://{sock}"
    try:
        _wait_for_redis(url, process)
    except LocalError:
        process.kill()
        raise
    return process, url


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server of our own in a private folder, stopped on exit. Yields its URL."""
    with tempfile.TemporaryDirectory(prefix="fngate-redis-") as folder:
        process, url = start_redis(Path(folder))
        try:
            yield url
        finally:
            process.terminate()
            process.wait(timeout=10)


def _wait_for_redis(url: str, process: subprocess.Popen[bytes], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis.from_url(url)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LocalError(f"redis-server exited with code {process.returncode}")
        with contextlib.suppress(redis.ConnectionError, FileNotFoundError):
            if client.ping():
                return
        time.sleep(0.05)
    raise LocalError(f"redis-server did not answer within {timeout_s:.0f} s")


def _spawn(module: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    # A session of its own: Ctrl-C reaches only us, and we stop the children in order.
    return subprocess.Popen([sys.executable, "-m", module], env=env, start_new_session=True)


def run_local(args: argparse.Namespace) -> int:
    repo = str(args.repo)
    if not is_remote(repo) and not Path(repo).is_dir():
        print(f"fngate up: repository folder {repo} does not exist", file=sys.stderr)
        return 2
    busy = port_problem(args.host, args.port)
    if busy:
        print(f"fngate up: {busy}", file=sys.stderr)
        return 2
    telemetry.configure("up", args.log_level)
    try:
        with contextlib.ExitStack() as stack:
            redis_url = args.redis or stack.enter_context(private_redis())
            state = stack.enter_context(_state(args, repo, redis_url))
            env = {
                **os.environ,
                "FNGATE_REDIS_URL": redis_url,
                "FNGATE_REPO": repo if is_remote(repo) else str(Path(repo).resolve()),
                "FNGATE_LOG_LEVEL": args.log_level,
            }
            api_key = _auth(args, redis_url, env)
            gateway = _spawn(
                "gateway",
                {
                    **env,
                    "FNGATE_HOST": args.host,
                    "FNGATE_PORT": str(args.port),
                    "FNGATE_WORKERS": str(args.gateway_workers),
                    "FNGATE_SERVER": args.server,
                },
            )
            try:
                _banner(state, api_key)
                return asyncio.run(_serve(gateway, env, args))
            finally:
                stop_processes([gateway], timeout_s=15)
    except LocalError as exc:
        print(f"fngate up: {exc}", file=sys.stderr)
        return 1


async def _serve(gateway: subprocess.Popen[bytes], env: dict[str, str], args: argparse.Namespace) -> int:
    """The scaler starts and reaps runners until Ctrl-C or SIGTERM, or until the gateway dies."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    client = aioredis.from_url(env["FNGATE_REDIS_URL"])
    source = function_source(env["FNGATE_REPO"], client)

    async def pools() -> dict[str, PoolSpec]:
        return pool_specs(await source())

    scaler = LocalScaler(client, pools, env, idle_shutdown_s=args.idle_shutdown_s)
    code = 0

    gateway_down = asyncio.Event()

    async def watch_gateway() -> None:
        """Until asked to stop; then the gateway goes first, so nothing new arrives while runners drain."""
        nonlocal code
        while gateway.poll() is None and not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await stopping.wait()
        if not stopping.is_set():
            print(f"fngate up: the gateway exited with code {gateway.returncode}", file=sys.stderr)
            code = 1
        await asyncio.to_thread(stop_processes, [gateway], 15)
        gateway_down.set()

    async with client, asyncio.TaskGroup() as tasks:
        tasks.create_task(watch_gateway())
        tasks.create_task(scaler.run(gateway_down))
    return code


def port_problem(host: str, port: int) -> str:
    """Why the gateway could not bind host:port, checked before anything starts ('' if it can)."""
    if port == 0:
        return ""
    try:
        socket.create_server((host, port)).close()
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        return f"cannot listen on {host}:{port} ({reason}); is another fngate running? pass --port N"
    return ""


@contextlib.contextmanager
def _state(args: argparse.Namespace, repo: str, redis_url: str) -> Iterator[UpState]:
    """Leave the gateway, Redis and repository in the state folder while we run, for other commands."""
    folder = state_dir(getattr(args, "state_dir", None))
    state = UpState(
        gateway_url=f"http://{args.host}:{args.port}",
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
        key, created = apikeys.admin_key(redis.Redis.from_url(redis_url, socket_connect_timeout=3), path)
    except (redis.RedisError, OSError) as exc:
        raise LocalError(f"could not set up the admin API key in {path}: {exc}") from exc
    print(f"fngate up: {'created the admin API key' if created else 'admin API key'} in {path}", flush=True)
    return key


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _banner(state: UpState, api_key: str | None) -> None:
    base = state.gateway_url
    auth = f' -H "Authorization: Bearer {api_key}"' if api_key else ""
    key_line = f"  admin API key: {api_key} (FNGATE_API_KEY for fngate deploy --gateway)\n" if api_key else ""
    print(
        f"fngate up: gateway {base}, repository {state.repo}, redis {state.redis_url}\n"
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
