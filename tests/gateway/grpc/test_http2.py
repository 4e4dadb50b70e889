"""gateway.grpc.http2, the gateway's own server-side HTTP/2, against an independent peer (h2's client)
for what clients send, and raw frames for what a broken or hostile client sends: every request and
answer arrives whole whatever the framing (CONTINUATION, padding, one byte at a time), flow control
holds both ways, and each breach of the protocol ends the connection with GOAWAY and its code."""

from __future__ import annotations

import random
import struct

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest

from bench.h2_cost import REQUEST_HEADERS
from gateway.grpc.http2 import PREFACE, Event, Events, Http2ErrorCode, ProtocolError, ServerConnection

REQUEST = REQUEST_HEADERS
STREAM_WINDOW = 1 << 20


def server(max_streams: int = 100, max_header_list_size: int = 16_384) -> ServerConnection:
    connection = ServerConnection(
        max_streams=max_streams,
        stream_window=STREAM_WINDOW,
        connection_window=16 << 20,
        max_header_list_size=max_header_list_size,
    )
    connection.initiate()
    return connection


def connected(max_header_list_size: int = 16_384) -> tuple[h2.connection.H2Connection, ServerConnection]:
    """An h2 client and the server past both prefaces and SETTINGS."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    connection = server(max_header_list_size=max_header_list_size)
    assert connection.receive(client.data_to_send()) == [(Event.SETTINGS, 0, None)]
    client.receive_data(bytes(connection.data_to_send()))
    connection.receive(client.data_to_send())
    return client, connection


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream_id) + payload


def received(events: Events) -> tuple[list[object], bytes, bool]:
    """A stream's headers, its body, whether it ended."""
    headers = [value for kind, _, value in events if kind is Event.REQUEST]
    body = b"".join(value for kind, _, value in events if kind is Event.DATA)  # type: ignore[misc]
    return headers, body, any(kind is Event.ENDED for kind, _, _ in events)


def goaway_code(connection: ServerConnection) -> int:
    """The error code of the GOAWAY the server queued (the last frame it queued)."""
    out = bytes(connection.data_to_send())
    position, code = 0, None
    while position < len(out):
        length = int.from_bytes(out[position : position + 3], "big")
        if out[position + 3] == 7:
            code = struct.unpack(">I", out[position + 13 : position + 17])[0]
        position += 9 + length
    assert code is not None, "no GOAWAY"
    return int(code)


def test_requests_arrive_whole_whatever_their_framing() -> None:
    client, connection = connected(max_header_list_size=64 << 10)
    big = [(b"x-filler-%d" % index, b"v" * 400) for index in range(60)]  # over one frame: CONTINUATION
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, REQUEST + big)
    client.send_data(stream_id, b"first,", pad_length=17)
    client.send_data(stream_id, b"second", end_stream=True)
    wire = client.data_to_send()
    assert len(wire) > 16_384 + 9
    events = []
    for index in range(len(wire)):  # a byte at a time
        events += connection.receive(wire[index : index + 1])
    headers, body, ended = received(events)
    assert headers == [REQUEST + big] and body == b"first,second" and ended

    # A body ended by trailers, and an answer split over frames as the client's window allows.
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, REQUEST)
    client.send_data(stream_id, b"body")
    client.send_headers(stream_id, [(b"x-trailer", b"1")], end_stream=True)
    headers, body, ended = received(connection.receive(client.data_to_send()))
    assert headers == [REQUEST] and body == b"body" and ended
    connection.send_headers(stream_id, [(b":status", b"200")])
    connection.send_data(stream_id, b"answer")
    connection.send_headers(stream_id, [(b"grpc-status", b"0")], end_stream=True)
    assert stream_id not in connection.streams  # ended both ways
    answered = client.receive_data(bytes(connection.data_to_send()))
    assert [type(event) for event in answered] == [
        h2.events.ResponseReceived,
        h2.events.DataReceived,
        h2.events.TrailersReceived,
        h2.events.StreamEnded,
    ]
    data, trailers = answered[1], answered[2]
    assert isinstance(data, h2.events.DataReceived) and data.data == b"answer"
    assert isinstance(trailers, h2.events.TrailersReceived) and trailers.headers == [(b"grpc-status", b"0")]


