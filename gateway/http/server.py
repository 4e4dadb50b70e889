"""Serving the HTTP app: uvicorn (the default: its httptools protocol with a limit on how long a
request head may take, and the lean invoke path of gateway.http.lean) or Hypercorn (every request
through the ASGI app), until `stopping` is set."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from typing import Any

from fngate import telemetry
from fngate.config import GatewaySettings

SHUTDOWN_IDLE_GRACE_S = 1.0
"""How long an idle keep-alive connection stays open at shutdown for a request already on its way."""


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


def head_timeout_protocol(timeout_s: float, lean: bool = False) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, with a limit on how long a request's head may take: from the
    connection (or the previous response) to the end of the headers. uvicorn has none of its own
    (any byte resets its keep-alive timer), so a client sending a header a byte at a time would
    hold its connection for ever. With `lean`, the invocation routes are answered by
    gateway.http.lean instead of an ASGI task (uvicorn's pipelining, flow control and shutdown
    stay as they are)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from gateway.http.invoke import match
    from gateway.http.lean import Exchange

    class HeadTimeoutProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _draining = False

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            scope = cycle.scope
            request = match(scope["method"], scope["path"]) if lean and app is self.app else None
            services = scope["state"].get("services") if request is not None else None
            if request is None or services is None:
                super()._start_asgi_task(cycle, app)
                return
            scope["route"] = request.route
            exchange = Exchange(self, cycle, request, services, time.perf_counter())
            cycle.lean = exchange
            exchange.start()

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            exchange = getattr(self.cycle, "lean", None)
            if exchange is not None and not self.cycle.response_complete:
                exchange.body_grew()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            exchange = getattr(self.cycle, "lean", None)
            if exchange is not None:
                exchange.body_complete()

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
            if self._draining and self.cycle is not None:
                self.cycle.keep_alive = False  # answered with Connection: close

        def on_response_complete(self) -> None:
            one_write: Any = self.transport
            one_write.flush()  # a response with no body bytes (HEAD, 204) ends here
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def shutdown(self) -> None:
            # uvicorn closes an idle keep-alive connection at once on shutdown, and a request the
            # client had just sent on it meets a reset. It is answered instead, with Connection:
            # close, if it comes within SHUTDOWN_IDLE_GRACE_S; then the connection closes.
            if self.cycle is None or self.cycle.response_complete:
                self._draining = True
                self._disarm()
                self._head_timer = self.loop.call_later(SHUTDOWN_IDLE_GRACE_S, self._head_too_slow)
            else:
                self.cycle.keep_alive = False

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
        # The lean path bypasses the ASGI layers: with tracing on, every request goes through them.
        http=head_timeout_protocol(settings.header_timeout_s, lean=not telemetry.tracing_active()),
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
