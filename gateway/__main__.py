"""settings -> Hypercorn config -> serve(app, shutdown_trigger=stopping.wait).

With workers > 1 this process binds the socket and supervises that many single-worker gateway
processes sharing it; each has its own reply stream.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile

from hypercorn.asyncio import serve
from hypercorn.config import Config

from fngate import telemetry
from fngate.config import GatewaySettings, unknown_variables
from fngate.process import run_forever
from gateway.app import create_app

log = logging.getLogger("gateway")


def hypercorn_config(settings: GatewaySettings) -> Config:
    config = Config()
    config.bind = [settings.bind or f"{settings.host}:{settings.port}"]
    config.accesslog = logging.getLogger("hypercorn.access") if telemetry.interactive() else None
    config.access_log_format = telemetry.ACCESS_LOG_FORMAT
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = 75
    config.keep_alive_max_requests = 100_000  # Hypercorn's 1000 makes busy clients reconnect often
    config.graceful_timeout = 10
    return config


async def run(settings: GatewaySettings) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    app = create_app(settings, stopping)
    await serve(app, hypercorn_config(settings), shutdown_trigger=stopping.wait)  # type: ignore[arg-type]


def supervise(settings: GatewaySettings) -> int:
    """Bind once, start `workers` gateway processes on the shared socket, and stop them together."""
    sock = socket.create_server((settings.host, settings.port), backlog=2048, reuse_port=False)
    sock.set_inheritable(True)
    with tempfile.TemporaryDirectory(prefix="fngate-metrics-") as metrics_dir:
        # Each worker writes its metrics there; /metrics on any worker sums them all.
        env = {
            "PROMETHEUS_MULTIPROC_DIR": metrics_dir,
            **os.environ,
            "FNGATE_BIND": f"fd://{sock.fileno()}",
            "FNGATE_WORKERS": "1",
        }
        children = [
            subprocess.Popen([sys.executable, "-m", "gateway"], env=env, pass_fds=[sock.fileno()])
            for _ in range(settings.workers)
        ]
        log.info(
            "gateway: %d workers on http://%s:%d", settings.workers, settings.host, sock.getsockname()[1]
        )

        def forward(signum: int, _frame: object) -> None:
            for child in children:
                child.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        codes = [child.wait() for child in children]
    return max(codes, default=0)


def main(settings: GatewaySettings | None = None) -> int:
    unknown = unknown_variables()
    if unknown:
        print(f"gateway: unknown settings variables: {', '.join(unknown)}", file=sys.stderr)
        return 2
    settings = settings or GatewaySettings()
    telemetry.configure("gateway", settings.log_level)
    if settings.workers > 1 and not settings.bind:
        return supervise(settings)
    run_forever(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