def test_flow_control_holds_both_ways() -> None:
    client, connection = connected()
    # The client sends 3 MiB on one stream of a 1 MiB window: the server gives the window back as
    # it goes, so h2 (which keeps to the windows it is given) never stalls.
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, REQUEST)
    sent = bytearray()
    body = bytearray()
    while len(sent) < 3 << 20:
        chunk = min(client.local_flow_control_window(stream_id), client.max_outbound_frame_size)
        assert chunk > 0, "the client's window was never given back"
        client.send_data(stream_id, b"x" * chunk)
        sent += b"x" * chunk
        _, part, _ = received(connection.receive(client.data_to_send()))
        body += part
        client.receive_data(bytes(connection.data_to_send()))
    assert body == sent

    # The server sends within the client's window, and learns of more from WINDOW_UPDATE and SETTINGS.
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1000})
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, REQUEST, end_stream=True)
    connection.receive(client.data_to_send())
    assert connection.window(stream_id) == 1000
    connection.send_headers(stream_id, [(b":status", b"200")])
    connection.send_data(stream_id, b"y" * 1000)
    assert connection.window(stream_id) == 0
    client.receive_data(bytes(connection.data_to_send()))
    client.increment_flow_control_window(500, stream_id)
    assert (Event.WINDOW, stream_id, None) in connection.receive(client.data_to_send())
    assert connection.window(stream_id) == 500
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 3000})
    assert (Event.SETTINGS, 0, None) in connection.receive(client.data_to_send())
    assert connection.window(stream_id) == 2500
    with pytest.raises(AssertionError):
        connection.send_data(stream_id, b"z" * 2501)


def test_streams_past_the_limit_are_refused_and_hpack_stays_in_step() -> None:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()  # it opens its streams before it reads the server's limit
    connection = server(max_streams=2)
    opened = []
    for index in range(3):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, [*REQUEST, (b"x-new-%d" % index, b"value-%d" % index)])
        opened.append(stream_id)
    events = connection.receive(client.data_to_send())
    assert [stream_id for kind, stream_id, _ in events if kind is Event.REQUEST] == opened[:2]
    connection.reset_stream(opened[0], Http2ErrorCode.CANCEL)  # one place freed
    resets = [
        event
        for event in client.receive_data(bytes(connection.data_to_send()))
        if isinstance(event, h2.events.StreamReset)
    ]
    assert [(event.stream_id, event.error_code) for event in resets] == [
        (opened[2], Http2ErrorCode.REFUSED_STREAM),
        (opened[0], Http2ErrorCode.CANCEL),
    ]
    # The refused stream's header block added to the table: the next one, indexing it, still decodes.
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, [*REQUEST, (b"x-new-2", b"value-2")])
    events = connection.receive(client.data_to_send())
    assert events == [(Event.REQUEST, stream_id, [*REQUEST, (b"x-new-2", b"value-2")])]


def test_a_client_reset_and_pings_are_reported_and_pings_answered() -> None:
    client, connection = connected()
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, REQUEST)
    client.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
    client.ping(b"12345678")
    events = connection.receive(client.data_to_send())
    assert (Event.RESET, stream_id, Http2ErrorCode.CANCEL) in events and (Event.PING, 0, None) in events
    assert stream_id not in connection.streams
    acks = [
        e
        for e in client.receive_data(bytes(connection.data_to_send()))
        if isinstance(e, h2.events.PingAckReceived)
    ]
    assert [ack.ping_data for ack in acks] == [b"12345678"]
    # A WINDOW_UPDATE on the stream the client reset is ignored; DATA is a breach (RFC 9113 5.1:
    # the client sends nothing more on a stream once it reset it).
    assert connection.receive(frame(8, 0, stream_id, struct.pack(">I", 1))) == []
    with pytest.raises(ProtocolError) as raised:
        connection.receive(frame(0, 0, stream_id, b"late"))
    assert raised.value.code == Http2ErrorCode.STREAM_CLOSED


