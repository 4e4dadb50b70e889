"""The server side of one HTTP/2 connection (RFC 9113), without I/O, made for what gRPC needs of it:
bytes in, events out (`receive`), frames queued for the transport to write (`data_to_send`).

Why the gateway has its own: h2, a general implementation in pure Python, spent 65 µs of a unary
call's CPU on frame objects, stream state machines and flow-control bookkeeping, more than the rest
of the gRPC front end's own work (`python -m bench.h2_cost` measures both). This one parses a frame
header with one struct call, keeps a stream as a few slots, and hands events on as tuples. It
meets each requirement of RFC 9113 that bench.rfc9113 probes but one left out on purpose
(tests/gateway/grpc/test_rfc9113.py, gateway/grpc/fields.py), and answers a unary RPC for 0.2-0.3
of the CPU that grpcio's server (C-core) spends on it (`python -m bench.grpc_engine`,
docs/benchmarks/grpc-engine.md).

What it keeps to, and how it answers a peer that does not:
- Frames: the preface first, then SETTINGS; no frame over SETTINGS_MAX_FRAME_SIZE (16 KiB, the
  default, which it never raises), so at most one frame is ever buffered; CONTINUATION only right
  after its HEADERS; lengths and stream ids each type requires; padding within its frame. A breach
  is a connection error: GOAWAY with its code, then `ProtocolError` for the transport to close.
  (RFC 9113 5.4.1 lets an endpoint treat any stream error as a connection error; one that sends
  broken frames is not a client worth keeping.)
- Streams: client-initiated (odd, ascending ids); past `max_streams` open at once a new one is
  refused (RST_STREAM REFUSED_STREAM, its header block still decoded to keep HPACK's table).
  HEADERS or DATA on a stream this side reset while the client could still send are dropped (the
  client sent them before it read the reset), on any other closed stream they are a breach, as are
  HEADERS on a stream id the client skipped; WINDOW_UPDATE and RST_STREAM on a closed stream are
  ignored.
- Flow control: the peer's windows are kept per stream and for the connection
  (`send_window`), and nothing is sent past them. Received bytes are given back with WINDOW_UPDATE
  as they arrive, once half of a window is used: a client's sends never stall on the gateway's
  reading, and no window can be overrun; the transport bounds what it holds with its decode allowance.
- HPACK: hpack's encoder and decoder (gateway.grpc.hpack_memo's, which remember the blocks gRPC
  repeats), the header list bounded by `max_header_list_size` and the compressed block by twice it.
- Messages (RFC 9113 8): a request whose fields gateway.grpc.fields judges malformed, whose
  trailers are, or whose DATA does not add up to its content-length is reset (PROTOCOL_ERROR, a
  stream error): before its REQUEST event, or with a RESET event after it. The judgement is
  remembered with the block's decoding, so a block gRPC repeats is judged once.
- PING is answered, PRIORITY ignored (but for a stream that depends on itself, a PROTOCOL_ERROR),
  PUSH_PROMISE refused, frames of unknown types ignored.
"""

from __future__ import annotations

import enum
import struct
import time
from typing import Literal

import hpack

from gateway.grpc import fields, hpack_memo

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_FRAME_SIZE = 16_384
"""The largest frame payload taken (the protocol's default, never raised)."""
DEFAULT_WINDOW = 65_535
MAX_ENCODER_TABLE = 4096
"""The most of a client's SETTINGS_HEADER_TABLE_SIZE this side's HPACK encoder uses (RFC 7541 4.2
lets an encoder use less): a table of 2^32-1 would make every answer's encoding search it."""
MAX_CONTINUATIONS = 32
"""CONTINUATION frames one header block may take (each carries at least nothing: a stream of
empty ones would otherwise never end)."""
MAX_IDLE_FRAMES_PER_S = 1000
"""Frames that serve no request a client may send per second (PRIORITY, unknown types, empty DATA,
WINDOW_UPDATE of a closed stream) before its connection is ended with ENHANCE_YOUR_CALM."""
MAX_WINDOW = 2**31 - 1
REMEMBERED_RESETS = 1024
"""Streams this side reset while the client could still send on them, remembered so that what the
client sent before it read the RST_STREAM is dropped (RFC 9113 5.1), where HEADERS or DATA on any
other closed stream is a breach; past this many, the oldest is forgotten."""

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6


