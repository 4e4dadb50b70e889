"""Serving the HTTP app: uvicorn (the default: its httptools protocol with a limit on how long a
request head may take, and the lean invoke path of gateway.http.lean) or Hypercorn (every request
through the ASGI app), until `stopping` is set."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import math
import socket
import time
from http import HTTPStatus
from typing import Any, ClassVar

from fngate import telemetry
from fngate.config import GatewaySettings

SHUTDOWN_IDLE_GRACE_S = 1.0
"""How long an idle keep-alive connection stays open at shutdown for a request already on its way."""
LINGER_S = 2.0
"""How long a connection refused before its request was read drops what the client still sends."""


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


class ClientConnections:
    """The open connections of one server by client (an IPv4 address, or an IPv6 /64: what one
    host holds), and the most one client may hold (0: no limit of its own)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}

    def admit(self, peer: Any) -> str | None:
        """The client of a new connection (its peername), counted; None when it holds its limit
        (or has no address to count by: a unix socket's, counted as admitted with ''). Release
        what this returns when the connection ends."""
        client = client_of(peer)
        if not self.limit or not client:
            return ""
        held = self._open.get(client, 0)
        if held >= self.limit:
            return None
        self._open[client] = held + 1
        return client

    def release(self, client: str) -> None:
        if not client:
            return
        held = self._open.get(client, 0) - 1
        if held > 0:
            self._open[client] = held
        else:
            self._open.pop(client, None)


def client_of(peer: Any) -> str:
    """What a connection from `peer` (a socket's peername) counts against: its IPv4 address, or
    its IPv6 address's /64 (a host has a /64 of them); '' for none."""
    if not isinstance(peer, tuple) or not peer:
        return ""
    address = str(peer[0]).partition("%")[0]
    if ":" not in address:
        return address
    try:
        ipv6 = ipaddress.IPv6Address(address)
    except ValueError:
        return address
    if ipv6.ipv4_mapped is not None:  # a dual-stack socket's IPv4 client
        return str(ipv6.ipv4_mapped)
    return str(ipaddress.IPv6Network((ipv6, 64), strict=False))


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


def refusal(status: int, message: str, retry_after_s: int | None = None) -> bytes:
    """A whole response that ends its connection, for a refusal before any request is read whole."""
    body = b'{"error": "%s", "code": "%s"}' % (
        message.encode(),
        b"overloaded" if status == 503 else b"invalid_argument",
    )
    retry = b"retry-after: %d\r\n" % retry_after_s if retry_after_s is not None else b""
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % (
        status,
        HTTPStatus(status).phrase.encode(),
        len(body),
    )
    return head + retry + b"connection: close\r\n\r\n" + body


def too_many_connections(settings: GatewaySettings) -> bytes:
    """The refusal of a connection past max_connections (both servers)."""
    return refusal(503, "this gateway process has too many connections open", settings.retry_after_s)


def too_many_client_connections(settings: GatewaySettings) -> bytes:
    """The refusal of a connection past max_client_connections (both servers)."""
    return refusal(
        503,
        f"this gateway process has {settings.max_client_connections} connections open from your "
        "address (max_client_connections)",
        settings.retry_after_s,
    )


def head_timeout_protocol(settings: GatewaySettings, lean: bool = False) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, with limits on a request's head: how long it may take (from
    the connection, or the previous response, to the end of the headers: uvicorn has none of its
    own, any byte resets its keep-alive timer, so a client sending a header a byte at a time would
    hold its connection for ever), its size and its number of headers (431 past them); and on the
    connections of this process (past max_connections a new one is answered 503 and closed). With
    `lean`, the invocation routes are answered by gateway.http.lean instead of an ASGI task
    (uvicorn's pipelining, flow control and shutdown stay as they are)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from gateway.http.invoke import match
    from gateway.http.lean import Exchange

    timeout_s = settings.header_timeout_s
    max_head_bytes, max_headers = settings.max_header_bytes, settings.max_headers
    too_large = refusal(431, f"the request head is over {max_head_bytes} bytes or {max_headers} headers")
    too_many = too_many_connections(settings)
    too_many_from_client = too_many_client_connections(settings)
    clients = ClientConnections(settings.max_client_connections)

    class HeadTimeoutProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _draining = False
        _in_head = True
        _head_bytes = 0
        _header_count = 0
        _head_refused = False
        _discarding: asyncio.TimerHandle | None = None
        _client: str | None = None

        def data_received(self, data: bytes) -> None:
            if self._discarding is not None:
                return  # refused: what the client still sends is dropped until the linger ends
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > max_head_bytes and not self._head_refused:
                self._refuse_head()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes, self._header_count = True, 0, 0

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count > max_headers:
                self._head_refused = True
                raise ValueError("too many headers")  # stops the parser: send_400_response follows
            super().on_header(name, value)

        def send_400_response(self, msg: str) -> None:
            if self._head_refused:
                self._refuse_head()
            else:
                super().send_400_response(msg)

        def _refuse_head(self) -> None:
            self._head_refused = True
            self._refuse(too_large)

        def _refuse(self, answer: bytes) -> None:
            """Answer and end the connection, after a moment in which what the client still sends
            is read and dropped: closed at once, with bytes unread, the connection would be reset,
            and the client could lose the answer."""
            transport = self.transport
            if transport.is_closing() or self._discarding is not None:
                return
            transport.write(answer)
            transport.flush()  # type: ignore[attr-defined]
            self._disarm()
            with contextlib.suppress(OSError, NotImplementedError):
                transport.write_eof()
            self._discarding = self.loop.call_later(LINGER_S, transport.close)

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
            exchange = getattr(self.cycle, "lean", None)
            if exchange is not None and exchange.streaming:
                exchange.stream(body)  # decoded as it arrives, never collected
                return
            super().on_body(body)
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
            if len(self.connections) > settings.max_connections:
                self._refuse(too_many)
                return
            self._client = clients.admit(transport.get_extra_info("peername"))
            if self._client is None:
                self._refuse(too_many_from_client)
                return
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            self._in_head = False
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
            if self._client is not None:
                clients.release(self._client)
                self._client = None
            if self._discarding is not None:
                self._discarding.cancel()
            exchange = getattr(self.cycle, "lean", None)
            if exchange is not None and not self.cycle.response_complete:
                exchange.caller_left()
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