def test_what_the_client_sent_before_it_read_a_reset_is_dropped() -> None:
    """RFC 9113 5.1: HEADERS and DATA on a stream this side reset while the client could still
    send on it are dropped, the block decoded (HPACK stays in step); once the client ends the
    stream, its id is spent like any other."""
    client, connection = connected()
    stream_id = client.get_next_available_stream_id()
    client.send_headers(stream_id, REQUEST)
    connection.receive(client.data_to_send())
    connection.reset_stream(stream_id, Http2ErrorCode.CANCEL)
    client.send_data(stream_id, b"x" * 1000)
    client.send_headers(stream_id, [(b"x-trailer", b"t")], end_stream=True)
    following = client.get_next_available_stream_id()
    client.send_headers(following, [*REQUEST, (b"x-trailer", b"t")], end_stream=True)  # by index
    events = connection.receive(client.data_to_send())
    assert [kind for kind, _, _ in events] == [Event.REQUEST, Event.ENDED]
    assert (b"x-trailer", b"t") in events[0][2]  # type: ignore[operator]
    with pytest.raises(ProtocolError) as raised:
        connection.receive(frame(0, 0, stream_id, b"after its end"))
    assert raised.value.code == Http2ErrorCode.STREAM_CLOSED


SETTINGS_FRAME = frame(4, 0, 0, b"")
HEADERS_OPEN = frame(1, 0x4, 1, bytes([0x83, 0x86, 0x84]))  # :method POST, :scheme http, :path /
BREACHES = {
    "not the preface": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Http2ErrorCode.PROTOCOL_ERROR),
    "a frame before SETTINGS": (PREFACE + frame(6, 0, 0, b"12345678"), Http2ErrorCode.PROTOCOL_ERROR),
    "a frame over 16 KiB": (
        PREFACE + SETTINGS_FRAME + frame(0, 0, 1, b"x" * 16_385),
        Http2ErrorCode.FRAME_SIZE_ERROR,
    ),
    "a frame inside a header block": (
        PREFACE + SETTINGS_FRAME + frame(1, 0, 1, bytes([0x83])) + frame(6, 0, 0, b"12345678"),
        Http2ErrorCode.PROTOCOL_ERROR,
    ),
    "CONTINUATION without HEADERS": (
        PREFACE + SETTINGS_FRAME + frame(9, 0x4, 1, b""),
        Http2ErrorCode.PROTOCOL_ERROR,
    ),
    "an even stream id": (
        PREFACE + SETTINGS_FRAME + frame(1, 0x4, 2, bytes([0x83, 0x86, 0x84])),
        Http2ErrorCode.PROTOCOL_ERROR,
    ),
    "DATA on a stream never opened": (
        PREFACE + SETTINGS_FRAME + frame(0, 0, 3, b"x"),
        Http2ErrorCode.PROTOCOL_ERROR,
    ),
    "a stream id below one used": (
        PREFACE + SETTINGS_FRAME + frame(1, 0x5, 5, bytes([0x83, 0x86, 0x84])) + HEADERS_OPEN,
        Http2ErrorCode.PROTOCOL_ERROR,
    ),
    "DATA on a stream skipped over": (
        PREFACE + SETTINGS_FRAME + frame(1, 0x5, 5, bytes([0x83, 0x86, 0x84])) + frame(0, 0, 3, b"x"),
        Http2ErrorCode.STREAM_CLOSED,
    ),
    "HEADERS after END_STREAM": (
        PREFACE
        + SETTINGS_FRAME
        + frame(1, 0x5, 1, bytes([0x83, 0x86, 0x84]))
        + frame(1, 0x5, 1, bytes([0x83])),
        Http2ErrorCode.STREAM_CLOSED,
    ),
    "DATA after END_STREAM": (
        PREFACE + SETTINGS_FRAME + frame(1, 0x5, 1, bytes([0x83, 0x86, 0x84])) + frame(0, 0, 1, b"x"),
        Http2ErrorCode.STREAM_CLOSED,
    ),
    "DATA padding past its frame": (
        PREFACE + SETTINGS_FRAME + HEADERS_OPEN + frame(0, 0x8, 1, bytes([9]) + b"abc"),
        Http2ErrorCode.PROTOCOL_ERROR,
    ),
    "a header block HPACK cannot decode": (
        PREFACE + SETTINGS_FRAME + frame(1, 0x4, 1, bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x7F])),
        Http2ErrorCode.COMPRESSION_ERROR,
    ),
    "a header block past the limit": (
        PREFACE + SETTINGS_FRAME + frame(1, 0, 1, b"\0" * 16_384) + frame(9, 0, 1, b"\0" * 16_384) * 2,
        Http2ErrorCode.ENHANCE_YOUR_CALM,
    ),
    "WINDOW_UPDATE of 0": (
        PREFACE + SETTINGS_FRAME + frame(8, 0, 0, bytes(4)),
        Http2ErrorCode.PROTOCOL_ERROR,
    ),
    "the connection's window past 2^31-1": (
        PREFACE + SETTINGS_FRAME + frame(8, 0, 0, struct.pack(">I", 2**31 - 1)),
        Http2ErrorCode.FLOW_CONTROL_ERROR,
    ),
    "SETTINGS of a bad length": (
        PREFACE + SETTINGS_FRAME + frame(4, 0, 0, b"12345"),
        Http2ErrorCode.FRAME_SIZE_ERROR,
    ),
    "SETTINGS_MAX_FRAME_SIZE too small": (
        PREFACE + frame(4, 0, 0, struct.pack(">HI", 5, 100)),
        Http2ErrorCode.PROTOCOL_ERROR,
    ),
    "PING of a bad length": (
        PREFACE + SETTINGS_FRAME + frame(6, 0, 0, b"1234"),
        Http2ErrorCode.FRAME_SIZE_ERROR,
    ),
    "RST_STREAM on stream 0": (
        PREFACE + SETTINGS_FRAME + frame(3, 0, 0, bytes(4)),
        Http2ErrorCode.PROTOCOL_ERROR,
    ),
    "PUSH_PROMISE": (PREFACE + SETTINGS_FRAME + frame(5, 0x4, 1, bytes(4)), Http2ErrorCode.PROTOCOL_ERROR),
    "HEADERS too short for its priority fields": (
        PREFACE + SETTINGS_FRAME + frame(1, 0x4 | 0x20, 1, bytes(3)),
        Http2ErrorCode.FRAME_SIZE_ERROR,
    ),
    "HEADERS of a stream that depends on itself": (
        PREFACE
        + SETTINGS_FRAME
        + frame(1, 0x4 | 0x20, 1, struct.pack(">IB", 1, 15) + bytes([0x83, 0x86, 0x84])),
        Http2ErrorCode.PROTOCOL_ERROR,
    ),
    "PRIORITY of a stream that depends on itself": (
        PREFACE + SETTINGS_FRAME + frame(2, 0, 3, struct.pack(">IB", 3, 15)),
        Http2ErrorCode.PROTOCOL_ERROR,
    ),
    "DATA past its stream's window": (
        PREFACE + SETTINGS_FRAME + HEADERS_OPEN + frame(0, 0, 1, b"x" * 16_384) * 65,  # > 1 MiB in one read
        Http2ErrorCode.FLOW_CONTROL_ERROR,
    ),
    "a header block of too many CONTINUATIONs": (
        PREFACE + SETTINGS_FRAME + frame(1, 0, 1, bytes([0x83])) + frame(9, 0, 1, b"") * 33,
        Http2ErrorCode.ENHANCE_YOUR_CALM,
    ),
    "frames that serve no request, by the thousand": (
        PREFACE + SETTINGS_FRAME + frame(2, 0, 3, bytes(5)) * 1001,
        Http2ErrorCode.ENHANCE_YOUR_CALM,
    ),
}


