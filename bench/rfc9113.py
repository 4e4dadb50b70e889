"""What RFC 9113 (HTTP/2) requires of a server, one probe per requirement a client can test, in
raw frames (bench.h2_peer) against any gRPC server that serves GRPCInferenceService/ServerLive on
cleartext HTTP/2. tests/gateway/grpc/test_rfc9113.py runs every probe against the gateway;
bench.grpc_engine runs them against grpcio's server too.

A probe is named after its requirement and cites its section; it returns when the server met it
and raises AssertionError (NotApplicable where the server gives the probe nothing to test) when
not. What every server frame must be (RFC 9113 3.4, 4.1, 4.2, 4.3, 6.9.1, 8.2, 8.3, 8.4) is
checked by bench.h2_peer on every frame of every probe. Where the RFC asks for a stream error, a
connection error of the same code passes too (RFC 9113 5.4.1 allows it).

    python -m bench.rfc9113 PORT
"""

from __future__ import annotations

import argparse
import asyncio
import struct
from collections.abc import Awaitable, Callable

from bench import h2_peer
from bench.h2_peer import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADER_TABLE_SIZE,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    INTERNAL_ERROR,
    LIVE_BODY,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    PADDED,
    PING,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    Closed,
    Headers,
    Peer,
    frame,
    request,
    settings,
    window_update,
)

Probe = Callable[[int], Awaitable[None]]
PROBES: list[tuple[str, Probe]] = []
"""(section, probe), in the RFC's order."""
MAX_WINDOW = 2**31 - 1


class NotApplicable(Exception):
    """The server gives this probe nothing to test (it advertises no such limit)."""


def probe(section: str) -> Callable[[Probe], Probe]:
    def register(function: Probe) -> Probe:
        PROBES.append((section, function))
        return function

    return register


# How probes end: the server's answer to what they sent.


async def _connection_error(port: int, code: int, build: Callable[[Peer], list[bytes]]) -> None:
    peer = await Peer.connect(port)
    try:
        peer.send(*build(peer))
        await peer.connection_error(code)
    finally:
        peer.close()


async def _stream_error(
    port: int, codes: tuple[int, ...], build: Callable[[Peer], tuple[int, list[bytes]]]
) -> None:
    peer = await Peer.connect(port)
    try:
        stream_id, frames = build(peer)
        peer.send(*frames)
        await peer.stream_error(stream_id, *codes)
    finally:
        peer.close()


async def _still_serves(port: int, build: Callable[[Peer], list[bytes]]) -> Peer:
    """Sends what `build` makes; the connection serves a call after it. The peer stays open."""
    peer = await Peer.connect(port)
    peer.send(*build(peer))
    await peer.serves()
    return peer


async def _malformed(port: int, headers: Headers, trailers: Headers | None = None) -> None:
    """RFC 9113 8.1.1: a malformed request is a stream error of type PROTOCOL_ERROR."""
    peer = await Peer.connect(port)
    try:
        stream_id = peer.next_id()
        frames = [
            peer.headers(stream_id, headers),
            peer.data_frame(stream_id, LIVE_BODY, end=trailers is None),
        ]
        if trailers is not None:
            frames.append(peer.headers(stream_id, trailers, END_HEADERS | END_STREAM))
        peer.send(*frames)
        await peer.stream_error(stream_id, PROTOCOL_ERROR)
    finally:
        peer.close()


async def _each_malformed(port: int, variants: list[Headers]) -> None:
    for headers in variants:
        await _malformed(port, headers)


def _with(extra: Headers) -> Headers:
    return request(extra=extra)


def _replaced(name: bytes, value: bytes | None) -> Headers:
    """A request with `name` given `value` (None: left out)."""
    if value is None:
        return [(field, old) for field, old in request() if field != name]
    return [(field, value if field == name else old) for field, old in request()]


async def _half_closed(port: int) -> tuple[Peer, int]:
    """A stream the client has ended and the server cannot answer yet (the client's windows are
    0): half-closed (remote) for the server."""
    peer = await Peer.connect(port, {INITIAL_WINDOW_SIZE: 0})
    stream_id = peer.open()
    await peer.barrier()
    return peer, stream_id


def _opened(peer: Peer) -> int:
    """A stream opened and left open (its request message still to come)."""
    stream_id = peer.next_id()
    peer.send(peer.headers(stream_id, request()))
    return stream_id


# 3.4 HTTP/2 connection preface


@probe("3.4")
async def an_invalid_preface_ends_the_connection(port: int) -> None:
    """RFC 9113 3.4: an invalid connection preface MUST be treated as a connection error of
    type PROTOCOL_ERROR (the connection closed; a GOAWAY, if any, of that code)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    peer = Peer(reader, writer, DEFAULT_WINDOW)
    peer.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(24))
    try:
        await peer.read(lambda: False)
    except Closed:
        pass
    finally:
        peer.close()
    assert peer.goaway is None or peer.goaway[1] == PROTOCOL_ERROR, peer.goaway


@probe("3.4")
async def the_server_preface_is_settings_and_the_clients_are_acknowledged(port: int) -> None:
    """RFC 9113 3.4: the server's preface MUST be a SETTINGS frame, its first; the SETTINGS of
    the client's preface MUST be acknowledged."""
    peer = await Peer.connect(port)
    try:
        await peer.read(lambda: peer.settings_acks >= 1)
    finally:
        peer.close()


# 4.1 Frame format


@probe("4.1")
async def frames_of_unknown_types_are_ignored(port: int) -> None:
    """RFC 9113 4.1 and 5.5: frames of unknown types MUST be ignored and discarded."""
    peer = await _still_serves(port, lambda peer: [frame(0xBE, 0xFF, 0, b"extension"), frame(0x42, 0, 0)])
    peer.close()


@probe("4.1")
async def undefined_flags_are_ignored(port: int) -> None:
    """RFC 9113 4.1: flags with no semantics for a frame type MUST be ignored."""
    peer = await Peer.connect(port)
    try:
        peer.send(frame(PING, 0xFE, 0, b"flagging"))
        await peer.read(lambda: b"flagging" in peer.pings)
        stream_id = peer.next_id()
        peer.send(
            frame(HEADERS, END_HEADERS | 0x2 | 0x10 | 0x40 | 0x80, stream_id, peer.block(request())),
            frame(DATA, END_STREAM | 0x2 | 0x4 | 0x10 | 0x20, stream_id, LIVE_BODY),
        )
        await peer.answered(stream_id)
    finally:
        peer.close()


