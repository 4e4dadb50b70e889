"""The invocation routes over ASGI (on Hypercorn, and on uvicorn while tracing is on): InvokeRoutes,
in front of Starlette, drives the same Exchange as the lean path on uvicorn (gateway.http.lean)
through an AsgiLink, so that what an invocation request is answered (the key checked before the
body, the limits on the declared and the received body, its timeout, a large body decoded as it
arrives, the refusal that ends the connection and the rest of the body read and dropped first,
compression) is decided once, in the exchange, for both servers. What differs is only the
transport: here the body is pulled from `receive` and the answer sent as two ASGI messages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.invoke import Answer, match
from gateway.http.lean import Exchange
from gateway.state import Services


class AsgiLink:
    """An exchange's ASGI request (gateway.http.lean.Link): the body as `InvokeRoutes` reads it
    from `receive`, and the answer kept for it to send."""

    __slots__ = (
        "_body",
        "_loop",
        "_ready",
        "_scope",
        "_tasks",
        "answer",
        "answered",
        "closing",
        "gone",
        "lingering",
        "more_body",
        "reading",
    )

    def __init__(self, scope: Scope, loop: asyncio.AbstractEventLoop) -> None:
        self._scope = scope
        self._loop = loop
        self._body = bytearray()
        self._ready = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.answer: Answer | None = None
        self.answered = False
        self.gone = False
        """The client left before the answer."""
        self.closing = False
        """The connection ends with the answer (`Connection: close`)."""
        self.lingering = False
        self.more_body = True
        """Until a message of the body says it is the last."""
        self.reading: asyncio.Task[None] | None = None

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return self._scope["headers"]  # type: ignore[no-any-return]

    @property
    def done(self) -> bool:
        return self.answered or self.gone

    def body_bytes(self) -> int:
        return len(self._body)

    def take_body(self) -> bytes:
        body, self._body = bytes(self._body), bytearray()
        return body

    def add_body(self, chunk: bytes) -> None:
        self._body += chunk

    def expect_continue(self) -> None:
        """Nothing to do: an ASGI server sends `100 Continue` itself once the body is read."""

    def resume_reading(self) -> None:
        """Nothing to do: the body is read as InvokeRoutes asks for it."""

    def later(self, delay_s: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self._loop.call_later(delay_s, callback)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def end_after_answer(self) -> None:
        self.closing = True

    def close(self) -> None:
        """The rest of a refused body is not waited for any longer."""
        if self.reading is not None:
            self.reading.cancel()

    def send(self, status: int, headers: list[tuple[bytes, bytes]], content: bytes, lingering: bool) -> None:
        self.answer = (status, headers, content)
        self.answered = True
        self.lingering = lingering
        self._ready.set()

    def leave(self) -> None:
        self.gone = True
        self._ready.set()

    def release(self) -> None:
        """Nothing holds the exchange here but InvokeRoutes' call, which ends with the answer."""

    async def wait(self) -> None:
        """Until the answer, or the client's leaving."""
        await self._ready.wait()


class InvokeRoutes:
    """The invocation routes, in front of `app`; and, for every request through the ASGI app, the
    limits that a server may not apply itself (Hypercorn): headers at most `max_headers` (431),
    requests in flight at most `max_in_flight` (503 with Retry-After)."""

    def __init__(self, app: ASGIApp, max_headers: int, max_in_flight: int, retry_after_s: int) -> None:
        self.app = app
        self.max_headers = max_headers
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if len(scope["headers"]) > self.max_headers:
            await _send(send, 431, b"the request head has more than %d headers" % self.max_headers)
            return
        if self.in_flight >= self.max_in_flight:
            message = b"this gateway process has too many requests in flight"
            await _send(send, 503, message, self.retry_after_s)
            return
        self.in_flight += 1
        try:
            await self._route(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = match(scope["method"], scope["path"])
        if request is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = request.route
        services: Services = scope["state"]["services"]
        link = AsgiLink(scope, asyncio.get_running_loop())
        exchange = Exchange(link, request, services, time.perf_counter())
        exchange.start()
        if link.more_body and not link.answered:
            link.reading = asyncio.ensure_future(_read(link, exchange, receive))
        try:
            await link.wait()
            if link.answer is None:  # the client left: nothing to answer
                return
            status, headers, content = link.answer
            headers.append((b"content-length", b"%d" % len(content)))
            if link.closing:
                headers.append((b"connection", b"close"))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content})
            if link.lingering and link.reading is not None:
                # The rest of the body is read and dropped (until its end or the body timeout), so
                # that the client reads the answer, not a reset connection.
                await asyncio.wait([link.reading])
        finally:
            if link.reading is not None:
                link.reading.cancel()


async def _read(link: AsgiLink, exchange: Exchange, receive: Receive) -> None:
    """The body, handed to the exchange as it comes (or, once it was answered, dropped)."""
    while link.more_body:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            link.more_body = False
            if link.answered:
                exchange.body_complete()  # what lingered for the rest of the body ends
            else:
                link.leave()
                exchange.caller_left()
            return
        chunk: bytes = message.get("body", b"")
        link.more_body = message.get("more_body", False)
        if exchange.streaming:
            if chunk:
                exchange.stream(chunk)
        elif not link.answered:
            link.add_body(chunk)
            exchange.body_grew()
        if not link.more_body:
            exchange.body_complete()


async def _send(send: Send, status: int, message: bytes, retry_after_s: int | None = None) -> None:
    """A refusal before the request was read: the connection ends with it."""
    code = b"overloaded" if status == 503 else b"invalid_argument"
    body = b'{"error": "%s", "code": "%s"}' % (message, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    headers.append((b"connection", b"close"))
    if retry_after_s is not None:
        headers.append((b"retry-after", b"%d" % retry_after_s))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