def test_a_larger_initial_window_size_opens_every_open_stream() -> None:
    """RFC 9113 6.9.2: SETTINGS_INITIAL_WINDOW_SIZE changes the window of every open stream; a
    larger one is reported as a WINDOW event of each (a smaller one, or the same, as none)."""
    connection = server()
    connection.receive(PREFACE + frame(4, 0, 0, struct.pack(">HI", 4, 0)) + HEADERS_OPEN)
    connection.receive(frame(1, 0x4, 3, bytes([0x83, 0x86, 0x84])))
    assert connection.window(1) == connection.window(3) == 0
    assert connection.receive(frame(4, 0, 0, struct.pack(">HI", 4, 0))) == [(Event.SETTINGS, 0, None)]
    events = connection.receive(frame(4, 0, 0, struct.pack(">HI", 4, 100) + struct.pack(">HI", 4, 10)))
    assert events == [(Event.SETTINGS, 0, None), (Event.WINDOW, 1, None), (Event.WINDOW, 3, None)]
    assert connection.window(1) == connection.window(3) == 10


def test_a_malformed_request_is_reset_and_reported_only_if_it_was_reported() -> None:
    """RFC 9113 8.1.1: a request whose head is malformed is reset (PROTOCOL_ERROR) before any
    event; one found malformed later (DATA past its content-length, a pseudo-header in its
    trailers) is reset with a RESET event after its REQUEST; the connection serves on."""
    encoder = hpack.Encoder()
    connection = server()
    connection.receive(PREFACE + SETTINGS_FRAME)
    connection.data_to_send()
    upper = encoder.encode([*REQUEST, (b"X-Upper", b"1")])  # the blocks in the order they are sent
    with_length = encoder.encode([*REQUEST, (b"content-length", b"3")])
    events = connection.receive(
        frame(1, 0x4, 1, upper)
        + frame(1, 0x4, 3, with_length)
        + frame(0, 0, 3, b"four")
        + frame(1, 0x4, 5, encoder.encode(REQUEST))
        + frame(1, 0x5, 5, encoder.encode([(b":path", b"/")]))
        + frame(1, 0x4, 7, encoder.encode([*REQUEST, (b"content-length", b"3")]))
        + frame(0, 0x1, 7, b"abc")
    )
    assert [(kind, stream_id) for kind, stream_id, _ in events] == [
        (Event.REQUEST, 3),
        (Event.RESET, 3),
        (Event.REQUEST, 5),
        (Event.RESET, 5),
        (Event.REQUEST, 7),
        (Event.DATA, 7),
        (Event.ENDED, 7),
    ]
    resets = [
        payload for kind, _, stream_id, payload in frames_of(bytes(connection.data_to_send())) if kind == 3
    ]
    assert resets == [struct.pack(">I", Http2ErrorCode.PROTOCOL_ERROR)] * 3
    assert not connection.ended


