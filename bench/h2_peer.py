"""A client side of HTTP/2 made of raw frames, for probing what a server does with frames no
library would send (bench.rfc9113's probes). It writes exactly the bytes it is given, and checks
what the server sends back against what RFC 9113 asks of every server, on every frame it reads:
SETTINGS first, no frame past the client's SETTINGS_MAX_FRAME_SIZE, no undefined flag or reserved
bit set, no PUSH_PROMISE, DATA within the windows the client gave, header blocks that decode (HPACK
in step) into well-formed responses. A breach raises AssertionError where it is read.

Every wait is bounded (`TIMEOUT_S`); `barrier()` tells when the server has acted on everything sent
before it, without sleeping."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
TIMEOUT_S = 5.0
"""The longest any one wait for the server takes."""
bare_closes: list[int] | None = None
"""None: a connection error needs a GOAWAY of its code. A list: a close without GOAWAY counts as
one too (RFC 9113 5.4.1 only says an endpoint SHOULD send GOAWAY first; h2spec counts such a
close), and each such close appends the code asked for to it."""
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
DEFINED_FLAGS = {
    DATA: END_STREAM | PADDED,
    HEADERS: END_STREAM | END_HEADERS | PADDED | PRIORITY_FLAG,
    PRIORITY: 0,
    RST_STREAM: 0,
    SETTINGS: ACK,
    PUSH_PROMISE: END_HEADERS | PADDED,
    PING: ACK,
    GOAWAY: 0,
    WINDOW_UPDATE: 0,
    CONTINUATION: END_HEADERS,
}
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = range(1, 6)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = range(4)
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = range(5, 10)
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
CONNECTION_FIELDS = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)

LIVE = b"/inference.GRPCInferenceService/ServerLive"
LIVE_BODY = b"\x00\x00\x00\x00\x00"
"""A ServerLiveRequest (empty) as one gRPC message: no compression, length 0."""

Headers = list[tuple[bytes, bytes]]


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame, exactly as given (stream_id may carry the reserved bit)."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream_id) + payload


def settings(values: Mapping[int, int] | Iterable[tuple[int, int]] = ()) -> bytes:
    pairs = values.items() if isinstance(values, Mapping) else values
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", code, value) for code, value in pairs))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))


def request(path: bytes = LIVE, extra: Headers | None = None) -> Headers:
    """A gRPC request's header list, as grpc's clients send it."""
    return [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path),
        (b":authority", b"127.0.0.1"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        *(extra or []),
    ]


@dataclass(frozen=True)
class Frame:
    kind: int
    flags: int
    stream_id: int
    payload: bytes


class Closed(AssertionError):
    """The server closed the connection while a probe still waited for something else."""


class Peer:
    """One client connection, its frames written raw, the server's frames read and checked."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, initial_window: int
    ) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.frames: list[Frame] = []
        self.server_settings: dict[int, int] = {}
        self.settings_acks = 0
        self.pings: list[bytes] = []
        """Payloads of the PING ACKs received, in order."""
        self.resets: dict[int, int] = {}
        self.goaway: tuple[int, int] | None = None
        """(last stream id, error code) of the server's last GOAWAY."""
        self.closed = False
        self.blocks: dict[int, list[Headers]] = {}
        """Each stream's header blocks from the server, decoded, in order."""
        self.data: dict[int, bytearray] = {}
        self.ended: set[int] = set()
        """Streams the server ended (END_STREAM)."""
        self.auto_window = True
        """Give back each DATA frame's window at once; a probe of flow control turns it off."""
        self.max_frame_size = DEFAULT_FRAME_SIZE
        self.receive_window = DEFAULT_WINDOW
        """What the server may still send on the connection."""
        self.stream_receive: dict[int, int] = {}
        self.initial_window = initial_window
        """SETTINGS_INITIAL_WINDOW_SIZE as the server has acknowledged it."""
        self._unacknowledged = [initial_window]
        """Initial window sizes sent in SETTINGS (the preface's first), each taking effect at its ACK."""
        self.send_window = DEFAULT_WINDOW
        """What this side may still send on the connection."""
        self.stream_send: dict[int, int] = {}
        self._block: tuple[int, int, bytearray] | None = None
        self._buffer = b""
        self._next_stream = 1
        self._ping = itertools.count()

    @classmethod
    async def connect(cls, port: int, values: Mapping[int, int] | None = None) -> Peer:
        """Connected, its preface and SETTINGS (`values`, and ENABLE_PUSH 0) sent, the server's
        SETTINGS in and acknowledged."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        chosen = {ENABLE_PUSH: 0, **(values or {})}
        peer = cls(reader, writer, chosen.get(INITIAL_WINDOW_SIZE, DEFAULT_WINDOW))
        writer.write(PREFACE + settings(chosen))
        await peer.read(lambda: bool(peer.frames))
        return peer

    # what the client sends

    def send(self, *frames: bytes) -> None:
        self.writer.write(b"".join(frames))

    def next_id(self) -> int:
        stream_id, self._next_stream = self._next_stream, self._next_stream + 2
        return stream_id

    def skip_to(self, stream_id: int) -> None:
        self._next_stream = stream_id

    def block(self, headers: Headers) -> bytes:
        return self.encoder.encode(headers)

    def headers(self, stream_id: int, headers: Headers, flags: int = END_HEADERS) -> bytes:
        return frame(HEADERS, flags, stream_id, self.block(headers))

    def open(self, headers: Headers | None = None, body: bytes | None = LIVE_BODY, end: bool = True) -> int:
        """A new stream: its headers, then `body` (none: no DATA frame); END_STREAM with the last
        frame when `end`. Sent at once."""
        stream_id = self.next_id()
        ends_with_headers = end and body is None
        frames = [
            self.headers(
                stream_id, headers or request(), END_HEADERS | (END_STREAM if ends_with_headers else 0)
            )
        ]
        if body is not None:
            frames.append(self.data_frame(stream_id, body, end))
        self.send(*frames)
        return stream_id

    def data_frame(self, stream_id: int, body: bytes, end: bool = False) -> bytes:
        """A DATA frame, counted against this side's windows."""
        self.send_window -= len(body)
        window = self.stream_send.setdefault(
            stream_id, self.server_settings.get(INITIAL_WINDOW_SIZE, DEFAULT_WINDOW)
        )
        self.stream_send[stream_id] = window - len(body)
        return frame(DATA, END_STREAM if end else 0, stream_id, body)

    def change_settings(self, pairs: Iterable[tuple[int, int]]) -> None:
        """A SETTINGS frame of `pairs`, in their order; this side counts by the last
        SETTINGS_INITIAL_WINDOW_SIZE among them from the server's ACK on."""
        pairs = list(pairs)
        sizes = [value for code, value in pairs if code == INITIAL_WINDOW_SIZE]
        self._unacknowledged.append(sizes[-1] if sizes else self.initial_window)
        self.send(settings(pairs))

    def grant(self, stream_id: int, increment: int) -> None:
        """WINDOW_UPDATE: the server may send `increment` more on the stream (or the connection)."""
        self.send(window_update(stream_id, increment))
        if stream_id:
            self.stream_receive[stream_id] = (
                self.stream_receive.get(stream_id, self.initial_window) + increment
            )
        else:
            self.receive_window += increment

    def close(self) -> None:
        self.writer.close()

    # what the server sends

    async def read(self, done: Callable[[], bool], timeout_s: float | None = None) -> None:
        """Take the server's frames until `done()`; raises Closed if the connection ends first,
        AssertionError if `timeout_s` (TIMEOUT_S) passes."""
        timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                while not done():
                    if self.closed:
                        raise Closed(f"the server closed the connection; its last frames: {self.frames[-4:]}")
                    await self._read_some()
        except TimeoutError:
            raise AssertionError(
                f"nothing of what was awaited in {timeout_s:g} s; last frames: {self.frames[-4:]}"
            ) from None

    async def _read_some(self) -> None:
        try:
            chunk = await self.reader.read(65_536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            self.closed = True
            return
        buffer = self._buffer + chunk
        position = 0
        while len(buffer) - position >= 9:
            length = int.from_bytes(buffer[position : position + 3], "big")
            if len(buffer) - position - 9 < length:
                break
            kind, flags, raw_id = struct.unpack_from(">BBI", buffer, position + 3)
            payload = buffer[position + 9 : position + 9 + length]
            position += 9 + length
            self._take(Frame(kind, flags, raw_id, payload), length)
        self._buffer = buffer[position:]

    def _take(self, received: Frame, length: int) -> None:
        kind, flags, stream_id, payload = received.kind, received.flags, received.stream_id, received.payload
        if not self.frames:
            assert kind == SETTINGS and not flags & ACK, (
                f"RFC 9113 3.4: the server's first frame is {received}"
            )
        self.frames.append(received)
        assert length <= self.max_frame_size, f"RFC 9113 4.2: a frame of {length} bytes from the server"
        assert not stream_id & 0x8000_0000, f"RFC 9113 4.1: the reserved bit set in {received}"
        if kind in DEFINED_FLAGS:
            assert not flags & ~DEFINED_FLAGS[kind], f"RFC 9113 4.1: undefined flags sent in {received}"
        assert kind != PUSH_PROMISE, "RFC 9113 8.4: the server pushed with SETTINGS_ENABLE_PUSH 0"
        if self._block is not None:
            assert kind == CONTINUATION and stream_id == self._block[0], (
                f"RFC 9113 4.3: {received} inside a field block"
            )
        if kind == SETTINGS:
            self._settings(flags, payload)
        elif kind == PING:
            if flags & ACK:
                self.pings.append(payload)
            else:
                self.send(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            last, code = struct.unpack_from(">II", payload)
            self.goaway = (last & 0x7FFF_FFFF, code)
        elif kind == RST_STREAM:
            self.resets[stream_id] = struct.unpack(">I", payload)[0]
        elif kind == WINDOW_UPDATE:
            increment = struct.unpack(">I", payload)[0] & 0x7FFF_FFFF
            if stream_id:
                self.stream_send[stream_id] = self.stream_send.get(stream_id, 0) + increment
            else:
                self.send_window += increment
        elif kind in (HEADERS, CONTINUATION):
            self._header_frame(kind, flags, stream_id, payload)
        elif kind == DATA:
            self._data(flags, stream_id, payload)

    def _settings(self, flags: int, payload: bytes) -> None:
        if flags & ACK:
            self.settings_acks += 1
            if self._unacknowledged:
                size = self._unacknowledged.pop(0)
                delta, self.initial_window = size - self.initial_window, size
                for stream_id in self.stream_receive:
                    self.stream_receive[stream_id] += delta
            return
        for offset in range(0, len(payload), 6):
            code, value = struct.unpack_from(">HI", payload, offset)
            if code == INITIAL_WINDOW_SIZE:
                delta = value - self.server_settings.get(INITIAL_WINDOW_SIZE, DEFAULT_WINDOW)
                for stream_id in self.stream_send:
                    self.stream_send[stream_id] += delta
            self.server_settings[code] = value
        self.send(frame(SETTINGS, ACK, 0))

    def _header_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == HEADERS:
            start, end = 0, len(payload)
            if flags & PADDED:
                start, end = 1, end - payload[0]
            if flags & PRIORITY_FLAG:
                start += 5
            self._block = (stream_id, flags, bytearray(payload[start:end]))
        else:
            assert self._block is not None, "RFC 9113 6.10: a CONTINUATION without its HEADERS"
            self._block[2].extend(payload)
        if not flags & END_HEADERS:
            return
        stream_id, first_flags, block = self._block
        self._block = None
        try:
            headers = [
                (bytes(name), bytes(value)) for name, value in self.decoder.decode(bytes(block), raw=True)
            ]
        except hpack.HPACKError as exc:
            raise AssertionError(
                f"RFC 9113 4.3: a header block from the server does not decode ({exc!r})"
            ) from exc
        blocks = self.blocks.setdefault(stream_id, [])
        _check_response_block(headers, first=not blocks)
        blocks.append(headers)
        if first_flags & END_STREAM:
            self.ended.add(stream_id)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        size = len(payload)
        window = self.stream_receive.get(stream_id, self.initial_window) - size
        self.receive_window -= size
        assert window >= 0 and self.receive_window >= 0, (
            f"RFC 9113 6.9.1: the server sent DATA past the client's window ({window}, {self.receive_window})"
        )
        self.stream_receive[stream_id] = window
        start, end = (1, size - payload[0]) if flags & PADDED else (0, size)
        self.data.setdefault(stream_id, bytearray()).extend(payload[start:end])
        if flags & END_STREAM:
            self.ended.add(stream_id)
        if self.auto_window and size:
            self.send(window_update(0, size))
            self.receive_window += size
            if not flags & END_STREAM:
                self.send(window_update(stream_id, size))
                self.stream_receive[stream_id] += size

    # what probes wait for

    async def barrier(self) -> None:
        """Return once the server has acted on every frame sent before: a PING's ACK, then a
        second PING's, sent after the first ACK, so that it is read in a later turn than anything
        sent before the first (whatever that turn wrote reached this side before the second ACK)."""
        for _ in range(2):
            await self.ping(b"%08d" % next(self._ping))

    async def ping(self, payload: bytes) -> None:
        """A PING, and its ACK awaited."""
        self.send(frame(PING, 0, 0, payload))
        await self.read(lambda: payload in self.pings)

    async def connection_error(self, code: int) -> None:
        """The server ends the connection (RFC 9113 5.4.1: it MUST close it) with a GOAWAY of
        `code` before the close."""
        try:
            await self.read(lambda: False)
        except Closed:
            pass
        except AssertionError:
            if self.goaway is None:
                raise AssertionError(
                    f"neither a GOAWAY nor the close; last frames: {self.frames[-3:]}"
                ) from None
            raise AssertionError(
                f"GOAWAY {self.goaway[1]} (asked: {code}), then the connection left open"
            ) from None
        if self.goaway is None and bare_closes is not None:
            bare_closes.append(code)
            return
        assert self.goaway is not None, f"closed without a GOAWAY; last frames: {self.frames[-3:]}"
        assert self.goaway[1] == code, f"GOAWAY {self.goaway[1]}, not {code}"

    async def stream_error(self, stream_id: int, *codes: int) -> None:
        """A stream error of one of `codes`: RST_STREAM on the stream, or (RFC 9113 5.4.1 lets a
        stream error be treated as a connection error) a GOAWAY of that code and the close."""
        with contextlib.suppress(Closed):
            await self.read(
                lambda: stream_id in self.resets or self.goaway is not None or stream_id in self.ended
            )
        assert stream_id in self.resets or stream_id not in self.ended, (
            f"stream {stream_id} answered, not reset: {self.blocks.get(stream_id)}"
        )
        if stream_id in self.resets:
            assert self.resets[stream_id] in codes, (
                f"stream {stream_id} reset with {self.resets[stream_id]}, not {codes}"
            )
            return
        await self.connection_error(self.goaway[1] if self.goaway and self.goaway[1] in codes else codes[0])

    async def answered(self, stream_id: int, status: bytes | None = b"0") -> Headers:
        """The stream's trailers once it ends, not reset; asserts its grpc-status (any, if None)."""
        await self.read(lambda: stream_id in self.ended or stream_id in self.resets)
        assert stream_id not in self.resets, f"stream {stream_id} reset with {self.resets[stream_id]}"
        trailers = self.blocks[stream_id][-1]
        found = dict(trailers).get(b"grpc-status")
        assert found is not None and (status is None or found == status), trailers
        return trailers

    async def serves(self) -> None:
        """The connection still serves a call (and HPACK is in step both ways)."""
        await self.answered(self.open())
        assert self.goaway is None, self.goaway


def _check_response_block(headers: Headers, first: bool) -> None:
    """RFC 9113 8.2 and 8.3: lowercase names, no connection-specific field; a response's first
    block opens with :status and has no other pseudo-header; trailers have none."""
    pseudo = [name for name, _ in headers if name[:1] == b":"]
    if first:
        assert pseudo == [b":status"] and headers[0][0] == b":status", (
            f"RFC 9113 8.3.2: a response head {headers}"
        )
    else:
        assert not pseudo, f"RFC 9113 8.1: pseudo-headers in trailers {headers}"
    for name, _ in headers:
        assert name == name.lower(), f"RFC 9113 8.2: {name!r} from the server"
        assert name not in CONNECTION_FIELDS, f"RFC 9113 8.2.2: {name!r} from the server"
