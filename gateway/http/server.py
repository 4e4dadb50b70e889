"""Serving the HTTP app: uvicorn (the default: its httptools protocol with limits on the request
head and the lean invoke path of gateway.http.lean, both in gateway.http.uvicorn_link) or Hypercorn
(every request through the ASGI app), until `stopping` is set; and the limits both servers share."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import socket
from typing import Any, ClassVar

from fngate import telemetry
from fngate.config import GatewaySettings
from gateway.http.connections import (
    LINGER_S,
    ClientConnections,
    too_many_client_connections,
    too_many_connections,
)


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
    # A request head over this is refused by h11 with 431; gateway.http.invoke.HeadLimits counts headers.
    config.h11_max_incomplete_size = settings.max_header_bytes
    config.h2_max_header_list_size = settings.max_header_bytes
    config.graceful_timeout = 10
    _limit_connections()
    connections = _Connections(
        settings.max_connections,
        too_many_connections(settings),
        ClientConnections(settings.max_client_connections),
        too_many_client_connections(settings),
    )
    config.fngate_connections = connections  # type: ignore[attr-defined]
    await serve(_AnswerThenDrain(app), config, shutdown_trigger=stopping.wait)


@dataclasses.dataclass
class _Connections:
    """The open connections of one Hypercorn server, and their limit."""

    limit: int
    refusal: bytes
    clients: ClientConnections
    client_refusal: bytes
    open: int = 0


def _limit_connections() -> None:
    """Give Hypercorn a limit on a server's open connections (it has none of its own: a client
    holding thousands of half-sent request heads would hold thousands of connections until each
    head timed out). Its handler of a new connection is wrapped, once per process: past the limit
    of its server's config (`fngate_connections`), a connection is answered 503 and closed, after a
    moment in which what the client sends is read and dropped (as on uvicorn)."""
    from hypercorn.asyncio import run

    serve_connection = run.TCPServer  # type: ignore[attr-defined]
    if getattr(serve_connection, "fngate_limited", False):
        return

    async def limited(
        app: Any, loop: Any, config: Any, context: Any, state: Any, reader: asyncio.StreamReader, writer: Any
    ) -> None:
        connections: _Connections | None = getattr(config, "fngate_connections", None)
        if connections is None:
            await serve_connection(app, loop, config, context, state, reader, writer)
            return
        client = connections.clients.admit(writer.get_extra_info("peername"))
        if connections.open < connections.limit and client is not None:
            connections.open += 1
            try:
                await serve_connection(app, loop, config, context, state, reader, writer)
            finally:
                connections.open -= 1
                connections.clients.release(client)
            return
        if client is not None:
            connections.clients.release(client)
        refusal = connections.client_refusal if client is None else connections.refusal
        with contextlib.suppress(OSError, TimeoutError):
            writer.write(refusal)
            writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await reader.read(65536):
                    pass
        writer.close()

    limited.fngate_limited = True  # type: ignore[attr-defined]
    run.TCPServer = limited  # type: ignore[attr-defined,assignment]


class _AnswerThenDrain:
    """Hypercorn's: a response that ends before its request's body was read whole (a refusal at
    the first value past a tensor's shape, a 413 on the declared length) keeps its connection open
    for up to LINGER_S while the rest of the body is read and dropped. Hypercorn closes the
    connection as soon as such a response ends, with the client's bytes unread: the close is a
    reset, and a client still sending loses the answer. The response's bytes leave at once; only
    its end (and so the close, or the next request on the connection) waits."""

    __slots__ = ("_app",)

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        read_whole = False
        dropping: _Dropping | None = None

        async def receiving() -> Any:
            nonlocal read_whole
            if dropping is not None:  # the rest of the body goes: the app hears only of the end
                await dropping.left.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            read_whole = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def sending(message: Any) -> None:
            nonlocal dropping
            if message["type"] != "http.response.body" or message.get("more_body") or read_whole:
                await send(message)
                return
            dropping = _Dropping(receive)
            await send({**message, "more_body": True})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LINGER_S):
                    await dropping.over.wait()
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self._app(scope, receiving, sending)


class _Dropping:
    """What is left of a request's body, read and dropped: `over` is set at its end or the
    client's leaving, `left` at the stream's disconnect (the client's leaving, or the end of the
    stream once the response ended). Reading goes on until then (for up to twice LINGER_S in all):
    ending the response puts a disconnect on the app's queue of request messages, a queue of a few
    that Hypercorn waits on when it is full; the disconnect is the app's too."""

    __slots__ = ("left", "over")
    _tasks: ClassVar[set[asyncio.Task[None]]] = set()

    def __init__(self, receive: Any) -> None:
        self.over, self.left = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(self._drop(receive))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drop(self, receive: Any) -> None:
        try:
            async with asyncio.timeout(2 * LINGER_S):
                while True:
                    message = await receive()
                    if message["type"] != "http.request" or not message.get("more_body", False):
                        self.over.set()
                    if message["type"] != "http.request":
                        return
        except TimeoutError:
            pass
        finally:
            self.over.set()
            self.left.set()


async def serve_uvicorn(app: Any, settings: GatewaySettings, stopping: asyncio.Event) -> None:
    import uvicorn

    from gateway.http.uvicorn_link import head_timeout_protocol

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
        http=head_timeout_protocol(settings, lean=not telemetry.tracing_active()),
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
