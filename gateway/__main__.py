"""settings -> server (uvicorn or Hypercorn) -> serve the app until `stopping` is set.

With workers > 1 this process binds the socket and supervises that many single-worker gateway
processes sharing it (each with its own reply stream), restarting any that dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from fngate import telemetry
from fngate.backoff import backoff_s
from fngate.config import GatewaySettings, unknown_variables
from fngate.process import run_forever
from gateway.app import create_app

log = logging.getLogger("gateway")

STABLE_S = 30.0
"""A worker that ran this long before dying is restarted at once; one that keeps dying, with backoff."""


async def serve_hypercorn(app: Any, settings: GatewaySettings, stopping: asyncio.Event) -> None:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [settings.bind or f"{settings.host}:{settings.port}"]
    config.accesslog = logging.getLogger("hypercorn.access") if telemetry.interactive() else None
    config.access_log_format = telemetry.ACCESS_LOG_FORMAT
    config.errorlog = logging.getLogger("hypercorn.error")
    # A connection whose request head is incomplete counts as idle: this timeout cuts a slow client.
    config.keep_alive_timeout = settings.header_timeout_s
    config.keep_alive_max_requests = 100_000  # Hypercorn's 1000 makes busy clients reconnect often
    config.graceful_timeout = 10
    await serve(app, config, shutdown_trigger=stopping.wait)


class _OneWrite:
    """A connection's transport that holds a response's head until its first body bytes (or its
    end), so that a small response leaves in one write: one system call, one TCP segment. Every
    other call goes through; closing sends what is held first."""

    __slots__ = ("_held", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held = b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if (
            not self._held
            and isinstance(data, bytes)  # uvicorn writes bytes; a head is never anything else
            and data.startswith(b"HTTP/1.1 ")
            and not data.startswith(b"HTTP/1.1 100")  # 100 Continue: the client waits on that
        ):
            self._held = data  # a response head
            return
        if self._held:
            data, self._held = self._held + data, b""
        self._transport.write(data)

    def flush(self) -> None:
        if self._held:
            data, self._held = self._held, b""
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def head_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, with a limit on how long a request's head may take: from the
    connection (or the previous response) to the end of the headers. uvicorn has none of its own
    (any byte resets its keep-alive timer), so a client sending a header a byte at a time would
    hold its connection for ever."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeadTimeoutProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(timeout_s, self._head_too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(_OneWrite(transport))  # type: ignore[arg-type]
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            one_write: Any = self.transport
            one_write.flush()  # a response with no body bytes (HEAD, 204) ends here
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeadTimeoutProtocol


async def serve_uvicorn(app: Any, settings: GatewaySettings, stopping: asyncio.Event) -> None:
    import uvicorn

    where: dict[str, Any] = {"host": settings.host, "port": settings.port}
    sockets = None
    if settings.bind.startswith("fd://"):  # family detected from the socket (uvicorn's fd= assumes unix)
        sockets = [socket.socket(fileno=int(settings.bind.removeprefix("fd://")))]
    elif settings.bind.startswith("unix:"):
        where = {"uds": settings.bind.removeprefix("unix:")}
    elif settings.bind:
        host, _, port = settings.bind.rpartition(":")
        where = {"host": host, "port": int(port)}
    config = uvicorn.Config(
        app,
        **where,
        loop="none",  # already on uvloop (fngate.process.run_forever)
        http=head_timeout_protocol(settings.header_timeout_s),
        lifespan="on",
        access_log=telemetry.interactive(),  # an access log for a person at a terminal
        log_config=None,
        server_header=False,
        proxy_headers=False,  # nothing here uses the client's address: no X-Forwarded-For pass per request
        timeout_keep_alive=math.ceil(settings.header_timeout_s),  # also cuts an incomplete request head
        timeout_graceful_shutdown=10,
        backlog=2048,
    )
    server = uvicorn.Server(config)

    async def stop_when_asked() -> None:
        await stopping.wait()
        server.should_exit = True

    async with asyncio.TaskGroup() as tasks:
        watcher = tasks.create_task(stop_when_asked())
        await server.serve(sockets=sockets)
        watcher.cancel()
        stopping.set()


SERVERS = {"uvicorn": serve_uvicorn, "hypercorn": serve_hypercorn}


async def run(settings: GatewaySettings) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    app = create_app(settings, stopping)
    await SERVERS[settings.server](app, settings, stopping)


def supervise(settings: GatewaySettings) -> int:
    """Bind once, keep `workers` gateway processes serving the shared socket (a worker that dies is
    started again, with backoff if it keeps dying), and stop them together when asked."""
    sock = socket.create_server((settings.host, settings.port), backlog=2048, reuse_port=False)
    sock.set_inheritable(True)
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
            "FNGATE_BIND": f"fd://{sock.fileno()}",
            "FNGATE_WORKERS": "1",
        }

        def start() -> tuple[subprocess.Popen[bytes], float]:
            child = subprocess.Popen([sys.executable, "-m", "gateway"], env=env, pass_fds=[sock.fileno()])
            return child, time.monotonic()

        children = [start() for _ in range(settings.workers)]
        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        log.info(
            "gateway: %d workers (%s) on http://%s:%d",
            settings.workers,
            settings.server,
            settings.host,
            sock.getsockname()[1],
        )
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
                time.sleep(delay_s)
                children[index] = start()
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
    if settings.workers > 1 and not settings.bind:
        return supervise(settings)
    run_forever(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
