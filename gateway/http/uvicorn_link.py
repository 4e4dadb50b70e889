"""uvicorn's private surface, in one place: its httptools protocol, subclassed for limits on the
request head and on connections and for the lean invoke path (gateway.http.lean), and the link
through which a lean exchange reads its request and writes its answer on uvicorn's request cycle.
Nothing else in fngate touches uvicorn's attributes: a uvicorn release that renames one breaks
this module alone (tests/gateway/http run on it)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from typing import Any

from fngate.config import GatewaySettings
from gateway.http.connections import (
    LINGER_S,
    SHUTDOWN_IDLE_GRACE_S,
    ClientConnections,
    refusal,
    too_many_client_connections,
    too_many_connections,
)
from gateway.http.invoke import match
from gateway.http.lean import Exchange

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
REASONS = {200: b"OK", 202: b"Accepted"}


class UvicornLink:
    """A lean exchange's connection: uvicorn's protocol and the request's cycle (gateway.http.lean.Link)."""

    __slots__ = ("cycle", "protocol")

    def __init__(self, protocol: Any, cycle: Any) -> None:
        self.protocol = protocol
        self.cycle = cycle

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return self.cycle.scope["headers"]  # type: ignore[no-any-return]

    @property
    def more_body(self) -> bool:
        return self.cycle.more_body  # type: ignore[no-any-return]

    @property
    def answered(self) -> bool:
        return self.cycle.response_complete  # type: ignore[no-any-return]

    @property
    def done(self) -> bool:
        cycle = self.cycle
        return cycle.response_complete or cycle.disconnected  # type: ignore[no-any-return]

    def body_bytes(self) -> int:
        return len(self.cycle.body)

    def take_body(self) -> bytes:
        cycle = self.cycle
        body, cycle.body = bytes(cycle.body), bytearray()
        return body

    def expect_continue(self) -> None:
        cycle = self.cycle
        if cycle.waiting_for_100_continue:
            cycle.waiting_for_100_continue = False
            self.protocol.transport.write(CONTINUE)

    def resume_reading(self) -> None:
        self.protocol.flow.resume_reading()  # uvicorn pauses past its high-water mark for the app

    def later(self, delay_s: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self.protocol.loop.call_later(delay_s, callback)  # type: ignore[no-any-return]

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        tasks = self.protocol.tasks
        task = self.protocol.loop.create_task(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def end_after_answer(self) -> None:
        self.cycle.keep_alive = False

    def close(self) -> None:
        self.protocol.transport.close()

    def send(self, status: int, headers: list[tuple[bytes, bytes]], content: bytes, lingering: bool) -> None:
        cycle = self.cycle
        head = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status) or _reason(status))]
        for name, value in (*cycle.default_headers, *headers):  # uvicorn's date (and server), as on ASGI
            head += (name, b": ", value, b"\r\n")
        head.append(b"content-length: %d\r\n" % len(content))
        if not cycle.keep_alive:
            head.append(b"connection: close\r\n")
        head += (b"\r\n", content)
        cycle.response_started = True
        cycle.response_complete = True
        cycle.waiting_for_100_continue = False
        if cycle.access_log:
            cycle.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                _client(cycle.scope),
                cycle.scope["method"],
                cycle.scope["path"],
                cycle.scope["http_version"],
                status,
            )
        protocol = self.protocol
        transport = protocol.transport
        transport.write(b"".join(head))
        transport.flush()
        cycle.message_event.set()
        if not cycle.keep_alive and not lingering:
            transport.close()
        if protocol.flow.write_paused:  # a reader that does not keep up: read on once it does
            self.spawn(_after_drain(protocol.flow, cycle))
        else:
            cycle.on_response()

    def release(self) -> None:
        self.cycle.lean = None


async def _after_drain(flow: Any, cycle: Any) -> None:
    await flow.drain()
    cycle.on_response()


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _client(scope: Any) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


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


def head_timeout_protocol(settings: GatewaySettings, lean: bool = False) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, with limits on a request's head: how long it may take (from
    the connection, or the previous response, to the end of the headers: uvicorn has none of its
    own, any byte resets its keep-alive timer, so a client sending a header a byte at a time would
    hold its connection for ever), its size and its number of headers (431 past them); and on the
    connections of this process (past max_connections a new one is answered 503 and closed). With
    `lean`, the invocation routes are answered by gateway.http.lean instead of an ASGI task
    (uvicorn's pipelining, flow control and shutdown stay as they are)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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
            exchange = Exchange(UvicornLink(self, cycle), request, services, time.perf_counter())
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