@probe("4.1")
async def the_reserved_bit_is_ignored(port: int) -> None:
    """RFC 9113 4.1 and 6.9: the reserved bit of a stream identifier and of a window increment
    MUST be ignored when receiving."""
    peer = await Peer.connect(port)
    try:
        stream_id = peer.next_id()
        peer.send(
            window_update(0, 0x8000_0001),  # an increment of 1, not 2^31 + 1 (past the window's limit)
            frame(HEADERS, END_HEADERS, stream_id | 0x8000_0000, peer.block(request())),
            frame(DATA, END_STREAM, stream_id | 0x8000_0000, LIVE_BODY),
        )
        await peer.answered(stream_id)
    finally:
        peer.close()


# 4.2 Frame size


@probe("4.2")
async def a_frame_of_2_14_octets_is_taken(port: int) -> None:
    """RFC 9113 4.2: an endpoint MUST be capable of receiving frames of up to 2^14 octets: a DATA
    frame of 2^14 octets, one request message (a ServerLiveRequest with an unknown field), is
    taken and its RPC answered (with whatever status the server gives a message of that size)."""
    peer = await Peer.connect(port)
    try:
        filler = 16_384 - 5 - 3  # the message's prefix; the field's tag and 2-octet length
        message = bytes([15 << 3 | 2, filler & 0x7F | 0x80, filler >> 7]) + bytes(filler)
        stream_id = peer.next_id()
        body = struct.pack(">BI", 0, len(message)) + message
        assert len(body) == 16_384
        peer.send(peer.headers(stream_id, request()), peer.data_frame(stream_id, body, end=True))
        await peer.answered(stream_id, status=None)
        assert peer.goaway is None, peer.goaway
    finally:
        peer.close()


@probe("4.2")
async def a_frame_past_max_frame_size_is_a_frame_size_error(port: int) -> None:
    """RFC 9113 4.2: a frame past SETTINGS_MAX_FRAME_SIZE MUST be answered with FRAME_SIZE_ERROR."""

    def build(peer: Peer) -> tuple[int, list[bytes]]:
        stream_id = _opened(peer)
        return stream_id, [frame(DATA, 0, stream_id, bytes(16_385))]

    await _stream_error(port, (FRAME_SIZE_ERROR,), build)


@probe("4.2")
async def a_field_block_frame_past_max_frame_size_is_a_connection_error(port: int) -> None:
    """RFC 9113 4.2: a frame size error in a frame that carries a field block MUST be a connection
    error of type FRAME_SIZE_ERROR."""

    def build(peer: Peer) -> list[bytes]:
        block = peer.encoder.encode(request(extra=[(b"x-filler", b"f" * 16_400)]), huffman=False)
        return [frame(HEADERS, END_HEADERS | END_STREAM, 1, block)]

    await _connection_error(port, FRAME_SIZE_ERROR, build)


@probe("4.2")
async def a_frame_too_small_for_its_fields_is_a_frame_size_error(port: int) -> None:
    """RFC 9113 4.2: a frame too small to contain mandatory frame data (a HEADERS frame with the
    PRIORITY flag and fewer than 5 octets) MUST be answered with FRAME_SIZE_ERROR, a connection
    error for a frame that carries a field block."""
    await _connection_error(
        port, FRAME_SIZE_ERROR, lambda peer: [frame(HEADERS, END_HEADERS | PRIORITY_FLAG, 1, b"\0\0\0")]
    )


# 4.3 Field section compression and decompression


@probe("4.3")
async def a_field_block_that_does_not_decode_is_a_compression_error(port: int) -> None:
    """RFC 9113 4.3: a field block that cannot be decompressed MUST be a connection error of type
    COMPRESSION_ERROR (here an index past both tables)."""
    await _connection_error(
        port, COMPRESSION_ERROR, lambda peer: [frame(HEADERS, END_HEADERS, 1, bytes([0x80 | 70]))]
    )


def _interrupted(other: Callable[[Peer], bytes]) -> Callable[[Peer], list[bytes]]:
    def build(peer: Peer) -> list[bytes]:
        block = peer.block(request())
        return [frame(HEADERS, 0, 1, block[:3]), other(peer), frame(CONTINUATION, END_HEADERS, 1, block[3:])]

    return build


@probe("4.3")
async def a_priority_frame_inside_a_field_block_is_a_protocol_error(port: int) -> None:
    """RFC 9113 4.3 and 6.2: a field block MUST be a contiguous sequence of frames; any other
    frame inside it MUST be a connection error of type PROTOCOL_ERROR."""
    await _connection_error(port, PROTOCOL_ERROR, _interrupted(lambda peer: frame(PRIORITY, 0, 3, bytes(5))))


@probe("4.3")
async def headers_of_another_stream_inside_a_field_block_are_a_protocol_error(port: int) -> None:
    """RFC 9113 4.3 and 6.2: no frame of another stream inside a field block (PROTOCOL_ERROR)."""
    await _connection_error(
        port, PROTOCOL_ERROR, _interrupted(lambda peer: frame(HEADERS, END_HEADERS, 3, peer.block(request())))
    )


@probe("4.3")
async def a_continuation_of_another_stream_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.10: a CONTINUATION on another stream than its field block's MUST be a
    connection error of type PROTOCOL_ERROR."""

    def build(peer: Peer) -> list[bytes]:
        block = peer.block(request())
        return [frame(HEADERS, 0, 1, block[:3]), frame(CONTINUATION, END_HEADERS, 3, block[3:])]

    await _connection_error(port, PROTOCOL_ERROR, build)


@probe("4.3")
async def data_inside_a_field_block_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.10: a HEADERS frame without END_HEADERS followed by any frame other than
    CONTINUATION MUST be a connection error of type PROTOCOL_ERROR."""
    await _connection_error(port, PROTOCOL_ERROR, _interrupted(lambda peer: frame(DATA, 0, 1, LIVE_BODY)))


@probe("4.3")
async def an_unknown_frame_inside_a_field_block_is_a_protocol_error(port: int) -> None:
    """RFC 9113 5.5: extension frames inside a field block are not permitted and MUST be a
    connection error of type PROTOCOL_ERROR."""
    await _connection_error(port, PROTOCOL_ERROR, _interrupted(lambda peer: frame(0xBE, 0, 0, b"extension")))


@probe("4.3")
async def the_encoder_keeps_within_the_clients_header_table_size(port: int) -> None:
    """RFC 9113 4.3.1 and 6.5.2 (RFC 7541 4.2): the server's field blocks decode with a table of
    the size the client's SETTINGS_HEADER_TABLE_SIZE allows (0 here)."""
    peer = await Peer.connect(port, {HEADER_TABLE_SIZE: 0})
    peer.decoder.max_allowed_table_size = 0
    peer.decoder.header_table_size = 0
    try:
        for _ in range(3):
            await peer.serves()
    finally:
        peer.close()


# 5.1 Stream states


