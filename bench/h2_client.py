"""A bare HTTP/2 client (h2) for what grpc's clients never send: the hostile streams and frames
that tests/gateway/grpc/test_transport.py and scenario H (bench.hostile) put to a gateway's gRPC
port. It records each stream's headers and trailers, resets and the connection's GOAWAY."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable

import h2.config
import h2.connection
import h2.events
from tritonclient.grpc import service_pb2

INFER = b"/inference.GRPCInferenceService/ModelInfer"
LIVE = b"/inference.GRPCInferenceService/ServerLive"


class RawClient:
    """A bare HTTP/2 client (h2) for what grpc's clients never send."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.h2.initiate_connection()
        self.flush()
        self.statuses: dict[int, dict[bytes, bytes]] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.closed = False
        self.settled = False
        self.resets: dict[int, int] = {}

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        """Connected, with the server's settings and windows in."""
        client = cls(*await asyncio.open_connection("127.0.0.1", port))
        try:
            await client.read(lambda: client.settled)
        except BaseException:
            await client.hang_up()
            raise
        return client

    def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())

    def open(
        self, path: bytes = INFER, extra: list[tuple[bytes, bytes]] | None = None, send: bool = True
    ) -> int:
        """A new stream's headers, sent at once unless `send` is false (then with the next flush)."""
        stream_id = self.h2.get_next_available_stream_id()
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path),
            (b":authority", b"127.0.0.1"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            *(extra or []),
        ]
        self.h2.send_headers(stream_id, headers)
        if send:
            self.flush()
        return stream_id

    def send(self, stream_id: int, data: bytes, end: bool = False) -> None:
        size = self.h2.max_outbound_frame_size
        for start in range(0, len(data), size):
            last = start + size >= len(data)
            self.h2.send_data(stream_id, data[start : start + size], end_stream=end and last)
        self.flush()

    async def send_all(self, stream_id: int, data: bytes, end: bool = False) -> None:
        """All of `data`, as the stream's and the connection's windows let it go; stops early
        if the server answers or resets the stream first."""
        view = memoryview(data)
        connection = self.h2

        def answered() -> bool:
            return stream_id in self.resets or b"grpc-status" in self.statuses.get(stream_id, {})

        while view and not self.closed:
            size = min(connection.local_flow_control_window(stream_id), connection.max_outbound_frame_size)
            if size <= 0:
                await self.read(lambda: answered() or connection.local_flow_control_window(stream_id) > 0)
                if answered():
                    return
                continue
            connection.send_data(stream_id, bytes(view[:size]), end_stream=end and len(view) <= size)
            view = view[size:]
            self.flush()

    async def read(self, done: Callable[[], bool], timeout_s: float = 10) -> None:
        """Take events until `done()` or the connection ends."""
        async with asyncio.timeout(timeout_s):
            while not done() and not self.closed:
                try:
                    data = await self.reader.read(65536)
                except ConnectionResetError:  # closed with what this client sent still unread
                    data = b""
                if not data:
                    self.closed = True
                    return
                for event in self.h2.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                        self.statuses.setdefault(event.stream_id, {}).update(dict(event.headers or []))
                    elif isinstance(event, h2.events.DataReceived):
                        self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        self.goaway = event
                    elif isinstance(event, h2.events.RemoteSettingsChanged):
                        self.settled = True
                    elif isinstance(event, h2.events.StreamReset):
                        self.resets[event.stream_id] = event.error_code
                self.flush()

    async def status_of(self, stream_id: int, timeout_s: float = 10) -> dict[bytes, bytes]:
        """The stream's response headers and trailers once it has a grpc-status or an HTTP error."""

        def answered() -> bool:
            found = self.statuses.get(stream_id, {})
            return b"grpc-status" in found or found.get(b":status", b"200") != b"200"

        await self.read(answered, timeout_s)
        return self.statuses.get(stream_id, {})

    async def ended(self, timeout_s: float = 10) -> None:
        await self.read(lambda: False, timeout_s)

    def close(self) -> None:
        self.writer.close()

    async def hang_up(self) -> None:
        await hang_up(self.writer)


async def hang_up(writer: asyncio.StreamWriter) -> None:
    """Close a raw test connection for good: a FIN once what was written has gone, else (a server
    that stopped reading holds the rest) a reset. A writer only close()d keeps its transport
    waiting for the server to read, and the transport, collected later, warns in another test."""
    writer.close()
    try:
        async with asyncio.timeout(1):
            await writer.wait_closed()
    except (TimeoutError, OSError):
        writer.transport.abort()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def message(payload: bytes, compressed: bool = False) -> bytes:
    """One gRPC message: its 5-byte prefix (compressed flag, length), then the payload."""
    return struct.pack(">BI", 1 if compressed else 0, len(payload)) + payload


def live_request() -> bytes:
    return message(service_pb2.ServerLiveRequest().SerializeToString())
