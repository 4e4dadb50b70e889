"""What HTTP/2 alone costs the gateway per unary gRPC call: h2 on the server side of a connection,
kept as the gateway keeps it (gateway.grpc.transport.server_connection), fed the frames a client
sends for ModelInfer (headers as grpc's C++ client sends them, a small message) and answering each
with headers, a message and the status trailers, in one thread with no network. Beside it, the
same without the remembering HPACK (gateway.grpc.hpack_memo).

    .venv/bin/python -m bench.h2_cost
"""

from __future__ import annotations

import argparse
import time

import h2.config
import h2.connection
import h2.events
import hpack

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


def connected(remembering: bool) -> tuple[h2.connection.H2Connection, list[bytes]]:
    """A server connection past its preface, and what a client sends for each of its calls."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    server = server_connection()
    if not remembering:
        server.encoder, server.decoder = hpack.Encoder(), hpack.Decoder(server.decoder.max_header_list_size)
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    calls = []
    for _ in range(CALLS_PER_CONNECTION):
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, REQUEST_HEADERS)
        client.send_data(stream_id, MESSAGE, end_stream=True)
        calls.append(client.data_to_send())
    return server, calls


def serve(server: h2.connection.H2Connection, calls: list[bytes]) -> None:
    for data in calls:
        for event in server.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                server.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                server.send_headers(event.stream_id, RESPONSE_HEADERS)
                server.send_data(event.stream_id, MESSAGE)
                server.send_headers(event.stream_id, [(b"grpc-status", b"0")], end_stream=True)
        server.data_to_send()


def us_per_call(remembering: bool, connections: int) -> float:
    ready = [connected(remembering) for _ in range(connections)]
    started = time.perf_counter()
    for server, calls in ready:
        serve(server, calls)
    return (time.perf_counter() - started) / (connections * CALLS_PER_CONNECTION) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=40, help="connections per repetition")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.repeat):  # interleaved: this machine's speed moves
        kept = us_per_call(True, args.connections)
        plain = us_per_call(False, args.connections)
        print(f"h2 per unary call: {kept:.1f} µs as the gateway keeps it, {plain:.1f} µs without hpack_memo")


if __name__ == "__main__":
    main()
