"""The lean invoke path: the invocation routes answered from the connection's protocol, without an
ASGI task, scope messages or middleware per request. An Exchange takes a request that
gateway.http.invoke.match() recognised once its head is in, checks the key at once, collects the
body, hands the call to the core and gives the answer to its connection from the reply future's
done callback: one loop timer (the body's), no await, for a small synchronous call.

The exchange knows its connection only as a Link: the server's own parts (uvicorn's request cycle
and protocol, which keep keep-alive, pipelining, flow control and shutdown) stay behind it, in
gateway.http.uvicorn_link, the one module that touches uvicorn's private attributes.

A large body (or one of unknown length) is decoded as it arrives (gateway.http.bodies), never held
whole; a compressed one is held as sent and decoded in a worker thread. Everything else (other
routes, and every request while tracing is on) runs through the ASGI app, on the same connection
and port.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from fngate.errors import FunctionError, PayloadTooLarge
from fngate.repository import FunctionVersion
from fngate.wire import Reply
from gateway.allowance import Hold
from gateway.auth import OPEN, Principal, UnknownKey
from gateway.call import Call
from gateway.http import invoke
from gateway.http.bodies import STREAM_FROM_BYTES, StreamedBody
from gateway.http.codec import InferRequest
from gateway.http.compression import GZIP_MIN_BYTES, accepts_gzip
from gateway.http.errors import BodyTimeout
from gateway.invocations import RequestDigest
from gateway.state import Services
from gateway.validation import parse_now

log = logging.getLogger(__name__)


class Link(Protocol):
    """What an exchange needs of its connection and request (gateway.http.uvicorn_link.UvicornLink)."""

    @property
    def headers(self) -> list[tuple[bytes, bytes]]: ...

    @property
    def more_body(self) -> bool:
        """The body has not all been received yet."""

    @property
    def done(self) -> bool:
        """Answered, or the client left: nothing more is sent."""

    @property
    def answered(self) -> bool: ...

    def body_bytes(self) -> int:
        """The size of what the connection collected of the body so far."""

    def take_body(self) -> bytes:
        """What the connection collected of the body so far, let go of there."""

    def expect_continue(self) -> None:
        """Send `100 Continue` if the client waits for it before its body."""

    def resume_reading(self) -> None: ...

    def later(self, delay_s: float, callback: Callable[[], None]) -> asyncio.TimerHandle: ...

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in a task the connection keeps (and waits for at shutdown)."""

    def end_after_answer(self) -> None:
        """No next request on this connection: it closes once answered."""

    def close(self) -> None: ...

    def send(self, status: int, headers: list[tuple[bytes, bytes]], content: bytes, lingering: bool) -> None:
        """The whole answer, framed and written; the connection closes after it unless it keeps
        alive or `lingering` (the rest of a refused body is read first)."""

    def release(self) -> None:
        """The connection lets go of the exchange."""