def frames_of(wire: bytes) -> list[tuple[int, int, int, bytes]]:
    found, position = [], 0
    while position < len(wire):
        length = int.from_bytes(wire[position : position + 3], "big")
        kind, flags, stream_id = struct.unpack_from(">BBI", wire, position + 3)
        found.append((kind, flags, stream_id, wire[position + 9 : position + 9 + length]))
        position += 9 + length
    return found


def test_a_stream_may_send_its_whole_window_again_once_it_is_given_back() -> None:
    """The window given back in one read counts from the next: a client that waits for the
    WINDOW_UPDATEs sends far more than one window on a stream."""
    connection = server()
    connection.receive(PREFACE + SETTINGS_FRAME + HEADERS_OPEN)
    chunk = frame(0, 0, 1, b"x" * 16_384)
    for _ in range(8):  # 8 MiB in reads of 1 MiB, each as the last one's WINDOW_UPDATE allows
        events = connection.receive(chunk * 64)
        assert sum(len(value) for kind, _, value in events if kind is Event.DATA) == 1 << 20
    assert not connection.ended


def test_the_encoders_table_stays_small_whatever_the_client_offers() -> None:
    connection = server()
    connection.receive(PREFACE + frame(4, 0, 0, struct.pack(">HI", 1, 2**32 - 1)))
    assert connection.encoder.header_table_size == 4096


@pytest.mark.parametrize("breach", list(BREACHES))
def test_each_breach_ends_the_connection_with_its_code(breach: str) -> None:
    wire, code = BREACHES[breach]
    connection = server()
    connection.data_to_send()
    with pytest.raises(ProtocolError) as raised:
        connection.receive(wire)
    assert raised.value.code == code
    assert goaway_code(connection) == code
    assert connection.ended and connection.receive(PREFACE + SETTINGS_FRAME) == []