@probe("5.1")
async def data_on_an_idle_stream_is_a_protocol_error(port: int) -> None:
    """RFC 9113 5.1: any frame but HEADERS or PRIORITY on an idle stream MUST be a connection
    error of type PROTOCOL_ERROR (DATA)."""
    await _connection_error(port, PROTOCOL_ERROR, lambda peer: [frame(DATA, END_STREAM, 1, LIVE_BODY)])


@probe("5.1")
async def rst_stream_on_an_idle_stream_is_a_protocol_error(port: int) -> None:
    """RFC 9113 5.1 and 6.4: RST_STREAM on an idle stream MUST be a connection error of type
    PROTOCOL_ERROR."""
    await _connection_error(
        port, PROTOCOL_ERROR, lambda peer: [frame(RST_STREAM, 0, 1, struct.pack(">I", 8))]
    )


@probe("5.1")
async def window_update_on_an_idle_stream_is_a_protocol_error(port: int) -> None:
    """RFC 9113 5.1: WINDOW_UPDATE on an idle stream MUST be a connection error of type
    PROTOCOL_ERROR."""
    await _connection_error(port, PROTOCOL_ERROR, lambda peer: [window_update(1, 100)])


@probe("5.1")
async def continuation_on_an_idle_stream_is_a_protocol_error(port: int) -> None:
    """RFC 9113 5.1 and 6.10: CONTINUATION on an idle stream (no HEADERS before it) MUST be a
    connection error of type PROTOCOL_ERROR."""
    await _connection_error(
        port, PROTOCOL_ERROR, lambda peer: [frame(CONTINUATION, END_HEADERS, 1, peer.block(request()))]
    )


@probe("5.1")
async def data_on_a_half_closed_remote_stream_is_stream_closed(port: int) -> None:
    """RFC 9113 5.1: a frame other than WINDOW_UPDATE, PRIORITY or RST_STREAM on a stream
    half-closed (remote) MUST be a stream error of type STREAM_CLOSED (DATA)."""
    peer, stream_id = await _half_closed(port)
    try:
        peer.send(frame(DATA, 0, stream_id, LIVE_BODY))
        await peer.stream_error(stream_id, STREAM_CLOSED)
    finally:
        peer.close()


@probe("5.1")
async def headers_on_a_half_closed_remote_stream_are_stream_closed(port: int) -> None:
    """RFC 9113 5.1: HEADERS on a stream half-closed (remote) MUST be a stream error of type
    STREAM_CLOSED."""
    peer, stream_id = await _half_closed(port)
    try:
        peer.send(peer.headers(stream_id, [(b"x-late", b"1")], END_HEADERS | END_STREAM))
        await peer.stream_error(stream_id, STREAM_CLOSED)
    finally:
        peer.close()


@probe("5.1")
async def continuation_on_a_half_closed_remote_stream_is_an_error(port: int) -> None:
    """RFC 9113 5.1 and 6.10: CONTINUATION on a stream half-closed (remote), with no field block
    open, MUST be an error (STREAM_CLOSED, or PROTOCOL_ERROR for the lone CONTINUATION)."""
    peer, stream_id = await _half_closed(port)
    try:
        peer.send(frame(CONTINUATION, END_HEADERS, stream_id, peer.block([(b"x-late", b"1")])))
        await peer.stream_error(stream_id, STREAM_CLOSED, PROTOCOL_ERROR)
    finally:
        peer.close()


@probe("5.1")
async def a_half_closed_remote_stream_takes_window_update_priority_and_rst_stream(port: int) -> None:
    """RFC 9113 5.1: WINDOW_UPDATE, PRIORITY and RST_STREAM may be received on a stream
    half-closed (remote): the answer waiting for the window is sent, the connection serves on."""
    peer, stream_id = await _half_closed(port)
    try:
        peer.send(frame(PRIORITY, 0, stream_id, bytes(5)))
        peer.grant(stream_id, 1000)
        await peer.answered(stream_id)
        waiting = peer.open()
        await peer.barrier()
        peer.send(frame(RST_STREAM, 0, waiting, struct.pack(">I", 8)))
        await peer.barrier()
        assert peer.goaway is None, peer.goaway
    finally:
        peer.close()


@probe("5.1")
async def field_blocks_on_a_stream_the_server_reset_still_update_hpack(port: int) -> None:
    """RFC 9113 5.1: frames received on a stream after this side sent RST_STREAM MUST be minimally
    processed, HEADERS included (the header compression state); the connection serves on."""
    peer = await Peer.connect(port)
    try:
        stream_id = peer.next_id()
        malformed = peer.headers(stream_id, _with([(b"X-Upper", b"1")]))
        trailers = peer.headers(stream_id, [(b"x-added-after-the-reset", b"1")], END_HEADERS | END_STREAM)
        following = peer.next_id()  # it names the field the trailers added to the table, by index
        peer.send(
            malformed,
            trailers,
            peer.headers(following, _with([(b"x-added-after-the-reset", b"1")])),
            peer.data_frame(following, LIVE_BODY, end=True),
        )
        await peer.answered(following)
        if stream_id not in peer.resets:
            raise NotApplicable("the server did not reset the malformed request")
    finally:
        peer.close()


@probe("5.1")
async def data_on_streams_the_server_reset_counts_toward_the_connection_window(port: int) -> None:
    """RFC 9113 5.1: DATA received after this side sent RST_STREAM still counts toward the
    connection's flow-control window: sent within the windows, on one reset stream after another,
    past the connection's whole window, it is given back."""
    peer = await Peer.connect(port)
    try:
        target, sent = peer.send_window + 1, 0
        while sent < target:
            stream_id = peer.next_id()
            peer.send(peer.headers(stream_id, _with([(b"X-Upper", b"1")])))  # reset at once, malformed
            room = min(
                peer.send_window,
                peer.stream_send.get(
                    stream_id, peer.server_settings.get(INITIAL_WINDOW_SIZE, DEFAULT_WINDOW)
                ),
            )
            for start in range(0, room, 16_384):
                peer.send(peer.data_frame(stream_id, bytes(min(16_384, room - start))))
            sent += room
            await peer.read(lambda: peer.send_window > 0)
        await peer.serves()
    finally:
        peer.close()


# 5.1.1 Stream identifiers


@probe("5.1.1")
async def an_even_stream_id_from_a_client_is_a_protocol_error(port: int) -> None:
    """RFC 9113 5.1.1: streams a client opens MUST have odd identifiers; an unexpected one MUST be
    a connection error of type PROTOCOL_ERROR."""
    await _connection_error(
        port, PROTOCOL_ERROR, lambda peer: [peer.headers(2, request(), END_HEADERS | END_STREAM)]
    )


