"""`fngate up`: a whole deployment on one machine. Starts a private redis-server (unless given a
URL), the runner processes and the gateway as child processes, restarts runners that die, and
stops everything in order on Ctrl-C or SIGTERM (gateway first, then runners drain, then Redis)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis

POLL_S = 0.5
ROW = ", ".join(f"{0.1 * i:.1f}" for i in range(1, 17))
EXAMPLE = f'{{"inputs": {{"input": [[{ROW}]]}}}}'


class LocalError(Exception):
    pass


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server on a unix socket in a private folder, no persistence. Yields its URL."""
    server = shutil.which("redis-server")
    if server is None:
        raise LocalError("redis-server is not installed: run scripts/bootstrap, or pass --redis URL")
    with tempfile.TemporaryDirectory(prefix="fngate-redis-") as folder:
        sock = Path(folder) / "redis.sock"
        process = subprocess.Popen(
            [
                server,
                "--port",
                "0",
                "--unixsocket",
                str(sock),
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                folder,
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            url = f"unix://{sock}"
            _wait_for_redis(url, process)
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
    repo = Path(args.repo)
    if not repo.is_dir():
        print(f"fngate up: repository folder {repo} does not exist", file=sys.stderr)
        return 2
    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        with contextlib.ExitStack() as stack:
            redis_url = args.redis or stack.enter_context(private_redis())
            env = {
                **os.environ,
                "FNGATE_REDIS_URL": redis_url,
                "FNGATE_REPO": str(repo.resolve()),
                "FNGATE_LOG_LEVEL": args.log_level,
            }
            runners = [_spawn("runner", env) for _ in range(args.runners)]
            gateway = _spawn(
                "gateway",
                {
                    **env,
                    "FNGATE_HOST": args.host,
                    "FNGATE_PORT": str(args.port),
                    "FNGATE_WORKERS": str(args.gateway_workers),
                },
            )
            _banner(args, repo, redis_url)
            try:
                while not stopping:
                    time.sleep(POLL_S)
                    if gateway.poll() is not None:
                        print(
                            f"fngate up: the gateway exited with code {gateway.returncode}", file=sys.stderr
                        )
                        return 1
                    for index, runner in enumerate(runners):
                        if runner.poll() is not None and not stopping:
                            print(
                                f"fngate up: runner exited with code {runner.returncode}; restarting",
                                file=sys.stderr,
                            )
                            runners[index] = _spawn("runner", env)
            finally:
                _stop([gateway], timeout_s=15)
                _stop(runners, timeout_s=35)
    except LocalError as exc:
        print(f"fngate up: {exc}", file=sys.stderr)
        return 1
    return 0


def _stop(processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _banner(args: argparse.Namespace, repo: Path, redis_url: str) -> None:
    base = f"http://{args.host}:{args.port}"
    print(
        f"fngate up: gateway {base}, {args.runners} runner(s), repository {repo}, redis {redis_url}\n"
        f"  curl -s {base}/v1/functions\n"
        f"  curl -s -X POST {base}/v1/functions/classifier "
        f"-d '{EXAMPLE}'\n"
        "  Ctrl-C stops everything.",
        flush=True,
    )