def test_what_is_merely_unusual_is_taken() -> None:
    """Unknown frame types, PRIORITY, a SETTINGS ACK, a PING ACK and SETTINGS it does not know."""
    connection = server()
    wire = (
        PREFACE
        + frame(4, 0, 0, struct.pack(">HI", 0x99, 7))
        + frame(0x42, 0, 1, b"extension")
        + frame(2, 0, 1, bytes(5))
        + frame(4, 0x1, 0, b"")
        + frame(6, 0x1, 0, b"12345678")
        + HEADERS_OPEN
    )
    events = connection.receive(wire)
    assert [kind for kind, _, _ in events] == [Event.SETTINGS, Event.REQUEST]
    assert not connection.ended


def test_mangled_traffic_ends_in_events_or_a_goaway_never_a_crash() -> None:
    """A client's real traffic (prefaces, requests with CONTINUATION, padding, trailers, resets,
    PINGs, window updates) with bytes flipped, cut or repeated: every outcome is events or
    ProtocolError with a GOAWAY queued, and what the server holds stays within one frame."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    for index in range(6):
        stream_id = client.get_next_available_stream_id()
        extra = [(b"x-filler-%d" % n, b"v" * 500) for n in range(40)] if index == 2 else []
        client.send_headers(stream_id, [*REQUEST, (b"x-call", b"%d" % index), *extra])
        client.send_data(stream_id, b"m" * (index * 3000), pad_length=index * 7 if index % 2 else None)
        if index == 3:
            client.reset_stream(stream_id)
        elif index == 4:
            client.send_headers(stream_id, [(b"x-trailer", b"t")], end_stream=True)
        else:
            client.send_data(stream_id, b"", end_stream=True)
        client.ping(b"%08d" % index)
        client.increment_flow_control_window(1000)
    wire = client.data_to_send()
    rng = random.Random(20261204)
    outcomes = {"events": 0, "goaway": 0}
    for _ in range(1500):
        mangled = bytearray(wire)
        for _ in range(rng.randrange(1, 4)):
            action, at = rng.random(), rng.randrange(len(mangled))
            if action < 0.6:
                mangled[at] = rng.randrange(256)
            elif action < 0.8:
                del mangled[at : at + rng.randrange(1, 40)]
            else:
                mangled[at:at] = mangled[at : at + rng.randrange(1, 40)]
        connection = server(max_header_list_size=64 << 10)
        cut = rng.randrange(len(mangled))
        try:
            connection.receive(bytes(mangled[:cut]))
            connection.receive(bytes(mangled[cut:]))
            outcomes["events"] += 1
            assert len(connection._in) < 9 + 16_384
        except ProtocolError as exc:
            assert goaway_code(connection) == exc.code
            outcomes["goaway"] += 1
    assert outcomes["events"] > 100 and outcomes["goaway"] > 100, outcomes


@pytest.mark.parametrize("table_size", [0, 100, 65_536])
def test_answers_decode_whatever_table_size_the_client_sets(table_size: int) -> None:
    """A client may shrink or grow the table the server's encoder fills (SETTINGS_HEADER_TABLE_SIZE):
    the size update reaches the client's decoder first, and every answer decodes the same."""
    client, connection = connected()
    client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: table_size})
    connection.receive(client.data_to_send())
    client.receive_data(bytes(connection.data_to_send()))
    answers = []
    for index in range(5):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, REQUEST, end_stream=True)
        connection.receive(client.data_to_send())
        connection.send_headers(stream_id, [(b":status", b"200"), (b"x-answer", b"%d" % (index % 2))])
        connection.send_headers(stream_id, [(b"grpc-status", b"0")], end_stream=True)
        events = client.receive_data(bytes(connection.data_to_send()))
        answers.append([event.headers for event in events if hasattr(event, "headers")])
    assert answers == [
        [[(b":status", b"200"), (b"x-answer", b"%d" % (index % 2))], [(b"grpc-status", b"0")]]
        for index in range(5)
    ]