class Event(enum.IntEnum):
    """What `receive` reports, as (event, stream id, value) tuples."""

    REQUEST = 0
    """A stream opened; its value is its header list, (name, value) pairs of bytes."""
    DATA = 1
    """Bytes of a stream's body (never empty)."""
    ENDED = 2
    """The client ended its side of the stream (END_STREAM)."""
    WINDOW = 3
    """The peer opened a flow-control window: a stream's, or the connection's (stream id 0); a
    larger SETTINGS_INITIAL_WINDOW_SIZE opens every open stream's."""
    SETTINGS = 4
    """The peer sent SETTINGS (acknowledged already)."""
    PING = 5
    """The peer sent a PING (answered already)."""
    RESET = 6
    """A stream reported open was reset: by the peer (RST_STREAM), or by this side when its request
    turned out malformed (RFC 9113 8.1.1: its trailers, or DATA against its content-length); its
    value is the error code."""
    GOAWAY = 7
    """The peer is going away."""


Headers = list[tuple[bytes, bytes]]
RequestEvent = tuple[Literal[Event.REQUEST], int, Headers]
DataEvent = tuple[Literal[Event.DATA], int, bytes]
ResetEvent = tuple[Literal[Event.RESET], int, int]
SignalEvent = tuple[Literal[Event.ENDED, Event.WINDOW, Event.SETTINGS, Event.PING, Event.GOAWAY], int, None]
Events = list[RequestEvent | DataEvent | ResetEvent | SignalEvent]
"""(event, stream id, value), each kind with its value's type: the type checker follows an event
from its first item (`if event[0] is Event.DATA:` makes `event[2]` bytes)."""


