"""gRPC over HTTP/2 on the gateway's event loop: one asyncio protocol per connection,
gateway.grpc.http2 keeping the connection's state (frames, HPACK, stream states, flow control),
each stream one RPC. What is gRPC's own is here: the method table, `grpc-timeout`, and the status
in the trailers; its length-prefixed messages are gateway.grpc.messages'.

A unary RPC whose handler answers a future (ModelInfer's) costs no task: the answer is written
from the future's done callback. Everything a connection holds is bounded: message size, open
streams, the bytes buffered (the gateway's decode allowance), the header block (HPACK's limit),
client resets and PINGs per second, and how long a preface or a unary request may take to arrive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fngate.errors import InvalidArgument
from gateway.grpc import messages
from gateway.grpc.http2 import Event, Http2ErrorCode, ProtocolError, ServerConnection
from gateway.grpc.rpc import (
    OPEN_MESSAGE_BYTES,
    Buffer,
    Method,
    Open,
    Rpc,
    RpcError,
    RpcLimits,
    percent_encoded,
    timeout_s,
)
from gateway.grpc.status import Status

log = logging.getLogger(__name__)

PATH_PREFIX = b"/inference.GRPCInferenceService/"
MAX_STREAMS = 256
"""RPCs open at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS)."""
STREAM_WINDOW = 1 << 20
"""Each stream's receive window: how much a client may send ahead of the gateway's reading."""
CONNECTION_WINDOW = 16 << 20
MAX_RESETS_PER_S = 200
"""Streams a client may cancel per second before its connection is ended (the rapid-reset attack)."""
MAX_CONTROL_PER_S = 100
"""PING and SETTINGS frames (each answered with an ACK) a client may send per second before its
connection is ended; grpc's clients send a few, to size their windows."""
MAX_QUEUED_MESSAGES = 1024
"""Requests of one stream received and not yet taken by its handler; past it the RPC ends."""
TRAILERS_ONLY = [(b":status", b"200"), (b"content-type", b"application/grpc")]
"""What precedes the status of an RPC that ends without an answer."""
RESPONSE_HEADERS = [
    (b":status", b"200"),
    (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", b"identity,deflate,gzip"),
]


def server_connection(max_header_list_size: int) -> ServerConnection:
    """The server side of one HTTP/2 connection as the gateway keeps it."""
    return ServerConnection(
        max_streams=MAX_STREAMS,
        stream_window=STREAM_WINDOW,
        connection_window=CONNECTION_WINDOW,
        max_header_list_size=max_header_list_size,
    )


class GrpcConnection(asyncio.Protocol):
    def __init__(self, methods: dict[bytes, Method], limits: RpcLimits, open_: Open) -> None:
        self.methods = methods
        self.limits = limits
        self.open = open_
        self.rpcs: dict[int, Rpc] = {}
        self.transport: asyncio.Transport | None = None
        self.http2 = server_connection(limits.max_header_bytes)
        self._pending: dict[int, bytearray] = {}
        """Answer bytes each stream's flow-control window did not take yet."""
        self._resets = _PerSecond(MAX_RESETS_PER_S)
        self._control = _PerSecond(MAX_CONTROL_PER_S)
        self._preface_timer: asyncio.TimerHandle | None = None
        self._going_away = False
        self._flush_soon = False
        self._unarmed: list[Rpc] = []
        """Unary RPCs opened in this data_received whose message may not be complete at its end."""
        self._loop = asyncio.get_running_loop()
        self.idle = asyncio.Event()
        self._idle_timer: asyncio.TimerHandle | None = None
        self.last_active = self._loop.time()
        """When its last RPC ended (or it opened): the idle timeout counts from here."""
        self._parked = 0
        """Answer bytes of this connection waiting for the client's windows."""
        self._starved: dict[int, None] = {}
        """Streams with answer bytes held by the connection's window alone (their own has room), in
        the order they ran out: a connection WINDOW_UPDATE wakes them, and only them."""

    # asyncio's side

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        limits = self.limits
        self.http2.initiate()
        if len(self.open.connections) >= limits.max_connections and not self._evict_idle():
            self.http2.close_connection(
                Http2ErrorCode.ENHANCE_YOUR_CALM,
                additional_data=b"too many connections to this gateway process",
            )
            self._close()
            return
        self.open.connections.add(self)
        self._flush()
        loop = self._loop
        self._preface_timer = loop.call_later(limits.header_timeout_s, self._close)
        self._idle_timer = loop.call_later(limits.idle_timeout_s, self._idle_check)
        self.idle.set()

    def _evict_idle(self) -> bool:
        """Make room for a new connection by sending away the longest idle one (no RPC open), if
        any: connections that hold nothing cannot lock others out."""
        idle = [each for each in self.open.connections if not each.rpcs and not each._going_away]
        if not idle:
            return False
        oldest = min(idle, key=lambda each: each.last_active)
        oldest.go_away()
        self.open.connections.discard(oldest)
        return True

    def _idle_check(self) -> None:
        self._idle_timer = None
        if self.transport is None or self.transport.is_closing():
            return
        waited = self._loop.time() - self.last_active
        timeout_s = self.limits.idle_timeout_s
        if not self.rpcs and waited >= timeout_s:
            self.go_away()
            return
        self._idle_timer = self._loop.call_later(max(timeout_s - waited, 0.1), self._idle_check)

    def data_received(self, data: bytes) -> None:
        try:
            events = self.http2.receive(data)
        except ProtocolError as exc:
            log.debug("a gRPC client broke HTTP/2 (%s: %s): its connection is ended", exc.code.name, exc)
            self._close()
            return
        if self._preface_timer is not None and self.http2.settled:  # its preface and SETTINGS are in
            self._preface_timer.cancel()
            self._preface_timer = None
        transport = self.transport
        for event in events:
            if transport is None or transport.is_closing():  # ended by one of these events
                return
            kind, stream_id = event[0], event[1]
            if event[0] is Event.DATA:
                self._data(stream_id, event[2])
            elif event[0] is Event.REQUEST:
                self._request(stream_id, event[2])
            elif kind is Event.ENDED:
                self._ended(stream_id)
            elif kind is Event.WINDOW:
                self._window_opened(stream_id)
            elif kind is Event.SETTINGS:
                self._window_opened(0)
                if self._control.over():
                    self._calm_down(b"too many SETTINGS")
                    return
            elif kind is Event.PING:
                if self._control.over():
                    self._calm_down(b"too many PINGs")
                    return
            elif kind is Event.RESET:
                self._reset_by_client(stream_id)
            elif kind is Event.GOAWAY:
                self._close()
                return
        if self._unarmed:  # a request message still to come must come within the body timeout
            timeout_s = self.limits.body_timeout_s
            for rpc in self._unarmed:
                if rpc.answering is None and not rpc.ended:
                    rpc.timer = self._loop.call_later(timeout_s, self._too_slow, rpc)
            self._unarmed.clear()
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.open.connections.discard(self)
        if self._preface_timer is not None:
            self._preface_timer.cancel()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        for rpc in list(self.rpcs.values()):
            self._forget(rpc, cancel=True)
        self.idle.set()

    # shutdown

    def go_away(self) -> None:
        """Take no new RPC (refused streams, which clients retry elsewhere); once those open are
        answered, GOAWAY and close."""
        if self._going_away:
            return
        self._going_away = True
        if not self.rpcs:
            self._say_goodbye()

    def _say_goodbye(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.http2.close_connection()
        self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._write()
            self.transport.close()

    # events

    def _request(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self._going_away:
            self.http2.reset_stream(stream_id, Http2ErrorCode.REFUSED_STREAM)
            return
        values = dict(headers)
        path = values.get(b":path", b"")
        if values.get(b":method") != b"POST":
            self._refuse_http(stream_id, b"405")
            return
        if not values.get(b"content-type", b"").startswith(b"application/grpc"):
            self._refuse_http(stream_id, b"415")
            return
        method = self.methods.get(path[len(PATH_PREFIX) :]) if path.startswith(PATH_PREFIX) else None
        if method is None:
            shown = path.decode("latin-1")[:200]
            self._refuse(stream_id, Status.UNIMPLEMENTED, f"Method not found: {shown}")
            return
        if self.open.rpcs >= self.limits.max_connections:
            count = self.open.rpcs
            self._refuse(
                stream_id, Status.RESOURCE_EXHAUSTED, f"this gateway process has {count} RPCs in flight"
            )
            return
        rpc = Rpc(self, stream_id, path.decode("latin-1"), method)
        self.rpcs[stream_id] = rpc
        self.open.rpcs += 1
        self.idle.clear()
        try:
            self._read_headers(rpc, headers)
        except RpcError as exc:
            self._finish(rpc, exc)
            return
        self._unarmed.append(rpc)  # its first message must come within the body timeout
        authenticate = self.limits.authenticate
        if authenticate is not None and not method.open:
            try:
                gate = authenticate(rpc.metadata.get("authorization"))
            except Exception as exc:  # no key, or a wrong one: answered once its request is in
                rpc.refusal = self.limits.failure(exc, rpc)
                return
            if gate is not None:
                rpc.gate, rpc.early = gate, []
                gate.add_done_callback(lambda done: self._gate_ended(rpc, done))
                return
        self._serve(rpc)

    def _serve(self, rpc: Rpc) -> None:
        """The key is good (or none is needed): a streaming RPC's handler starts now, a unary
        one's once its message is in."""
        streaming = rpc.method.streaming
        if streaming is not None:
            rpc.messages = asyncio.Queue()
            self._start(rpc, _streamed(rpc, streaming(_messages(rpc), rpc)))

    def _gate_ended(self, rpc: Rpc, gate: asyncio.Future[Any]) -> None:
        early, rpc.gate, rpc.early = rpc.early or [], None, None
        if rpc.ended:
            return
        error = None if gate.cancelled() else gate.exception()
        if gate.cancelled() or error is not None:
            rpc.refusal = self.limits.failure(error or RpcError(Status.CANCELLED, "cancelled"), rpc)
            if early:  # the client's request is in, or part of it
                self._finish(rpc, rpc.refusal)
            self._flush()
            return
        self._serve(rpc)
        rpc.hold.release()  # what came is counted again as it is read now
        for data in early:
            if rpc.ended:
                break
            if data is None:
                self._ended(rpc.stream_id)
            else:
                self._data(rpc.stream_id, data)
        self._flush()

    def _read_headers(self, rpc: Rpc, headers: list[Any]) -> None:
        if len(headers) > self.limits.max_headers:
            raise RpcError(Status.RESOURCE_EXHAUSTED, f"more than {self.limits.max_headers} headers")
        metadata = rpc.metadata
        for name, value in headers:
            if name[:1] == b":" or name.endswith(b"-bin"):
                continue
            if name == b"grpc-timeout":
                rpc.deadline = time.monotonic() + timeout_s(value)
            elif name == b"grpc-encoding":
                if value not in (b"identity", b"gzip", b"deflate"):
                    raise RpcError(
                        Status.UNIMPLEMENTED,
                        f"grpc-encoding {value.decode('latin-1')[:40]!r} is not supported: "
                        "identity, gzip or deflate",
                    )
                rpc.encoding = value
            else:
                metadata[name.decode("latin-1")] = value.decode("latin-1")

    def _data(self, stream_id: int, data: bytes) -> None:
        rpc = self.rpcs.get(stream_id)
        if rpc is None or rpc.ended:
            return
        if rpc.refusal is not None:  # nothing of a refused key's request is read
            self._finish(rpc, rpc.refusal)
            return
        if rpc.early is not None:  # its key is being looked up: kept as it came, not read yet
            try:
                rpc.hold.add(len(data))
            except Exception as exc:
                self._finish(rpc, self.limits.failure(exc, rpc))
                return
            rpc.early.append(data)
            return
        limit = OPEN_MESSAGE_BYTES if rpc.method.open else self.limits.max_message_bytes
        try:
            rpc.hold.add(len(data))
            for compressed, body in messages.read(rpc, data, limit):
                self._message(rpc, messages.inflated(rpc, body, limit) if compressed else body)
                if rpc.ended:
                    return
        except RpcError as exc:
            self._finish(rpc, exc)
        except Exception as exc:  # a FunctionError of the handler's, or a bug
            self._finish(rpc, self.limits.failure(exc, rpc))

    def _message(self, rpc: Rpc, payload: Buffer) -> None:
        method = rpc.method
        if len(payload) >= messages.SCAN_FROM_BYTES and method.nested is not None:
            messages.count_fields(payload, method.nested)
        try:
            message = method.parse(payload)
        except Exception as exc:  # protobuf's DecodeError, or a message nested too deep
            raise InvalidArgument(f"the request message could not be parsed ({type(exc).__name__})") from exc
        if rpc.timer is not None:  # the first message is in
            rpc.timer.cancel()
            rpc.timer = None
        if rpc.messages is not None:
            if rpc.messages.qsize() >= MAX_QUEUED_MESSAGES:
                raise RpcError(Status.RESOURCE_EXHAUSTED, "too many requests waiting on this stream")
            rpc.messages.put_nowait(message)
            return
        if rpc.answering is not None:
            raise RpcError(Status.UNIMPLEMENTED, f"{rpc.name} takes one request message")
        unary = method.unary
        assert unary is not None
        self._start(rpc, unary(message, rpc))

    def _ended(self, stream_id: int) -> None:
        rpc = self.rpcs.get(stream_id)
        if rpc is None or rpc.ended:
            return
        if rpc.refusal is not None:
            self._finish(rpc, rpc.refusal)
            return
        if rpc.early is not None:
            rpc.early.append(None)
            return
        if rpc.messages is not None:
            rpc.messages.put_nowait(None)
        elif rpc.answering is None:
            self._finish(rpc, RpcError(Status.INTERNAL, "the stream ended before a whole request message"))

    def _start(self, rpc: Rpc, answer: Any) -> None:
        if not isinstance(answer, asyncio.Future):
            answer = asyncio.ensure_future(answer)
        rpc.answering = answer
        answer.add_done_callback(lambda done: self._answered(rpc, done))

    def _answered(self, rpc: Rpc, done: asyncio.Future[Any]) -> None:
        if rpc.ended:
            return
        if done.cancelled():
            self._finish(rpc, RpcError(Status.CANCELLED, "the call was cancelled"))
            return
        error = done.exception()
        if error is not None:
            self._finish(rpc, error if isinstance(error, RpcError) else self.limits.failure(error, rpc))
            return
        answer = done.result()
        if answer is not None:
            self.send_message(rpc, answer.SerializeToString())
        self._finish(rpc, None)

    def _too_slow(self, rpc: Rpc) -> None:
        rpc.timer = None
        if rpc.refusal is not None:
            self._finish(rpc, rpc.refusal)
            return
        timeout_s = self.limits.body_timeout_s
        self._finish(
            rpc,
            RpcError(Status.DEADLINE_EXCEEDED, f"the request did not arrive within {timeout_s:g} s"),
        )

    def _reset_by_client(self, stream_id: int) -> None:
        rpc = self.rpcs.get(stream_id)
        if rpc is not None:
            self._forget(rpc, cancel=True)
        if self._resets.over():
            self._calm_down(b"too many resets")

    def _calm_down(self, why: bytes) -> None:
        """End a connection whose client sends what costs the gateway and serves nobody."""
        self.http2.close_connection(Http2ErrorCode.ENHANCE_YOUR_CALM, additional_data=why)
        self._close()

    def _window_opened(self, stream_id: int) -> None:
        if stream_id:
            rpc = self.rpcs.get(stream_id)
            if rpc is not None and stream_id in self._pending:
                self._send_pending(rpc)
            return
        connection = self.http2
        while self._starved and connection.send_window > 0:  # O(streams it serves), not O(parked)
            starved_id = next(iter(self._starved))
            del self._starved[starved_id]
            rpc = self.rpcs.get(starved_id)
            if rpc is not None and starved_id in self._pending:
                self._send_pending(rpc)

    # answers

    def send_message(self, rpc: Rpc, payload: bytes) -> None:
        if rpc.ended or self.transport is None or self.transport.is_closing():
            return
        connection, stream_id = self.http2, rpc.stream_id
        if not rpc.responded:
            rpc.responded = True
            connection.send_headers(stream_id, RESPONSE_HEADERS)
        framed = messages.framed(payload)
        if stream_id not in self._pending and len(framed) <= min(
            connection.window(stream_id), connection.max_outbound_frame_size
        ):
            connection.send_data(stream_id, framed)  # the usual case: it fits, in one frame
        else:
            self._park(rpc, framed)
        self._flush()

    def _park(self, rpc: Rpc, framed: bytes) -> None:
        """Answer bytes past the client's window wait for it, within the connection's and the
        process's bounds, and no longer than the drain timeout without progress."""
        size, cap = len(framed), self.limits.max_parked_bytes
        if self._parked + size > cap or self.open.parked_bytes + size > 4 * cap:
            self._finish(
                rpc,
                RpcError(Status.RESOURCE_EXHAUSTED, "answers wait for clients that do not read them"),
            )
            return
        self._parked += size
        self.open.parked_bytes += size
        self._pending.setdefault(rpc.stream_id, bytearray()).extend(framed)
        rpc.progress_at = self._loop.time()
        if rpc.drain_timer is None:
            rpc.drain_timer = self._loop.call_later(self.limits.drain_timeout_s, self._drain_check, rpc)
        self._send_pending(rpc)

    def _drain_check(self, rpc: Rpc) -> None:
        rpc.drain_timer = None
        if rpc.stream_id not in self._pending or self.rpcs.get(rpc.stream_id) is not rpc:
            return
        waited = self._loop.time() - rpc.progress_at
        timeout_s = self.limits.drain_timeout_s
        if waited < timeout_s:
            rpc.drain_timer = self._loop.call_later(timeout_s - waited, self._drain_check, rpc)
            return
        log.debug("a gRPC client took nothing of an answer for %g s: its stream is reset", timeout_s)
        self._forget(rpc, cancel=True)
        self.http2.reset_stream(rpc.stream_id, Http2ErrorCode.CANCEL)
        self._flush()

    def _send_pending(self, rpc: Rpc) -> None:
        """What the stream's window takes of its answer bytes; then its trailers, if they wait."""
        stream_id = rpc.stream_id
        pending = self._pending.get(stream_id)
        connection = self.http2
        sent = 0
        while pending:
            size = min(len(pending), connection.window(stream_id), connection.max_outbound_frame_size)
            if size <= 0:
                if connection.send_window <= 0:
                    self._starved[stream_id] = None
                break
            connection.send_data(stream_id, bytes(pending[:size]))
            del pending[:size]
            sent += size
        if sent:
            self._parked -= sent
            self.open.parked_bytes -= sent
            rpc.progress_at = self._loop.time()
            self._flush()
        if pending:
            return
        self._pending.pop(stream_id, None)
        if rpc.trailers is not None:  # they waited for the data
            self._send_trailers(rpc, rpc.trailers)
        self._flush()

    def _finish(self, rpc: Rpc, error: RpcError | None) -> None:
        """End the RPC with its status (OK without `error`)."""
        if rpc.ended:
            return
        _settle(rpc)
        rpc.buffer = bytearray()
        trailers = [(b"grpc-status", b"0")] if error is None else _status_of(error)
        if rpc.timing and error is None:
            trailers.append((b"server-timing", rpc.timing))
        if self.transport is None or self.transport.is_closing():
            self._forget(rpc)
            return
        if rpc.stream_id in self._pending:  # the answer waits for the client's window: so do these
            rpc.trailers = trailers
            self._give_back_place(rpc)  # answered: bytes in wait hold no place of the process's
            return
        self._send_trailers(rpc, trailers)

    def _send_trailers(self, rpc: Rpc, trailers: list[tuple[bytes, bytes]]) -> None:
        """The RPC's status: trailers after its answer, or the only headers of one that failed."""
        self._end_stream(rpc.stream_id, trailers if rpc.responded else [*TRAILERS_ONLY, *trailers])
        self._forget(rpc)
        self._flush()

    def _end_stream(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The stream's last headers; a client still sending is then told to stop (RST_STREAM
        NO_ERROR), as gRPC's HTTP/2 mapping asks."""
        self.http2.send_headers(stream_id, headers, end_stream=True)
        if self.http2.remote_open(stream_id):
            self.http2.reset_stream(stream_id, Http2ErrorCode.NO_ERROR)

    def _forget(self, rpc: Rpc, cancel: bool = False) -> None:
        _settle(rpc)
        if cancel and rpc.answering is not None and not rpc.answering.done():
            rpc.answering.cancel()  # a task, or a future whose cancel reaches the invocation
        if rpc.gate is not None:
            rpc.early = None
        if rpc.drain_timer is not None:
            rpc.drain_timer.cancel()
            rpc.drain_timer = None
        pending = self._pending.pop(rpc.stream_id, None)
        if pending:
            self._parked -= len(pending)
            self.open.parked_bytes -= len(pending)
        self._starved.pop(rpc.stream_id, None)
        if self.rpcs.pop(rpc.stream_id, None) is None:
            return
        self._give_back_place(rpc)
        if not self.rpcs:
            self.last_active = self._loop.time()
            self.idle.set()
            if self._going_away:
                self._say_goodbye()

    def _give_back_place(self, rpc: Rpc) -> None:
        if rpc.counted:
            rpc.counted = False
            self.open.rpcs -= 1

    def _refuse(self, stream_id: int, status: Status, message: str) -> None:
        """A stream that never became an RPC, answered with its status alone."""
        self._end_stream(stream_id, [*TRAILERS_ONLY, *_status_of(RpcError(status, message))])

    def _refuse_http(self, stream_id: int, status: bytes) -> None:
        """A request that is not gRPC: an HTTP status alone."""
        self._end_stream(stream_id, [(b":status", status)])

    def _flush(self) -> None:
        """What the connection has to send goes out once this event-loop turn ends: one write for all the
        answers and window updates of the turn, not one for each frame."""
        if not self._flush_soon:
            self._flush_soon = True
            self._loop.call_soon(self._write)

    def _write(self) -> None:
        self._flush_soon = False
        data = self.http2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


def _settle(rpc: Rpc) -> None:
    """An RPC that takes nothing more: no timer, and its bytes given back to the budget."""
    rpc.ended = True
    if rpc.timer is not None:
        rpc.timer.cancel()
        rpc.timer = None
    rpc.hold.release()


def _status_of(error: RpcError) -> list[tuple[bytes, bytes]]:
    return [
        (b"grpc-status", b"%d" % error.status),
        (b"grpc-message", percent_encoded(error.message)),
        *((name.encode(), value.encode()) for name, value in error.trailers),
    ]


class _PerSecond:
    """Events of one kind in the current second, against their limit."""

    __slots__ = ("_count", "_limit", "_since")

    def __init__(self, limit: int) -> None:
        self._limit, self._count, self._since = limit, 0, 0.0

    def over(self) -> bool:
        """Count one more; whether that passes the limit."""
        now = time.monotonic()
        if now - self._since >= 1.0:
            self._count, self._since = 0, now
        self._count += 1
        return self._count > self._limit


async def _streamed(rpc: Rpc, answers: AsyncIterator[Any]) -> None:
    async for answer in answers:
        rpc.send(answer)


async def _messages(rpc: Rpc) -> AsyncIterator[Any]:
    queue = rpc.messages
    assert queue is not None
    while (message := await queue.get()) is not None:
        if queue.empty() and rpc.size is None and not rpc.buffer:
            rpc.hold.release()  # what was received is taken: the budget has it back
        yield message