@probe("5.1.1")
async def a_stream_id_below_one_used_is_a_protocol_error(port: int) -> None:
    """RFC 9113 5.1.1: a new stream's identifier MUST be greater than every one the client opened
    before: HEADERS on stream 3 after stream 5 MUST be a connection error of type PROTOCOL_ERROR."""

    def build(peer: Peer) -> list[bytes]:
        return [
            peer.headers(5, request()),
            frame(DATA, END_STREAM, 5, LIVE_BODY),
            peer.headers(3, request()),
            frame(DATA, END_STREAM, 3, LIVE_BODY),
        ]

    await _connection_error(port, PROTOCOL_ERROR, build)


@probe("5.1.1")
async def data_on_a_stream_skipped_over_is_stream_closed(port: int) -> None:
    """RFC 9113 5.1.1 and 6.1: opening stream 5 closes the idle streams below it; DATA on stream 3
    then MUST be a stream error of type STREAM_CLOSED."""

    def build(peer: Peer) -> tuple[int, list[bytes]]:
        return 3, [
            peer.headers(5, request()),
            frame(DATA, END_STREAM, 5, LIVE_BODY),
            frame(DATA, 0, 3, LIVE_BODY),
        ]

    await _stream_error(port, (STREAM_CLOSED,), build)


# 5.1.2 Stream concurrency


@probe("5.1.2")
async def a_stream_past_the_concurrency_limit_is_refused(port: int) -> None:
    """RFC 9113 5.1.2: HEADERS past the SETTINGS_MAX_CONCURRENT_STREAMS the server advertised
    MUST be a stream error of type PROTOCOL_ERROR or REFUSED_STREAM; the refused stream's field
    block still updates HPACK (4.3)."""
    peer = await Peer.connect(port, {INITIAL_WINDOW_SIZE: 0})  # every answer waits: the streams stay open
    try:
        limit = peer.server_settings.get(MAX_CONCURRENT_STREAMS)
        if limit is None or limit > 1000:
            raise NotApplicable(f"SETTINGS_MAX_CONCURRENT_STREAMS {limit}")
        opened = [peer.open() for _ in range(limit)]
        await peer.barrier()
        refused = peer.next_id()
        peer.send(
            peer.headers(refused, _with([(b"x-on-the-refused-stream", b"1")])),
            peer.data_frame(refused, LIVE_BODY, end=True),
        )
        await peer.stream_error(refused, REFUSED_STREAM, PROTOCOL_ERROR)
        peer.send(frame(RST_STREAM, 0, opened[0], struct.pack(">I", 8)))  # a place for one more
        following = peer.open(_with([(b"x-on-the-refused-stream", b"1")]))  # by index, as HPACK added it
        peer.grant(following, 1000)
        await peer.answered(following)
    finally:
        peer.close()


# 5.3 Prioritization (RFC 9113 5.3.2 keeps RFC 7540 5.3.1's handling of what it signals)


@probe("5.3")
async def headers_that_depend_on_their_own_stream_are_a_protocol_error(port: int) -> None:
    """RFC 7540 5.3.1, kept by RFC 9113 5.3.2: a stream cannot depend on itself; this MUST be a
    stream error of type PROTOCOL_ERROR (HEADERS with the PRIORITY flag)."""

    def build(peer: Peer) -> tuple[int, list[bytes]]:
        stream_id = peer.next_id()
        payload = struct.pack(">IB", stream_id, 15) + peer.block(request())
        return stream_id, [
            frame(HEADERS, END_HEADERS | PRIORITY_FLAG, stream_id, payload),
            frame(DATA, END_STREAM, stream_id, LIVE_BODY),
        ]

    await _stream_error(port, (PROTOCOL_ERROR,), build)


@probe("5.3")
async def priority_that_depends_on_its_own_stream_is_a_protocol_error(port: int) -> None:
    """RFC 7540 5.3.1, kept by RFC 9113 5.3.2: a PRIORITY frame that makes a stream depend on
    itself MUST be a stream error of type PROTOCOL_ERROR."""

    def build(peer: Peer) -> tuple[int, list[bytes]]:
        stream_id = _opened(peer)
        return stream_id, [frame(PRIORITY, 0, stream_id, struct.pack(">IB", stream_id, 15))]

    await _stream_error(port, (PROTOCOL_ERROR,), build)


# 5.4 Error handling


@probe("5.4.2")
async def a_rst_stream_is_never_answered_with_a_rst_stream(port: int) -> None:
    """RFC 9113 5.4.2: an endpoint MUST NOT send RST_STREAM in response to a RST_STREAM."""
    peer = await Peer.connect(port)
    try:
        stream_id = _opened(peer)
        peer.send(frame(RST_STREAM, 0, stream_id, struct.pack(">I", 8)))
        await peer.barrier()
        assert stream_id not in peer.resets and peer.goaway is None, (peer.resets, peer.goaway)
        await peer.serves()
    finally:
        peer.close()


# 6.1 DATA


@probe("6.1")
async def data_on_stream_0_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.1: DATA on stream 0 MUST be a connection error of type PROTOCOL_ERROR."""
    await _connection_error(port, PROTOCOL_ERROR, lambda peer: [frame(DATA, 0, 0, LIVE_BODY)])


@probe("6.1")
async def data_padding_as_long_as_its_payload_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.1: padding as long as the frame payload or longer MUST be a connection error of
    type PROTOCOL_ERROR."""

    def build(peer: Peer) -> list[bytes]:
        stream_id = _opened(peer)
        return [frame(DATA, END_STREAM | PADDED, stream_id, bytes([6]) + LIVE_BODY)]

    await _connection_error(port, PROTOCOL_ERROR, build)


# 6.2 HEADERS


@probe("6.2")
async def headers_on_stream_0_are_a_protocol_error(port: int) -> None:
    """RFC 9113 6.2: HEADERS on stream 0 MUST be a connection error of type PROTOCOL_ERROR."""
    await _connection_error(
        port, PROTOCOL_ERROR, lambda peer: [peer.headers(0, request(), END_HEADERS | END_STREAM)]
    )


@probe("6.2")
async def headers_padding_as_long_as_its_payload_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.2: padding as long as the HEADERS frame's payload or longer MUST be a
    connection error of type PROTOCOL_ERROR."""

    def build(peer: Peer) -> list[bytes]:
        block = peer.block(request())
        return [frame(HEADERS, END_HEADERS | END_STREAM | PADDED, 1, bytes([len(block) + 1]) + block)]

    await _connection_error(port, PROTOCOL_ERROR, build)


# 6.3 PRIORITY


@probe("6.3")
async def priority_on_stream_0_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.3: PRIORITY on stream 0 MUST be a connection error of type PROTOCOL_ERROR."""
    await _connection_error(
        port, PROTOCOL_ERROR, lambda peer: [frame(PRIORITY, 0, 0, struct.pack(">IB", 1, 15))]
    )