class Http2ErrorCode(enum.IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


class ProtocolError(Exception):
    """The peer broke HTTP/2: a GOAWAY with `code` is queued, and the connection must end."""

    def __init__(self, code: Http2ErrorCode, why: str) -> None:
        super().__init__(why)
        self.code = code


_HEAD = struct.Struct(">HBBBI")
"""A frame header: the 24-bit length as 16 + 8 bits, type, flags, stream id (and its reserved bit)."""
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_GOAWAY = struct.Struct(">II")


class _Stream:
    __slots__ = ("allowance", "length", "local_open", "received", "remote_open", "send_window")

    def __init__(self, send_window: int, allowance: int, length: int | None) -> None:
        self.send_window = send_window
        self.length = length
        """What its content-length says is still to come (None: it has none)."""
        self.received = 0
        """Bytes received since the stream's window was last given back."""
        self.allowance = allowance
        """What the peer may still send on it, as far as it can know: a WINDOW_UPDATE given back
        counts from the end of the read that gave it."""
        self.remote_open = True
        self.local_open = True


class ServerConnection:
    def __init__(
        self, *, max_streams: int, stream_window: int, connection_window: int, max_header_list_size: int
    ) -> None:
        self.max_streams = max_streams
        self.stream_window = stream_window
        self.connection_window = connection_window
        self.max_header_list_size = max_header_list_size
        self.streams: dict[int, _Stream] = {}
        """Streams not yet closed on both sides."""
        self.highest_stream_id = 0
        self.send_window = DEFAULT_WINDOW
        """The connection's window for what this side sends."""
        self.max_outbound_frame_size = MAX_FRAME_SIZE
        self.encoder = hpack_memo.Encoder()
        self.decoder = hpack_memo.Decoder(max_header_list_size)
        self.ended = False
        """A GOAWAY was queued: nothing more is received."""
        self._out = bytearray()
        self._in = b""
        self._preface = False
        self.settled = False
        """The peer's preface and first SETTINGS arrived (the first frame after it must be one)."""
        self._initial_send_window = DEFAULT_WINDOW
        self._received = 0
        """Bytes received on the connection since its window was last given back."""
        self._block: bytearray | None = None
        """A header block waiting for its CONTINUATION frames, with its stream and END_STREAM."""
        self._block_stream = 0
        self._block_ends = False
        self._block_frames = 0
        self._idle_frames = 0
        self._idle_since = 0.0
        self._allowance = connection_window
        """What the peer may still send on the connection, as far as it can know."""
        self._reset: dict[int, None] = {}
        """Streams this side reset while the client could still send on them (in order)."""
        self._granted: list[tuple[_Stream | None, int]] = []
        """Windows given back during this read: the peer can count on them only after it."""

    # what the transport calls

    def initiate(self) -> None:
        """This side's preface: its SETTINGS and the connection's receive window."""
        settings = b"".join(
            _SETTING.pack(code, value)
            for code, value in (
                (SETTINGS_MAX_CONCURRENT_STREAMS, self.max_streams),
                (SETTINGS_INITIAL_WINDOW_SIZE, self.stream_window),
                (SETTINGS_MAX_HEADER_LIST_SIZE, self.max_header_list_size),
            )
        )
        self._frame(SETTINGS, 0, 0, settings)
        if self.connection_window > DEFAULT_WINDOW:
            self._frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.connection_window - DEFAULT_WINDOW))

    def data_to_send(self) -> bytearray:
        out, self._out = self._out, bytearray()
        return out

    def send_headers(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool = False
    ) -> None:
        """A stream's headers (or trailers, with `end_stream`); nothing for a stream that ended."""
        stream = self.streams.get(stream_id)
        if stream is None or not stream.local_open:
            return
        block = self.encoder.encode(headers)
        flags = END_STREAM if end_stream else 0
        size = self.max_outbound_frame_size
        if len(block) <= size:
            self._frame(HEADERS, flags | END_HEADERS, stream_id, block)
        else:
            self._frame(HEADERS, flags, stream_id, block[:size])
            for start in range(size, len(block), size):
                last = start + size >= len(block)
                self._frame(CONTINUATION, END_HEADERS if last else 0, stream_id, block[start : start + size])
        if end_stream:
            self._end_local(stream_id, stream)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """A frame of body: the caller keeps it within `window(stream_id)` and the frame size."""
        stream = self.streams.get(stream_id)
        if stream is None or not stream.local_open:
            return
        size = len(data)
        assert size <= min(self.send_window, stream.send_window, self.max_outbound_frame_size)
        self.send_window -= size
        stream.send_window -= size
        self._frame(DATA, END_STREAM if end_stream else 0, stream_id, data)
        if end_stream:
            self._end_local(stream_id, stream)

    def window(self, stream_id: int) -> int:
        """How much body the peer takes on this stream now (0 for a stream that ended)."""
        stream = self.streams.get(stream_id)
        return 0 if stream is None else min(self.send_window, stream.send_window)

    def remote_open(self, stream_id: int) -> bool:
        """Whether the client may still send on the stream."""
        stream = self.streams.get(stream_id)
        return stream is not None and stream.remote_open

    def reset_stream(self, stream_id: int, code: Http2ErrorCode) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None and stream.remote_open:
            self._remember_reset(stream_id)
        self._frame(RST_STREAM, 0, stream_id, _U32.pack(code))

    def close_connection(
        self, code: Http2ErrorCode = Http2ErrorCode.NO_ERROR, additional_data: bytes = b""
    ) -> None:
        """GOAWAY: no stream past the last one opened will be served."""
        if self.ended:
            return
        self.ended = True
        self._frame(GOAWAY, 0, 0, _GOAWAY.pack(self.highest_stream_id, code) + additional_data)

    # what the peer sends

    def receive(self, data: bytes) -> Events:
        """The events of the frames `data` completes; raises ProtocolError (GOAWAY queued)."""
        if self.ended:
            return []
        buffer = self._in + data if self._in else data
        events: Events = []
        try:
            position = 0
            if not self._preface:
                if len(buffer) < len(PREFACE):
                    if not PREFACE.startswith(buffer):
                        raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "not the HTTP/2 preface")
                    self._in = buffer
                    return events
                if not buffer.startswith(PREFACE):
                    raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "not the HTTP/2 preface")
                self._preface = True
                position = len(PREFACE)
            end = len(buffer)
            unpack = _HEAD.unpack_from
            while end - position >= 9:
                high, low, kind, flags, stream_id = unpack(buffer, position)
                length = high << 8 | low
                if length > MAX_FRAME_SIZE:
                    raise ProtocolError(Http2ErrorCode.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                start = position + 9
                if end - start < length:
                    break
                position = start + length
                self._dispatch(kind, flags, stream_id & MAX_WINDOW, buffer[start:position], events)
                if self.ended:
                    return events
            self._in = buffer[position:] if position < end else b""
        except ProtocolError as exc:
            self.close_connection(exc.code)
            self._in = b""
            raise
        finally:
            if self._granted:
                self._grant()
        return events

    def _grant(self) -> None:
        for stream, size in self._granted:
            if stream is None:
                self._allowance += size
            else:
                stream.allowance += size
        self._granted.clear()

    def _dispatch(self, kind: int, flags: int, stream_id: int, payload: bytes, events: Events) -> None:
        if self._block is not None and kind != CONTINUATION:
            raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "a frame inside a header block")
        if not self.settled:
            if kind != SETTINGS or flags & ACK:
                raise ProtocolError(
                    Http2ErrorCode.PROTOCOL_ERROR, "the preface's SETTINGS did not come first"
                )
            self.settled = True
        if kind == HEADERS:
            self._headers(flags, stream_id, payload, events)
        elif kind == DATA:
            self._data(flags, stream_id, payload, events)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload, events)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload, events)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload, events)
        elif kind == PING:
            _shaped("PING", stream_id == 0, len(payload) == 8)
            if not flags & ACK:
                self._frame(PING, ACK, 0, payload)
                events.append((Event.PING, 0, None))
        elif kind == RST_STREAM:
            _shaped("RST_STREAM", stream_id != 0, len(payload) == 4)
            self._known(stream_id)
            self.streams.pop(stream_id, None)
            self._reset.pop(stream_id, None)
            events.append((Event.RESET, stream_id, _U32.unpack(payload)[0]))
        elif kind == PRIORITY:
            _shaped("PRIORITY", stream_id != 0, len(payload) == 5)
            _depends(stream_id, payload, 0)
            self._idle_frame()
        elif kind == GOAWAY:
            _shaped("GOAWAY", stream_id == 0, len(payload) >= 8)
            events.append((Event.GOAWAY, 0, None))
        elif kind == PUSH_PROMISE:
            raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "a client sent PUSH_PROMISE")
        else:  # an extension this side does not know: ignored, and counted
            self._idle_frame()

    def _headers(self, flags: int, stream_id: int, payload: bytes, events: Events) -> None:
        if stream_id == 0:
            raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        start, end = 0, len(payload)
        if flags & PADDED:
            if not payload:
                raise ProtocolError(Http2ErrorCode.FRAME_SIZE_ERROR, "HEADERS without its pad length")
            start, end = 1, end - payload[0]
        if flags & PRIORITY_FLAG:
            if len(payload) < start + 5:
                raise ProtocolError(Http2ErrorCode.FRAME_SIZE_ERROR, "HEADERS without its priority fields")
            _depends(stream_id, payload, start)
            start += 5
        if end < start:
            raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "HEADERS padding past its frame")
        fragment = payload[start:end]
        if flags & END_HEADERS:
            self._header_block(stream_id, fragment, bool(flags & END_STREAM), events)
        else:
            self._block = bytearray(fragment)
            self._block_stream, self._block_ends = stream_id, bool(flags & END_STREAM)
            self._block_frames = 0
            self._check_block_size()

    def _continuation(self, flags: int, stream_id: int, payload: bytes, events: Events) -> None:
        block = self._block
        if block is None or stream_id != self._block_stream:
            raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        block += payload
        self._block_frames += 1
        if self._block_frames > MAX_CONTINUATIONS:
            raise ProtocolError(Http2ErrorCode.ENHANCE_YOUR_CALM, "a header block of too many CONTINUATIONs")
        self._check_block_size()
        if flags & END_HEADERS:
            self._block = None
            self._header_block(stream_id, bytes(block), self._block_ends, events)

    def _check_block_size(self) -> None:
        if self._block is not None and len(self._block) > 2 * self.max_header_list_size:
            raise ProtocolError(
                Http2ErrorCode.ENHANCE_YOUR_CALM, "a header block past the header list's limit"
            )

    def _header_block(self, stream_id: int, block: bytes, end_stream: bool, events: Events) -> None:
        stream = self.streams.get(stream_id)
        judge = fields.judge_request if stream is None else fields.judge_trailers
        try:  # always decoded, even for a stream refused or ended: HPACK's table must follow the peer's
            headers, (malformed, length) = self.decoder.decode_judged(block, judge)
        except hpack.OversizedHeaderListError as exc:
            raise ProtocolError(Http2ErrorCode.ENHANCE_YOUR_CALM, "a header list past its limit") from exc
        except Exception as exc:  # hpack's HPACKDecodingError, InvalidTableIndex, ...
            raise ProtocolError(
                Http2ErrorCode.COMPRESSION_ERROR, f"a header block HPACK cannot decode ({type(exc).__name__})"
            ) from exc
        if stream is not None:  # trailers: they must end the stream
            if not stream.remote_open:
                raise ProtocolError(Http2ErrorCode.STREAM_CLOSED, "HEADERS after the end of its stream")
            if not end_stream:
                raise ProtocolError(
                    Http2ErrorCode.PROTOCOL_ERROR, "a second header block that does not end its stream"
                )
            if malformed is not None or stream.length:  # or short of its content-length
                self._malformed(stream_id, events)
                return
            stream.remote_open = False
            events.append((Event.ENDED, stream_id, None))
            if not stream.local_open:
                del self.streams[stream_id]
            return
        if stream_id <= self.highest_stream_id:
            self._closed(stream_id, end_stream, Http2ErrorCode.PROTOCOL_ERROR)
            return
        if not stream_id & 1:
            raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "a client opened an even-numbered stream")
        self.highest_stream_id = stream_id
        if len(self.streams) >= self.max_streams:
            self._frame(RST_STREAM, 0, stream_id, _U32.pack(Http2ErrorCode.REFUSED_STREAM))
            if not end_stream:
                self._remember_reset(stream_id)
            return
        if malformed is not None or (end_stream and length):  # RFC 9113 8.1.1: a stream error
            self._frame(RST_STREAM, 0, stream_id, _U32.pack(Http2ErrorCode.PROTOCOL_ERROR))
            if not end_stream:
                self._remember_reset(stream_id)
            return
        stream = self.streams[stream_id] = _Stream(self._initial_send_window, self.stream_window, length)
        events.append((Event.REQUEST, stream_id, headers))
        if end_stream:
            stream.remote_open = False
            events.append((Event.ENDED, stream_id, None))

    def _data(self, flags: int, stream_id: int, payload: bytes, events: Events) -> None:
        if stream_id == 0:
            raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)  # padding included: all of it counts against the windows
        self._received += size
        self._allowance -= size
        if self._allowance < 0:
            raise ProtocolError(Http2ErrorCode.FLOW_CONTROL_ERROR, "DATA past the connection's window")
        if self._received >= self.connection_window // 2:
            self._frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._received))
            self._granted.append((None, self._received))
            self._received = 0
        start, end = 0, size
        if flags & PADDED:
            start, end = _unpadded(payload)
        stream = self.streams.get(stream_id)
        if stream is None:
            self._known(stream_id)
            self._closed(stream_id, bool(flags & END_STREAM), Http2ErrorCode.STREAM_CLOSED)
            return
        if not stream.remote_open:
            raise ProtocolError(Http2ErrorCode.STREAM_CLOSED, "DATA after the end of its stream")
        stream.allowance -= size
        if stream.allowance < 0:
            raise ProtocolError(Http2ErrorCode.FLOW_CONTROL_ERROR, "DATA past its stream's window")
        if stream.length is not None and not self._adds_up(stream_id, stream, end - start, flags, events):
            return
        if end > start:
            events.append((Event.DATA, stream_id, payload[start:end] if end - start < size else payload))
        elif not flags & END_STREAM:
            self._idle_frame()
        if flags & END_STREAM:
            stream.remote_open = False
            events.append((Event.ENDED, stream_id, None))
            if not stream.local_open:
                del self.streams[stream_id]
            return
        stream.received += size
        if stream.received >= self.stream_window // 2:
            self._frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(stream.received))
            self._granted.append((stream, stream.received))
            stream.received = 0

    def _window_update(self, stream_id: int, payload: bytes, events: Events) -> None:
        if len(payload) != 4:
            raise ProtocolError(Http2ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE")
        increment = _U32.unpack(payload)[0] & MAX_WINDOW
        if increment == 0:
            raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        if stream_id == 0:
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ProtocolError(Http2ErrorCode.FLOW_CONTROL_ERROR, "the connection's window past 2^31-1")
        else:
            stream = self.streams.get(stream_id)
            if stream is None:
                self._known(stream_id)
                self._idle_frame()
                return
            stream.send_window += increment
            if stream.send_window > MAX_WINDOW:
                raise ProtocolError(Http2ErrorCode.FLOW_CONTROL_ERROR, "a stream's window past 2^31-1")
        events.append((Event.WINDOW, stream_id, None))

    def _settings(self, flags: int, stream_id: int, payload: bytes, events: Events) -> None:
        if stream_id:
            raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError(Http2ErrorCode.FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ProtocolError(Http2ErrorCode.FRAME_SIZE_ERROR, "SETTINGS of a length not a multiple of 6")
        initial_send_window = self._initial_send_window
        for offset in range(0, len(payload), 6):
            code, value = _SETTING.unpack_from(payload, offset)
            if code == SETTINGS_HEADER_TABLE_SIZE:
                self.encoder.header_table_size = min(value, MAX_ENCODER_TABLE)
            elif code == SETTINGS_ENABLE_PUSH:
                if value > 1:
                    raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "SETTINGS_ENABLE_PUSH past 1")
            elif code == SETTINGS_INITIAL_WINDOW_SIZE:
                self._set_initial_window(value)
            elif code == SETTINGS_MAX_FRAME_SIZE:
                if not MAX_FRAME_SIZE <= value <= 2**24 - 1:
                    raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "SETTINGS_MAX_FRAME_SIZE out of range")
                self.max_outbound_frame_size = value
        self._frame(SETTINGS, ACK, 0, b"")
        events.append((Event.SETTINGS, 0, None))
        if self._initial_send_window > initial_send_window:  # every stream's window opened
            events.extend((Event.WINDOW, stream_id, None) for stream_id in self.streams)

    def _set_initial_window(self, value: int) -> None:
        """SETTINGS_INITIAL_WINDOW_SIZE: every open stream's window moves by the change (RFC 9113
        6.9.2), perhaps below 0."""
        if value > MAX_WINDOW:
            raise ProtocolError(Http2ErrorCode.FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE past 2^31-1")
        delta = value - self._initial_send_window
        self._initial_send_window = value
        for stream in self.streams.values():
            stream.send_window += delta
            if stream.send_window > MAX_WINDOW:
                raise ProtocolError(Http2ErrorCode.FLOW_CONTROL_ERROR, "a stream's window past 2^31-1")

    # helpers

    def _idle_frame(self) -> None:
        now = time.monotonic()
        if now - self._idle_since >= 1.0:
            self._idle_frames, self._idle_since = 0, now
        self._idle_frames += 1
        if self._idle_frames > MAX_IDLE_FRAMES_PER_S:
            raise ProtocolError(Http2ErrorCode.ENHANCE_YOUR_CALM, "too many frames that serve no request")

    def _adds_up(self, stream_id: int, stream: _Stream, size: int, flags: int, events: Events) -> bool:
        """Whether a request's DATA still adds up to its content-length (RFC 9113 8.1.1): past
        it, or ended short of it, the request is malformed."""
        assert stream.length is not None
        stream.length -= size
        if stream.length < 0 or (flags & END_STREAM and stream.length):
            self._malformed(stream_id, events)
            return False
        return True

    def _malformed(self, stream_id: int, events: Events) -> None:
        """A request reported already turned out malformed: a stream error (RFC 9113 8.1.1)."""
        self.reset_stream(stream_id, Http2ErrorCode.PROTOCOL_ERROR)
        events.append((Event.RESET, stream_id, Http2ErrorCode.PROTOCOL_ERROR))

    def _remember_reset(self, stream_id: int) -> None:
        self._reset[stream_id] = None
        if len(self._reset) > REMEMBERED_RESETS:
            del self._reset[next(iter(self._reset))]

    def _closed(self, stream_id: int, end_stream: bool, code: Http2ErrorCode) -> None:
        """HEADERS or DATA on a closed stream (RFC 9113 5.1): dropped, its block decoded and its
        bytes counted already, if this side reset the stream while the client could still send
        on it; otherwise a breach (`code`: PROTOCOL_ERROR for HEADERS, which would open a stream
        whose id is spent, STREAM_CLOSED for DATA)."""
        if stream_id not in self._reset:
            raise ProtocolError(code, "a frame on a closed stream")
        if end_stream:  # the client is done with it
            del self._reset[stream_id]

    def _known(self, stream_id: int) -> None:
        """A frame for a stream not open: one that ended is fine, one never opened is not."""
        if stream_id > self.highest_stream_id:
            raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "a frame for a stream never opened")

    def _end_local(self, stream_id: int, stream: _Stream) -> None:
        stream.local_open = False
        if not stream.remote_open:
            del self.streams[stream_id]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes | bytearray) -> None:
        size = len(payload)
        out = self._out
        out += _HEAD.pack(size >> 8, size & 0xFF, kind, flags, stream_id)
        out += payload


