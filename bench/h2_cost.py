"""What HTTP/2 alone costs the gateway per unary gRPC call: the server side of a connection fed the
frames a client sends for ModelInfer (headers as grpc's C++ client sends them, a small message) and
answering each with headers, a message and the status trailers, in one thread with no network. Two
engines: the gateway's own (gateway.grpc.http2, as gateway.grpc.transport keeps it) and h2, which
the gateway used before, given the same remembering HPACK (gateway.grpc.hpack_memo).

    .venv/bin/python -m bench.h2_cost
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import h2.config
import h2.connection
import h2.events

from gateway.grpc import hpack_memo
from gateway.grpc.http2 import Event
from gateway.grpc.transport import RESPONSE_HEADERS, server_connection

REQUEST_HEADERS = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
    (b":authority", b"127.0.0.1:8001"),
    (b"content-type", b"application/grpc"),
    (b"te", b"trailers"),
    (b"grpc-accept-encoding", b"identity,deflate,gzip"),
    (b"user-agent", b"grpc-c++/1.67.1 grpc-c/44.0.0 (linux; chttp2)"),
]
MESSAGE = b"\x00\x00\x00\x00\x40" + bytes(64)
CALLS_PER_CONNECTION = 90


MAX_HEADER_LIST_SIZE = 16_384


def calls_of(client: h2.connection.H2Connection) -> list[bytes]:
    calls = []
    for _ in range(CALLS_PER_CONNECTION):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, REQUEST_HEADERS)
        client.send_data(stream_id, MESSAGE, end_stream=True)
        calls.append(client.data_to_send())
    return calls


def new_client() -> h2.connection.H2Connection:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    return client


def gateway_engine() -> Callable[[], None]:
    """The gateway's engine past its preface, and a function serving CALLS_PER_CONNECTION calls."""
    client, server = new_client(), server_connection(MAX_HEADER_LIST_SIZE)
    server.initiate()
    server.receive(client.data_to_send())
    client.receive_data(bytes(server.data_to_send()))
    server.receive(client.data_to_send())
    calls = calls_of(client)

    def serve() -> None:
        for data in calls:
            for kind, stream_id, _ in server.receive(data):
                if kind is Event.ENDED:
                    server.send_headers(stream_id, RESPONSE_HEADERS)
                    server.send_data(stream_id, MESSAGE)
                    server.send_headers(stream_id, [(b"grpc-status", b"0")], end_stream=True)
            server.data_to_send()

    return serve


def h2_engine() -> Callable[[], None]:
    """h2 as the gateway kept it before it had its own engine."""
    client = new_client()
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
            validate_inbound_headers=False,
            normalize_inbound_headers=False,
        )
    )
    server.decoder = hpack_memo.Decoder(MAX_HEADER_LIST_SIZE)
    server.encoder = hpack_memo.Encoder()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    calls = calls_of(client)

    def serve() -> None:
        for data in calls:
            for event in server.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    server.send_headers(event.stream_id, RESPONSE_HEADERS)
                    server.send_data(event.stream_id, MESSAGE)
                    server.send_headers(event.stream_id, [(b"grpc-status", b"0")], end_stream=True)
            server.data_to_send()

    return serve


def us_per_call(engine: Callable[[], Callable[[], None]], connections: int) -> float:
    ready = [engine() for _ in range(connections)]
    started = time.perf_counter()
    for serve in ready:
        serve()
    return (time.perf_counter() - started) / (connections * CALLS_PER_CONNECTION) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=40, help="connections per repetition")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.repeat):  # interleaved: this machine's speed moves
        own = us_per_call(gateway_engine, args.connections)
        h2s = us_per_call(h2_engine, args.connections)
        print(f"HTTP/2 per unary call: {own:.1f} µs the gateway's engine, {h2s:.1f} µs h2 with hpack_memo")


if __name__ == "__main__":
    main()