@probe("6.3")
async def priority_of_a_length_other_than_5_is_a_frame_size_error(port: int) -> None:
    """RFC 9113 6.3: a PRIORITY frame of a length other than 5 octets MUST be a stream error of
    type FRAME_SIZE_ERROR."""

    def build(peer: Peer) -> tuple[int, list[bytes]]:
        stream_id = _opened(peer)
        return stream_id, [frame(PRIORITY, 0, stream_id, bytes(4))]

    await _stream_error(port, (FRAME_SIZE_ERROR,), build)


@probe("6.3")
async def priority_is_taken_in_any_stream_state(port: int) -> None:
    """RFC 9113 6.3: PRIORITY can be sent on a stream in any state: on an idle stream (which it
    does not open: a lower stream opens after it), and on a closed one."""
    peer = await Peer.connect(port)
    try:
        peer.send(frame(PRIORITY, 0, 9, struct.pack(">IB", 0, 15)))
        served = peer.open()
        await peer.answered(served)
        peer.send(frame(PRIORITY, 0, served, struct.pack(">IB", 0, 15)))
        await peer.serves()
    finally:
        peer.close()


# 6.4 RST_STREAM


@probe("6.4")
async def rst_stream_on_stream_0_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.4: RST_STREAM on stream 0 MUST be a connection error of type PROTOCOL_ERROR."""
    await _connection_error(
        port, PROTOCOL_ERROR, lambda peer: [frame(RST_STREAM, 0, 0, struct.pack(">I", 8))]
    )


@probe("6.4")
async def rst_stream_of_a_length_other_than_4_is_a_frame_size_error(port: int) -> None:
    """RFC 9113 6.4: a RST_STREAM frame of a length other than 4 octets MUST be a connection error
    of type FRAME_SIZE_ERROR."""
    await _connection_error(
        port, FRAME_SIZE_ERROR, lambda peer: [frame(RST_STREAM, 0, _opened(peer), bytes(3))]
    )


# 6.5 SETTINGS


@probe("6.5")
async def a_settings_ack_with_a_payload_is_a_frame_size_error(port: int) -> None:
    """RFC 9113 6.5: a SETTINGS frame with ACK and a payload MUST be a connection error of type
    FRAME_SIZE_ERROR."""
    await _connection_error(
        port, FRAME_SIZE_ERROR, lambda peer: [frame(SETTINGS, ACK, 0, struct.pack(">HI", 4, 1))]
    )


@probe("6.5")
async def settings_on_a_stream_are_a_protocol_error(port: int) -> None:
    """RFC 9113 6.5: SETTINGS on a stream other than 0 MUST be a connection error of type
    PROTOCOL_ERROR."""
    await _connection_error(
        port, PROTOCOL_ERROR, lambda peer: [frame(SETTINGS, 0, 1, struct.pack(">HI", 4, 100))]
    )


@probe("6.5")
async def settings_of_a_length_not_a_multiple_of_6_are_a_frame_size_error(port: int) -> None:
    """RFC 9113 6.5: a SETTINGS frame whose length is not a multiple of 6 octets MUST be a
    connection error of type FRAME_SIZE_ERROR."""
    await _connection_error(port, FRAME_SIZE_ERROR, lambda peer: [frame(SETTINGS, 0, 0, bytes(5))])


@probe("6.5.2")
async def enable_push_past_1_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.5.2: SETTINGS_ENABLE_PUSH other than 0 or 1 MUST be a connection error of type
    PROTOCOL_ERROR."""
    await _connection_error(port, PROTOCOL_ERROR, lambda peer: [settings({ENABLE_PUSH: 2})])


@probe("6.5.2")
async def an_initial_window_size_past_2_31_minus_1_is_a_flow_control_error(port: int) -> None:
    """RFC 9113 6.5.2: SETTINGS_INITIAL_WINDOW_SIZE past 2^31-1 MUST be a connection error of
    type FLOW_CONTROL_ERROR."""
    await _connection_error(port, FLOW_CONTROL_ERROR, lambda peer: [settings({INITIAL_WINDOW_SIZE: 2**31})])


@probe("6.5.2")
async def a_max_frame_size_below_2_14_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.5.2: SETTINGS_MAX_FRAME_SIZE below 2^14 MUST be a connection error of type
    PROTOCOL_ERROR."""
    await _connection_error(port, PROTOCOL_ERROR, lambda peer: [settings({MAX_FRAME_SIZE: 16_383})])


@probe("6.5.2")
async def a_max_frame_size_past_2_24_minus_1_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.5.2: SETTINGS_MAX_FRAME_SIZE past 2^24-1 MUST be a connection error of type
    PROTOCOL_ERROR."""
    await _connection_error(port, PROTOCOL_ERROR, lambda peer: [settings({MAX_FRAME_SIZE: 2**24})])


@probe("6.5.2")
async def unknown_settings_are_ignored(port: int) -> None:
    """RFC 9113 6.5.2 and 5.5: a setting of an unknown identifier MUST be ignored."""
    peer = await _still_serves(port, lambda peer: [settings({0x99: 7, 0xFFFF: 2**32 - 1})])
    peer.close()


@probe("6.5.2")
async def the_server_never_sets_enable_push_to_1(port: int) -> None:
    """RFC 9113 6.5.2: a server MUST NOT explicitly set SETTINGS_ENABLE_PUSH to 1; if it sends
    the setting, its value MUST be 0."""
    peer = await Peer.connect(port)
    peer.close()
    assert peer.server_settings.get(ENABLE_PUSH, 0) == 0, peer.server_settings


@probe("6.5.3")
async def settings_are_acknowledged_and_applied_in_order(port: int) -> None:
    """RFC 9113 6.5.3: the receiver of SETTINGS MUST acknowledge it, and MUST process its values
    in the order they appear (SETTINGS_INITIAL_WINDOW_SIZE 100 then 1: one byte is sent)."""
    peer = await Peer.connect(port)
    try:
        peer.auto_window = False
        acks = peer.settings_acks
        peer.change_settings([(INITIAL_WINDOW_SIZE, 100), (INITIAL_WINDOW_SIZE, 1)])
        await peer.read(lambda: peer.settings_acks > acks)
        stream_id = peer.open()
        await peer.read(lambda: bool(peer.data.get(stream_id)))
        await peer.barrier()
        assert len(peer.data[stream_id]) == 1, bytes(peer.data[stream_id])
    finally:
        peer.close()


# 6.6 PUSH_PROMISE, 8.4 Server push


