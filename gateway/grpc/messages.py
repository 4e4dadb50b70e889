"""gRPC's length-prefixed messages out of one stream's bytes, and into an answer's: a 5-byte
prefix (compressed or not, the length), then the message. A message is held once, in a buffer that
grows as it arrives, so that a size declared but not sent allocates nothing; a compressed one is
inflated a step at a time and no further than the limit."""

from __future__ import annotations

import struct
from collections.abc import Iterator

from fngate.errors import InvalidArgument, PayloadTooLarge
from gateway.decompression import Inflater
from gateway.grpc.rpc import Buffer, Rpc, RpcError
from gateway.grpc.status import Status

PREFIX = struct.Struct(">BI")


def framed(payload: bytes) -> bytes:
    """An uncompressed message, ready to send."""
    return PREFIX.pack(0, len(payload)) + payload


def read(rpc: Rpc, data: bytes, limit: int) -> Iterator[tuple[bool, Buffer]]:
    """The messages `data` completes on the stream, as (compressed, bytes); what is left of a
    message waits in `rpc.buffer` for the next bytes. Raises RESOURCE_EXHAUSTED for a prefix that
    declares more than `limit`."""
    if rpc.size is None and not rpc.buffer and len(data) >= 5:
        compressed, size = PREFIX.unpack_from(data)
        if size == len(data) - 5 and size <= limit:
            # The usual case: one whole message in one frame, parsed where it lies.
            yield bool(compressed), memoryview(data)[5:]
            return
    view = memoryview(data)
    while True:
        if rpc.size is None:
            if not view:
                return
            need = 5 - len(rpc.buffer)
            rpc.buffer += view[:need]
            view = view[need:]
            if len(rpc.buffer) < 5:
                return
            compressed, size = PREFIX.unpack_from(rpc.buffer)
            if size > limit:
                raise RpcError(
                    Status.RESOURCE_EXHAUSTED, f"received message larger than max ({size} vs. {limit})"
                )
            rpc.buffer, rpc.size, rpc.compressed = bytearray(), size, bool(compressed)
        wanted = rpc.size - len(rpc.buffer)
        rpc.buffer += view[:wanted]
        view = view[wanted:]
        if len(rpc.buffer) < rpc.size:
            return
        body, rpc.buffer, rpc.size = rpc.buffer, bytearray(), None
        yield rpc.compressed, body


def inflated(rpc: Rpc, payload: Buffer, limit: int) -> bytearray:
    """A compressed message in the stream's `grpc-encoding` (gateway.decompression, as HTTP bodies
    are), its inflated bytes held in the stream's share of the decode allowance."""
    if rpc.encoding == b"identity":
        raise RpcError(Status.INTERNAL, "a compressed message without grpc-encoding")
    plain = bytearray()

    def take(chunk: bytes) -> None:
        rpc.hold.add(len(chunk))
        plain.extend(chunk)

    inflater = Inflater(rpc.encoding.decode("ascii"), limit, take, what="message")
    try:
        inflater.feed(payload)
        inflater.close()
    except PayloadTooLarge:
        raise RpcError(Status.RESOURCE_EXHAUSTED, f"decompressed message larger than max ({limit})") from None
    except InvalidArgument as exc:  # not the encoding it names, or cut short
        raise RpcError(Status.INTERNAL, exc.message) from None
    return plain
