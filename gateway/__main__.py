"""settings -> server (uvicorn or Hypercorn) -> serve the app until `stopping` is set.

With workers > 1 this process binds the port and supervises that many single-worker gateway
processes serving it (each with its own reply stream and its own listening socket), restarting
any that dies. Given listening sockets (`bind` and `grpc_bind` as `fd://N`: `fngate up`'s, which
outlive this process), its workers all serve those instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from fngate import status_port, telemetry
from fngate.backoff import backoff_s, until_done
from fngate.config import GatewaySettings, unknown_variables
from fngate.process import ends_with_parent, module_command, run_forever, schedule

log = logging.getLogger("gateway")

STABLE_S = 30.0
"""A worker that ran this long before dying is restarted at once; one that keeps dying, with backoff."""


async def run(settings: GatewaySettings) -> None:
    # The app's imports are a worker's, not a supervisor's (workers > 1): 30 MB it does not need.
    from redis.exceptions import RedisError

    from fngate import clients
    from gateway.app import create_app
    from gateway.http import metrics_port
    from gateway.http.server import SERVERS

    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    # Redis first, while these handlers hold: the servers' own ones cannot end a lifespan's wait.
    timeout_s = settings.redis_timeout_s
    async with clients.connect(settings.redis_url, socket_connect_timeout=timeout_s) as redis:
        if not await until_done(redis.ping, (RedisError, OSError), "redis", stopping):
            return
    app = create_app(settings, stopping)
    async with metrics_port.serving(settings):
        await SERVERS[settings.server](app, settings, stopping)


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets listening on one port with SO_REUSEPORT, one per worker: the kernel spreads
    new connections over them by a hash of each connection's addresses, so every worker gets its
    share. (On one shared socket, whichever worker's loop wakes first accepts: one busy worker
    could take every connection of a burst while the other idles.)"""
    # First a plain bind, which any other holder of the port refuses ("address in use"), another
    # fngate among them: sockets with SO_REUSEPORT of one user would share the port instead.
    with socket.create_server((host, port)) as probe:
        port = probe.getsockname()[1]
    return [_listener(host, port) for _ in range(count)]


def _listener(host: str, port: int) -> socket.socket:
    return socket.create_server((host, port), backlog=2048, reuse_port=True)


def inherited(bind: str) -> socket.socket | None:
    """The listening socket an `fd://N` bind names, or None."""
    if not bind.startswith("fd://"):
        return None
    return socket.socket(fileno=int(bind.removeprefix("fd://")))


def supervise(settings: GatewaySettings) -> int:
    """Bind the port, keep `workers` gateway processes serving it, each on a listening socket of
    its own (a worker that dies is started again on its socket, where the connections that came
    meanwhile wait; one that keeps dying is started with backoff, on a new socket, and the
    connections its old one held are refused rather than left waiting), and stop them together
    when asked. Given a listening socket (`fd://N`), every worker serves that one, and so does
    gRPC's (`grpc_bind`) when given."""
    shared = inherited(settings.bind)
    socks = (
        [shared] * settings.workers
        if shared
        else listening_sockets(settings.host, settings.port, settings.workers)
    )
    port = socks[0].getsockname()[1]
    grpc_fds = (
        [int(settings.grpc_bind.removeprefix("fd://"))] if settings.grpc_bind.startswith("fd://") else []
    )
    metrics_host = settings.metrics_host or settings.host
    metrics_sock = status_port.bind(metrics_host, settings.metrics_port, "metrics")  # every worker serves it
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child, _started in children:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    with tempfile.TemporaryDirectory(prefix="fngate-metrics-") as metrics_dir:
        # Each worker writes its metrics there; /metrics on any worker sums them all.
        env = {
            "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
            **os.environ,
            "FNGATE_WORKERS": "1",
            "FNGATE_GRPC_REUSE_PORT": "false" if grpc_fds else "true",
            "FNGATE_METRICS_BIND": f"fd://{metrics_sock.fileno()}" if metrics_sock else "",
            "FNGATE_METRICS_PORT": "0" if metrics_sock is None else str(settings.metrics_port),
        }

        def start(index: int) -> tuple[subprocess.Popen[bytes], float]:
            sock = socks[index]
            child = subprocess.Popen(
                module_command("gateway"),
                env={**env, "FNGATE_BIND": f"fd://{sock.fileno()}"},
                pass_fds=[sock.fileno(), *grpc_fds] + ([metrics_sock.fileno()] if metrics_sock else []),
                preexec_fn=ends_with_parent(signal.SIGKILL),  # noqa: PLW1509 (a prctl only)
            )
            return child, time.monotonic()

        children = [start(index) for index in range(settings.workers)]
        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        where = f"http://{settings.host}:{port}"
        log.info("gateway: %d workers (%s) on %s", settings.workers, settings.server, where)
        failures = [0] * len(children)
        code = 0
        while True:
            for index, (child, started) in enumerate(children):
                status = child.poll()
                if status is None:
                    continue
                if stopping:
                    code = max(code, status)
                    continue
                failures[index] = 0 if time.monotonic() - started > STABLE_S else failures[index] + 1
                delay_s = backoff_s(failures[index], base_s=0.5, cap_s=30) if failures[index] else 0
                log.warning(
                    "gateway worker %d exited with %s; starting another in %.1f s", child.pid, status, delay_s
                )
                if delay_s and shared:  # one socket: the other workers serve it meanwhile
                    time.sleep(delay_s)
                elif delay_s:  # not waiting on a worker that may not come: the others take the port
                    socks[index].close()
                    time.sleep(delay_s)
                    socks[index] = _listener(settings.host, port)
                children[index] = start(index)
            if stopping and all(child.poll() is not None for child, _ in children):
                return code
            time.sleep(0.2)


def main(settings: GatewaySettings | None = None) -> int:
    unknown = unknown_variables()
    if unknown:
        print(f"gateway: unknown settings variables: {', '.join(unknown)}", file=sys.stderr)
        return 2
    settings = settings or GatewaySettings()
    telemetry.configure("gateway", settings.log_level)
    schedule(settings.sched_batch)  # before its threads and workers start: they inherit it
    if settings.workers > 1 and (not settings.bind or settings.bind.startswith("fd://")):
        return supervise(settings)
    run_forever(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