@probe("8.4")
async def push_promise_from_a_client_is_a_protocol_error(port: int) -> None:
    """RFC 9113 8.4 and 6.6: a server MUST treat a PUSH_PROMISE as a connection error of type
    PROTOCOL_ERROR."""

    def build(peer: Peer) -> list[bytes]:
        stream_id = _opened(peer)
        return [frame(PUSH_PROMISE, END_HEADERS, stream_id, struct.pack(">I", 2) + peer.block(request()))]

    await _connection_error(port, PROTOCOL_ERROR, build)


# 6.7 PING


@probe("6.7")
async def a_ping_is_answered_with_its_payload(port: int) -> None:
    """RFC 9113 6.7: a PING without ACK MUST be answered by a PING with ACK and the same payload."""
    peer = await Peer.connect(port)
    try:
        await peer.ping(b"\x00\xff9113\x0d\x0a")
    finally:
        peer.close()


@probe("6.7")
async def a_ping_ack_is_not_answered(port: int) -> None:
    """RFC 9113 6.7: an endpoint MUST NOT respond to a PING with ACK."""
    peer = await Peer.connect(port)
    try:
        peer.send(frame(PING, ACK, 0, b"unasked!"))
        await peer.barrier()
        assert b"unasked!" not in peer.pings
    finally:
        peer.close()


@probe("6.7")
async def ping_on_a_stream_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.7: PING on a stream other than 0 MUST be a connection error of type
    PROTOCOL_ERROR."""
    await _connection_error(port, PROTOCOL_ERROR, lambda peer: [frame(PING, 0, 1, b"12345678")])


@probe("6.7")
async def ping_of_a_length_other_than_8_is_a_frame_size_error(port: int) -> None:
    """RFC 9113 6.7: a PING of a length other than 8 octets MUST be a connection error of type
    FRAME_SIZE_ERROR."""
    await _connection_error(port, FRAME_SIZE_ERROR, lambda peer: [frame(PING, 0, 0, b"1234567")])


# 6.8 GOAWAY


@probe("6.8")
async def goaway_on_a_stream_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.8: GOAWAY on a stream other than 0 MUST be a connection error of type
    PROTOCOL_ERROR."""
    await _connection_error(
        port, PROTOCOL_ERROR, lambda peer: [frame(GOAWAY, 0, 1, struct.pack(">II", 0, 0))]
    )


# 6.9 WINDOW_UPDATE


@probe("6.9")
async def a_connection_window_update_of_0_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.9: a WINDOW_UPDATE increment of 0 on the connection MUST be a connection error
    of type PROTOCOL_ERROR."""
    await _connection_error(port, PROTOCOL_ERROR, lambda peer: [window_update(0, 0)])


@probe("6.9")
async def a_stream_window_update_of_0_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.9: a WINDOW_UPDATE increment of 0 on a stream MUST be a stream error of type
    PROTOCOL_ERROR."""

    def build(peer: Peer) -> tuple[int, list[bytes]]:
        stream_id = _opened(peer)
        return stream_id, [window_update(stream_id, 0)]

    await _stream_error(port, (PROTOCOL_ERROR,), build)


@probe("6.9")
async def window_update_of_a_length_other_than_4_is_a_frame_size_error(port: int) -> None:
    """RFC 9113 6.9: a WINDOW_UPDATE of a length other than 4 octets MUST be a connection error
    of type FRAME_SIZE_ERROR."""
    await _connection_error(port, FRAME_SIZE_ERROR, lambda peer: [frame(WINDOW_UPDATE, 0, 0, bytes(3))])


@probe("6.9.1")
async def the_connection_window_past_2_31_minus_1_is_a_flow_control_error(port: int) -> None:
    """RFC 9113 6.9.1: a WINDOW_UPDATE that takes the connection's window past 2^31-1 MUST end
    the connection with GOAWAY FLOW_CONTROL_ERROR."""
    await _connection_error(
        port, FLOW_CONTROL_ERROR, lambda peer: [window_update(0, MAX_WINDOW), window_update(0, MAX_WINDOW)]
    )


@probe("6.9.1")
async def a_stream_window_past_2_31_minus_1_is_a_flow_control_error(port: int) -> None:
    """RFC 9113 6.9.1: a WINDOW_UPDATE that takes a stream's window past 2^31-1 MUST be a stream
    error of type FLOW_CONTROL_ERROR."""

    def build(peer: Peer) -> tuple[int, list[bytes]]:
        stream_id = _opened(peer)
        return stream_id, [window_update(stream_id, MAX_WINDOW)]

    await _stream_error(port, (FLOW_CONTROL_ERROR,), build)


@probe("6.9.1")
async def nothing_is_sent_past_the_clients_window(port: int) -> None:
    """RFC 9113 6.9.1: a sender MUST NOT send a flow-controlled frame longer than the space in the
    receiver's window (1 byte here, then what each WINDOW_UPDATE gives)."""
    peer = await Peer.connect(port, {INITIAL_WINDOW_SIZE: 1})
    try:
        peer.auto_window = False
        stream_id = peer.open()
        await peer.read(lambda: bool(peer.data.get(stream_id)))
        await peer.barrier()
        assert len(peer.data[stream_id]) == 1, bytes(peer.data[stream_id])
        peer.grant(stream_id, 1000)
        await peer.answered(stream_id)
    finally:
        peer.close()


@probe("6.9.2")
async def a_new_initial_window_size_applies_to_open_streams(port: int) -> None:
    """RFC 9113 6.9.2: a change of SETTINGS_INITIAL_WINDOW_SIZE MUST adjust the window of every
    open stream: an answer held by a window of 0 is sent once the client raises it."""
    peer = await Peer.connect(port, {INITIAL_WINDOW_SIZE: 0})
    try:
        stream_id = peer.open()
        await peer.barrier()
        assert not peer.data.get(stream_id)
        peer.change_settings([(INITIAL_WINDOW_SIZE, 1000)])
        await peer.answered(stream_id)
    finally:
        peer.close()


@probe("6.9.2")
async def a_negative_stream_window_is_tracked(port: int) -> None:
    """RFC 9113 6.9.2: a smaller SETTINGS_INITIAL_WINDOW_SIZE can make a window negative; the
    sender MUST track it and send nothing until WINDOW_UPDATEs make it positive."""
    peer = await Peer.connect(port, {INITIAL_WINDOW_SIZE: 3})
    try:
        peer.auto_window = False
        stream_id = peer.open()
        await peer.read(lambda: len(peer.data.get(stream_id, b"")) >= 3)
        peer.change_settings([(INITIAL_WINDOW_SIZE, 1)])  # the stream's window: 0 - 2
        peer.grant(stream_id, 2)  # back to 0: still nothing to send
        await peer.barrier()
        assert len(peer.data[stream_id]) == 3, bytes(peer.data[stream_id])
        peer.grant(stream_id, 1)
        await peer.read(lambda: len(peer.data[stream_id]) >= 4)
        await peer.barrier()
        assert len(peer.data[stream_id]) == 4, bytes(peer.data[stream_id])
    finally:
        peer.close()