def _unpadded(payload: bytes) -> tuple[int, int]:
    """Where a padded DATA frame's data starts and ends (RFC 9113 6.1)."""
    if not payload:
        raise ProtocolError(Http2ErrorCode.FRAME_SIZE_ERROR, "DATA without its pad length")
    end = len(payload) - payload[0]
    if end < 1:
        raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "DATA padding past its frame")
    return 1, end


def _shaped(name: str, on_its_stream: bool, of_its_length: bool) -> None:
    """A control frame on the stream its type requires (PROTOCOL_ERROR) and of its length
    (FRAME_SIZE_ERROR)."""
    if not on_its_stream:
        raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, f"{name} on the wrong stream")
    if not of_its_length:
        raise ProtocolError(Http2ErrorCode.FRAME_SIZE_ERROR, f"{name} of the wrong length")


def _depends(stream_id: int, payload: bytes, start: int) -> None:
    """Priority fields at `start` (RFC 9113 6.2, 6.3): a stream that depends on itself is a
    PROTOCOL_ERROR (RFC 7540 5.3.1, kept by RFC 9113 5.3.2); the rest is ignored."""
    if _U32.unpack_from(payload, start)[0] & MAX_WINDOW == stream_id:
        raise ProtocolError(Http2ErrorCode.PROTOCOL_ERROR, "a stream that depends on itself")
