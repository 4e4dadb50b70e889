"""The lean invoke path on uvicorn: the invocation routes answered from the connection's protocol,
without an ASGI task, scope messages or middleware per request. httptools parses (through
uvicorn's protocol, which keeps its keep-alive, pipelining, flow control and shutdown); this module
takes the requests that gateway.http.invoke.match() recognises once their head is in, checks the
key at once, collects the body, hands the call to the core and writes the answer from the reply
future's done callback: one loop timer (the body's), no await, for a small synchronous call.

Everything else (other routes, asynchronous calls, compressed or large bodies, and every request
while tracing is on) runs as before: through the ASGI app, on the same connection and port.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from typing import Any

from fngate.errors import FunctionError
from fngate.wire import Reply
from gateway.auth import OPEN, Principal
from gateway.call import Call
from gateway.http import invoke
from gateway.http.errors import BodyTimeout, PayloadTooLarge
from gateway.http.protocol import InferRequest
from gateway.state import Services
from gateway.validation import OFF_LOOP_BYTES

log = logging.getLogger(__name__)
GZIP_MIN_BYTES = 64 * 1024
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
REASONS = {200: b"OK", 202: b"Accepted"}


class Exchange:
    """One invocation request on a connection, from its head to its answer."""

    __slots__ = (
        "_accepts_gzip",
        "_body_timer",
        "_call",
        "_parsed",
        "cycle",
        "principal",
        "protocol",
        "request",
        "services",
        "started",
    )

    def __init__(
        self, protocol: Any, cycle: Any, request: invoke.Request, services: Services, started: float
    ) -> None:
        self.protocol = protocol
        self.cycle = cycle
        self.request = request
        self.services = services
        self.started = started
        self.principal: Principal = OPEN
        self._body_timer: asyncio.TimerHandle | None = None
        self._call: Call | None = None
        self._parsed: InferRequest | None = None
        self._accepts_gzip = False

    def start(self) -> None:
        """The head is in: refuse what can be refused before the body, else wait for it."""
        request, settings = self.request, self.services.settings
        headers = self.cycle.scope["headers"]
        request.read_headers(headers)
        self._accepts_gzip = any(
            name == b"accept-encoding" and b"gzip" in value.lower() for name, value in headers
        )
        try:
            self.principal = invoke.authorize(self.services, request)
            declared = request.content_length
            if declared is not None and declared > settings.max_body_bytes:
                raise PayloadTooLarge(
                    f"the body of {declared} bytes is over the limit of {settings.max_body_bytes} bytes"
                )
        except FunctionError as exc:
            invoke.count_refusal(self.services, request, exc, self.started)
            self._refuse(exc, close=True)
            return
        if not self.cycle.more_body:  # it came with its head (or before its turn, pipelined)
            self.body_complete()
            return
        if self.cycle.waiting_for_100_continue:
            self.cycle.waiting_for_100_continue = False
            self.protocol.transport.write(CONTINUE)
        self._body_timer = self.protocol.loop.call_later(settings.body_timeout_s, self._body_too_slow)

    def body_grew(self) -> None:
        limit = self.services.settings.max_body_bytes
        if len(self.cycle.body) > limit:
            self._refuse(PayloadTooLarge(f"the body is over the limit of {limit} bytes"), close=True)
        else:
            self.protocol.flow.resume_reading()  # uvicorn pauses past its high-water mark for the app

    def body_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self.cycle.response_complete:
            return
        raw = bytes(self.cycle.body)
        self.cycle.body = bytearray()
        request = self.request
        if request.respond_async or request.encoding or len(raw) >= OFF_LOOP_BYTES:
            # Work that awaits (a submission, decompression, a parse in a thread): a task of its own.
            task = self.protocol.loop.create_task(self._answer_slowly(raw))
            self.protocol.tasks.add(task)
            task.add_done_callback(self.protocol.tasks.discard)
            return
        try:
            call, parsed = invoke.call_now(self.services, request, self.principal, raw, self.started)
        except FunctionError as exc:
            invoke.count_refusal(self.services, request, exc, self.started)
            self._respond(*invoke.error_answer(self.services, exc))
            return
        except Exception:
            self._respond(*invoke.internal_answer(request))
            return
        self._call, self._parsed = call, parsed
        self.services.dispatcher.invoke(call).add_done_callback(self._answered)

    def _answered(self, future: asyncio.Future[Reply]) -> None:
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
        timeout_s = self.services.settings.body_timeout_s
        self._refuse(BodyTimeout(f"the body did not arrive within {timeout_s:g} s"), close=True)

    def _refuse(self, exc: FunctionError, close: bool) -> None:
        """Answered before (all of) the body: the connection ends with the answer, unless the body
        came whole already (the next request may follow it)."""
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if close and self.cycle.more_body:
            self.cycle.keep_alive = False
        self._respond(*invoke.error_answer(self.services, exc))

    def _respond(self, status: int, headers: list[tuple[bytes, bytes]], content: bytes) -> None:
        cycle = self.cycle
        if cycle.response_complete or cycle.disconnected:
            return
        if self._accepts_gzip and len(content) >= GZIP_MIN_BYTES:
            content = gzip.compress(content, compresslevel=5)
            headers = [*headers, (b"content-encoding", b"gzip"), (b"vary", b"Accept-Encoding")]
        head = [b"HTTP/1.1 %d %s\r\n" % (status, REASONS.get(status) or _reason(status))]
        for name, value in headers:
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
        transport = self.protocol.transport
        transport.write(b"".join(head))
        transport.flush()
        cycle.message_event.set()
        if not cycle.keep_alive:
            transport.close()
        if self.protocol.flow.write_paused:  # a reader that does not keep up: read on once it does
            task = self.protocol.loop.create_task(_after_drain(self.protocol.flow, cycle))
            self.protocol.tasks.add(task)
            task.add_done_callback(self.protocol.tasks.discard)
        else:
            cycle.on_response()


async def _after_drain(flow: Any, cycle: Any) -> None:
    await flow.drain()
    cycle.on_response()


def _reason(status: int) -> bytes:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _client(scope: Any) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"