class Exchange:
    """One invocation request on a connection, from its head to its answer."""

    __slots__ = (
        "_accepts_gzip",
        "_answer",
        "_body_timer",
        "_call",
        "_function",
        "_hold",
        "_key_looked_up",
        "_lingering",
        "_parsed",
        "_received",
        "_streamed",
        "_waiting_for_key",
        "link",
        "principal",
        "request",
        "services",
        "started",
    )

    def __init__(self, link: Link, request: invoke.InvokeHead, services: Services, started: float) -> None:
        self.link = link
        self.request = request
        self.services = services
        self.started = started
        self.principal: Principal = OPEN
        self._body_timer: asyncio.TimerHandle | None = None
        self._call: Call | None = None
        self._answer: asyncio.Future[Reply] | None = None
        """The dispatched invocation's answer, until it comes (caller_left cancels it)."""
        self._parsed: InferRequest | None = None
        self._accepts_gzip = False
        self._function: FunctionVersion | None = None
        self._streamed: StreamedBody | None = None
        """The decoder of a body decoded as it arrives (`stream`)."""
        self._hold: Hold | None = None
        self._received = 0
        self._waiting_for_key = False
        """A key the table did not hold is being looked up: the body waits for it."""
        self._key_looked_up = False
        self._lingering: asyncio.TimerHandle | None = None
        """Answered before its body ended: the rest is read and dropped until then (or the body
        timeout), so that the client reads the answer instead of a reset connection."""

    def start(self) -> None:
        """The head is in: refuse what can be refused before the body, else wait for it."""
        request, settings, link = self.request, self.services.settings, self.link
        headers = link.headers
        request.read_headers(headers)
        self._accepts_gzip = accepts_gzip(headers)
        try:
            self.principal = invoke.authorize(self.services, request)
            declared = request.content_length
            if declared is not None and declared > settings.max_body_bytes:
                raise PayloadTooLarge(
                    f"the body of {declared} bytes is over the limit of {settings.max_body_bytes} bytes"
                )
            if not request.encoding and (declared is None or declared >= STREAM_FROM_BYTES):
                self._start_stream()
        except UnknownKey as exc:
            if not self._key_looked_up:  # created since the table's refresh, maybe: look it up
                self._waiting_for_key = True
                link.spawn(self._look_up(exc.key_id))
                return
            invoke.count_refusal(self.services, request, exc, self.started)
            self._refuse(exc, close=True)
            return
        except FunctionError as exc:
            invoke.count_refusal(self.services, request, exc, self.started)
            # A body declared over the limit is not read: the connection ends at once.
            self._refuse(exc, close=True, linger=not isinstance(exc, PayloadTooLarge))
            return
        if self._streamed is not None and link.body_bytes():  # what came with the head
            self.stream(link.take_body())
            if link.answered:
                return
        if not link.more_body:  # it came with its head (or before its turn, pipelined)
            self.body_complete()
            return
        link.expect_continue()
        self._body_timer = link.later(settings.body_timeout_s, self._body_too_slow)

    def _start_stream(self) -> None:
        """A body decoded as it arrives: its function is found first (a small body's after it)."""
        request = self.request
        self._function = function = self.services.catalog.get(request.name, request.version)
        self._hold = self.services.budget.hold()
        digest = invoke.idempotency_digest(request)
        self._streamed = invoke.streamed_body(self.services, request, function, self._hold, digest)

    async def _look_up(self, key_id: str) -> None:
        await self.services.keys.look_up(key_id)
        self._key_looked_up = True  # the next refusal is final
        self._waiting_for_key = False
        if not self.link.done:
            self.start()

    @property
    def streaming(self) -> bool:
        return self._streamed is not None

    def stream(self, chunk: bytes) -> None:
        """A part of a body decoded as it arrives (the connection hands it here, not to its buffer)."""
        streamed = self._streamed
        if streamed is None or self.link.answered:
            return
        self._received += len(chunk)
        limit = self.services.settings.max_body_bytes
        try:
            if self._received > limit:
                raise PayloadTooLarge(f"the body is over the limit of {limit} bytes")
            parse_now(streamed.feed, chunk)
        except FunctionError as exc:
            self._end_stream()
            invoke.count_refusal(self.services, self.request, exc, self.started)
            self._refuse(exc, close=True, linger=not isinstance(exc, PayloadTooLarge))

    def _end_stream(self) -> None:
        self._streamed = None
        if self._hold is not None:
            self._hold.release()
            self._hold = None

    def body_grew(self) -> None:
        limit = self.services.settings.max_body_bytes
        if self.link.body_bytes() > limit:
            self._refuse(
                PayloadTooLarge(f"the body is over the limit of {limit} bytes"), close=True, linger=False
            )
        else:
            self.link.resume_reading()  # a server may pause past its high-water mark for the app

    def body_complete(self) -> None:
        if self._lingering is not None:  # the rest of a refused body is in: the connection ends
            self._stop_lingering()
            self._release()
            return
        if self._waiting_for_key:  # start() goes on once the key is looked up
            return
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self.link.answered:
            self._end_stream()
            self._release()
            return
        request, function = self.request, self._function
        streamed = self._streamed
        if streamed is not None and function is not None:
            self._end_stream()
            try:
                parsed = parse_now(streamed.finish)
            except FunctionError as exc:
                invoke.count_refusal(self.services, request, exc, self.started)
                self._respond(*invoke.error_answer(self.services, exc))
                return
            if request.respond_async or parsed.shares_memory:
                self.link.spawn(self._submit_slowly(function, parsed, streamed.digest))
                return
            self._dispatch(
                invoke.call_of(request, function, parsed, self.principal, None, self.started), parsed
            )
            return
        raw = self.link.take_body()
        if request.respond_async or request.encoding or len(raw) >= STREAM_FROM_BYTES:
            # Work that awaits (a submission, decompression, a parse in a thread): a task of its own.
            self.link.spawn(self._answer_slowly(raw))
            return
        try:
            function = self.services.catalog.get(request.name, request.version)
            call, parsed = invoke.call_now(
                self.services, request, function, self.principal, raw, self.started
            )
        except FunctionError as exc:
            invoke.count_refusal(self.services, request, exc, self.started)
            self._respond(*invoke.error_answer(self.services, exc))
            return
        except Exception:
            self._respond(*invoke.internal_answer(request))
            return
        if call is None:  # it names shared memory regions, read first
            self.link.spawn(self._submit_slowly(function, parsed, None))
            return
        self._dispatch(call, parsed)

    def _dispatch(self, call: Call, parsed: InferRequest) -> None:
        self._call, self._parsed = call, parsed
        self._answer = self.services.dispatcher.invoke(call)
        self._answer.add_done_callback(self._answered)

    def caller_left(self) -> None:
        """The connection closed before the answer: the invocation is let go (taken back from the
        queue if no runner read it yet)."""
        if self._answer is not None:
            self._answer.cancel()

    async def _submit_slowly(
        self, function: FunctionVersion, parsed: InferRequest, digest: RequestDigest | None
    ) -> None:
        answer = await invoke.submit(
            self.services, self.request, function, parsed, self.principal, digest, self.started
        )
        self._respond(*answer)

    def _answered(self, future: asyncio.Future[Reply]) -> None:
        self._answer = None
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            assert self._call is not None and self._parsed is not None
            self._respond(*invoke.rendered(self.request, self._call, self._parsed, future.result()))
        elif isinstance(error, FunctionError):
            self._respond(*invoke.error_answer(self.services, error))
        else:
            log.error("invocation of %s failed unexpectedly", self.request.name[:128], exc_info=error)
            self._respond(*invoke.internal_answer(self.request, logged=True))

    async def _answer_slowly(self, raw: bytes) -> None:
        self._respond(*await invoke.answer(self.services, self.request, raw, self.started, self.principal))

    def _body_too_slow(self) -> None:
        self._body_timer = None
        self._end_stream()
        timeout_s = self.services.settings.body_timeout_s
        self._refuse(BodyTimeout(f"the body did not arrive within {timeout_s:g} s"), close=True, linger=False)

    def _refuse(self, exc: FunctionError, close: bool, linger: bool = True) -> None:
        """Answered before (all of) the body: the connection ends with the answer, unless the body
        came whole already (the next request may follow it); with `linger`, once the rest of the
        body has been read and dropped (within the body timeout)."""
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        link = self.link
        if close and link.more_body:
            link.end_after_answer()
            if linger and not link.answered:
                self._lingering = link.later(self.services.settings.body_timeout_s, self._stop_lingering)
        self._respond(*invoke.error_answer(self.services, exc))

    def _stop_lingering(self) -> None:
        if self._lingering is not None:
            self._lingering.cancel()
            self._lingering = None
        self.link.close()

    def _respond(self, status: int, headers: list[tuple[bytes, bytes]], content: bytes) -> None:
        link = self.link
        if link.done:
            return
        if self._accepts_gzip and len(content) >= GZIP_MIN_BYTES:
            content = gzip.compress(content, compresslevel=5)
            headers = [*headers, (b"content-encoding", b"gzip"), (b"vary", b"Accept-Encoding")]
        lingering = self._lingering is not None
        link.send(status, headers, content, lingering)
        if not link.more_body and not lingering:
            self._release()

    def _release(self) -> None:
        """Answered, with the whole body read: the connection lets go of its exchange. The two refer
        to each other, and left so every request's objects would wait for the cyclic collector,
        which then runs several times as often and pauses the loop for milliseconds each time."""
        self.link.release()