@probe("6.9.2")
async def an_initial_window_size_change_past_2_31_minus_1_is_a_flow_control_error(port: int) -> None:
    """RFC 9113 6.9.2: a change of SETTINGS_INITIAL_WINDOW_SIZE that takes a stream's window past
    2^31-1 MUST be a connection error of type FLOW_CONTROL_ERROR."""

    def build(peer: Peer) -> list[bytes]:
        stream_id = _opened(peer)  # the server's window to send on it: the client's initial 65,535
        return [
            window_update(stream_id, MAX_WINDOW - DEFAULT_WINDOW),
            settings({INITIAL_WINDOW_SIZE: DEFAULT_WINDOW + 1}),
        ]

    await _connection_error(port, FLOW_CONTROL_ERROR, build)


# 6.10 CONTINUATION


@probe("6.10")
async def a_field_block_in_several_continuations_is_taken(port: int) -> None:
    """RFC 9113 6.10: any number of CONTINUATION frames may follow HEADERS until END_HEADERS."""
    peer = await Peer.connect(port)
    try:
        stream_id = peer.next_id()
        block = peer.block(request())
        peer.send(
            frame(HEADERS, 0, stream_id, block[:2]),
            frame(CONTINUATION, 0, stream_id, block[2:5]),
            frame(CONTINUATION, 0, stream_id, b""),
            frame(CONTINUATION, END_HEADERS, stream_id, block[5:]),
            frame(DATA, END_STREAM, stream_id, LIVE_BODY),
        )
        await peer.answered(stream_id)
    finally:
        peer.close()


@probe("6.10")
async def continuation_after_end_headers_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.10: CONTINUATION after a HEADERS frame with END_HEADERS MUST be a connection
    error of type PROTOCOL_ERROR."""
    await _connection_error(
        port,
        PROTOCOL_ERROR,
        lambda peer: [
            peer.headers(1, request()),
            frame(CONTINUATION, END_HEADERS, 1, peer.block([(b"x-more", b"1")])),
        ],
    )


@probe("6.10")
async def continuation_after_a_continuation_with_end_headers_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.10: CONTINUATION after a CONTINUATION with END_HEADERS MUST be a connection
    error of type PROTOCOL_ERROR."""

    def build(peer: Peer) -> list[bytes]:
        block = peer.block(request())
        return [
            frame(HEADERS, 0, 1, block[:3]),
            frame(CONTINUATION, END_HEADERS, 1, block[3:]),
            frame(CONTINUATION, END_HEADERS, 1, peer.block([(b"x-more", b"1")])),
        ]

    await _connection_error(port, PROTOCOL_ERROR, build)


@probe("6.10")
async def continuation_after_data_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.10: CONTINUATION after DATA MUST be a connection error of type PROTOCOL_ERROR."""
    await _connection_error(
        port,
        PROTOCOL_ERROR,
        lambda peer: [
            peer.headers(1, request()),
            frame(DATA, 0, 1, LIVE_BODY),
            frame(CONTINUATION, END_HEADERS, 1, peer.block([(b"x-more", b"1")])),
        ],
    )


@probe("6.10")
async def continuation_on_stream_0_is_a_protocol_error(port: int) -> None:
    """RFC 9113 6.10: CONTINUATION on stream 0 MUST be a connection error of type PROTOCOL_ERROR."""

    def build(peer: Peer) -> list[bytes]:
        block = peer.block(request())
        return [frame(HEADERS, 0, 1, block[:3]), frame(CONTINUATION, END_HEADERS, 0, block[3:])]

    await _connection_error(port, PROTOCOL_ERROR, build)


# 7 Error codes


@probe("7")
async def an_unknown_error_code_in_rst_stream_is_not_special(port: int) -> None:
    """RFC 9113 7: unknown error codes MUST NOT trigger special behaviour: a RST_STREAM of code
    0xBEEF cancels its stream like any other, and the connection serves on."""
    peer = await Peer.connect(port)
    try:
        stream_id = _opened(peer)
        peer.send(frame(RST_STREAM, 0, stream_id, struct.pack(">I", 0xBEEF)))
        await peer.serves()
    finally:
        peer.close()


async def _after_goaway(port: int, code: int) -> tuple[bool, int | None]:
    """What the server does once the client sends GOAWAY of `code`: whether it closes the
    connection, and the code of its own GOAWAY, if any."""
    peer = await Peer.connect(port)
    try:
        peer.send(frame(GOAWAY, 0, 0, struct.pack(">II", 0, code)))
        await peer.barrier()
        closed = False
    except Closed:
        closed = True
    finally:
        peer.close()
    return closed, peer.goaway[1] if peer.goaway else None


@probe("7")
async def an_unknown_error_code_in_goaway_is_not_special(port: int) -> None:
    """RFC 9113 7: unknown error codes MUST NOT trigger special behaviour (they MAY be taken as
    INTERNAL_ERROR): the server answers a GOAWAY of code 0xBEEF as it answers INTERNAL_ERROR's."""
    assert await _after_goaway(port, 0xBEEF) == await _after_goaway(port, INTERNAL_ERROR)


# 8.1 HTTP message framing


@probe("8.1")
async def a_second_header_block_without_end_stream_is_malformed(port: int) -> None:
    """RFC 9113 8.1: HEADERS without END_STREAM after the request's header block MUST make the
    request malformed (a stream error of type PROTOCOL_ERROR)."""

    def build(peer: Peer) -> tuple[int, list[bytes]]:
        stream_id = peer.next_id()
        return stream_id, [
            peer.headers(stream_id, request()),
            peer.data_frame(stream_id, LIVE_BODY),
            peer.headers(stream_id, [(b"x-trailer", b"1")]),
        ]

    await _stream_error(port, (PROTOCOL_ERROR,), build)


@probe("8.1")
async def trailers_with_a_pseudo_header_are_malformed(port: int) -> None:
    """RFC 9113 8.1 and 8.3: pseudo-header fields MUST NOT appear in trailers; such a request is
    malformed (a stream error of type PROTOCOL_ERROR)."""
    await _malformed(port, request(), trailers=[(b":path", b"/")])


@probe("8.1.1")
async def a_content_length_past_the_data_is_malformed(port: int) -> None:
    """RFC 9113 8.1.1: a request whose content-length differs from the sum of its DATA payloads
    (here more) is malformed; one that matches is served."""
    peer = await Peer.connect(port)
    try:
        matching = peer.open(_with([(b"content-length", b"%d" % len(LIVE_BODY))]))
        await peer.answered(matching)
    finally:
        peer.close()
    await _malformed(port, _with([(b"content-length", b"%d" % (len(LIVE_BODY) + 1))]))


@probe("8.1.1")
async def a_content_length_short_of_the_data_is_malformed(port: int) -> None:
    """RFC 9113 8.1.1: a request whose content-length differs from the sum of its DATA payloads
    (here less) is malformed (a stream error of type PROTOCOL_ERROR)."""
    await _malformed(port, _with([(b"content-length", b"%d" % (len(LIVE_BODY) - 1))]))


# 8.2 HTTP fields


@probe("8.2")
async def uppercase_field_names_are_malformed(port: int) -> None:
    """RFC 9113 8.2: a request with uppercase characters in a field name MUST be treated as
    malformed."""
    await _each_malformed(
        port, [_with([(b"X-Upper", b"1")]), _with([(b"content-Type", b"application/grpc")])]
    )


@probe("8.2.1")
async def field_names_with_forbidden_characters_are_malformed(port: int) -> None:
    """RFC 9113 8.2.1: a field name MUST NOT contain characters in 0x00-0x20, 0x41-0x5a or
    0x7f-0xff; a request with one is malformed."""
    names = [b"x y", b"x\x00y", b"x\ty", b"x\x7fy", b"x\xe9y"]
    await _each_malformed(port, [_with([(name, b"1")]) for name in names])


@probe("8.2.1")
async def field_names_with_a_colon_are_malformed(port: int) -> None:
    """RFC 9113 8.2.1: but for pseudo-headers, a field name MUST NOT include a colon."""
    await _each_malformed(port, [_with([(b"x:y", b"1")]), _with([(b"x:", b"1")])])


@probe("8.2.1")
async def field_values_with_nul_cr_or_lf_are_malformed(port: int) -> None:
    """RFC 9113 8.2.1: a field value MUST NOT contain NUL, CR or LF at any position."""
    await _each_malformed(
        port, [_with([(b"x-value", value)]) for value in (b"a\x00b", b"a\rb", b"a\nb", b"\n")]
    )


@probe("8.2.1")
async def field_values_with_leading_or_trailing_whitespace_are_malformed(port: int) -> None:
    """RFC 9113 8.2.1: a field value MUST NOT start or end with SP or HTAB."""
    await _each_malformed(port, [_with([(b"x-value", value)]) for value in (b" a", b"a ", b"\ta", b"a\t")])


@probe("8.2.2")
async def connection_specific_fields_are_malformed(port: int) -> None:
    """RFC 9113 8.2.2: a request with a connection-specific field (Connection, Proxy-Connection,
    Keep-Alive, Transfer-Encoding, Upgrade) MUST be treated as malformed."""
    fields = [
        (b"connection", b"close"),
        (b"proxy-connection", b"keep-alive"),
        (b"keep-alive", b"timeout=5"),
        (b"transfer-encoding", b"chunked"),
        (b"upgrade", b"h2c"),
    ]
    await _each_malformed(port, [_with([field]) for field in fields])


@probe("8.2.2")
async def te_other_than_trailers_is_malformed(port: int) -> None:
    """RFC 9113 8.2.2: TE MUST NOT contain any value other than "trailers"."""
    await _each_malformed(port, [_replaced(b"te", b"gzip"), _replaced(b"te", b"trailers, deflate")])


# 8.3 HTTP control data


@probe("8.3")
async def unknown_pseudo_headers_are_malformed(port: int) -> None:
    """RFC 9113 8.3: a request with a pseudo-header it does not define MUST be treated as
    malformed."""
    await _malformed(port, [(b":unknown", b"1"), *request()])


@probe("8.3")
async def response_pseudo_headers_in_a_request_are_malformed(port: int) -> None:
    """RFC 9113 8.3: pseudo-headers defined for responses MUST NOT appear in requests (:status)."""
    await _malformed(port, [(b":status", b"200"), *request()])


@probe("8.3")
async def pseudo_headers_after_a_regular_field_are_malformed(port: int) -> None:
    """RFC 9113 8.3: a pseudo-header after a regular field makes the request malformed."""
    fields = request()
    await _malformed(port, [*fields[:3], (b"x-regular", b"1"), *fields[3:]])


@probe("8.3")
async def repeated_pseudo_headers_are_malformed(port: int) -> None:
    """RFC 9113 8.3: the same pseudo-header MUST NOT appear twice in a field block."""
    fields = request()
    await _each_malformed(port, [[field, *fields] for field in fields[:4]])


@probe("8.3.1")
async def requests_without_method_scheme_or_path_are_malformed(port: int) -> None:
    """RFC 9113 8.3.1: every request but CONNECT MUST include one each of :method, :scheme and
    :path; one without is malformed."""
    await _each_malformed(port, [_replaced(name, None) for name in (b":method", b":scheme", b":path")])


@probe("8.3.1")
async def an_empty_path_is_malformed(port: int) -> None:
    """RFC 9113 8.3.1: :path MUST NOT be empty for http or https URIs."""
    await _malformed(port, _replaced(b":path", b""))


@probe("8.5")
async def connect_with_a_scheme_or_path_is_malformed(port: int) -> None:
    """RFC 9113 8.5: a CONNECT request MUST omit :scheme and :path; one that does not is
    malformed."""
    await _each_malformed(
        port,
        [
            [(b":method", b"CONNECT"), (b":authority", b"127.0.0.1:1"), (b":path", b"/")],
            [(b":method", b"CONNECT"), (b":authority", b"127.0.0.1:1"), (b":scheme", b"http")],
        ],
    )


async def run_all(port: int) -> list[tuple[str, str, str]]:
    """Every probe against the server on `port`: (section, probe name, outcome), the outcome
    "met", "met by a close without GOAWAY" (where h2_peer.bare_closes is a list), "not
    applicable: ...", or "not met: " and what went wrong."""
    outcomes = []
    for section, function in PROBES:
        bare = len(h2_peer.bare_closes or [])
        try:
            await function(port)
            outcome = "met" if len(h2_peer.bare_closes or []) == bare else "met by a close without GOAWAY"
        except NotApplicable as exc:
            outcome = f"not applicable: {exc}"
        except (AssertionError, OSError) as exc:
            outcome = f"not met: {str(exc)[:160]}"
        outcomes.append((section, function.__name__, outcome))
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description="RFC 9113's probes against a gRPC server on loopback")
    parser.add_argument("port", type=int)
    args = parser.parse_args()
    outcomes = asyncio.run(run_all(args.port))
    for section, name, outcome in outcomes:
        print(f"{section:6} {name}: {outcome}")
    met = sum(outcome == "met" for _, _, outcome in outcomes)
    print(f"{met} of {len(outcomes)} met")


if __name__ == "__main__":
    main()
