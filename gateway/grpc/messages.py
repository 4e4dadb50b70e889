"""gRPC's length-prefixed messages out of one stream's bytes, and into an answer's: a 5-byte
prefix (compressed or not, the length), then the message. A message is held once, in a buffer that
grows as it arrives, so that a size declared but not sent allocates nothing; a compressed one is
inflated a chunk at a time and no further than the limit."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

from gateway.grpc.rpc import Buffer, Rpc, RpcError
from gateway.grpc.status import Status

PREFIX = struct.Struct(">BI")
INFLATE_CHUNK = 256 * 1024


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
    """A compressed message in the stream's `grpc-encoding`, its inflated bytes held in the
    stream's share of the decode budget."""
    if rpc.encoding == b"identity":
        raise RpcError(Status.INTERNAL, "a compressed message without grpc-encoding")
    inflater = zlib.decompressobj(31 if rpc.encoding == b"gzip" else 15)
    plain = bytearray()
    rest: Buffer = payload
    try:
        while True:
            chunk = inflater.decompress(rest, INFLATE_CHUNK)
            plain += chunk
            if len(plain) > limit:
                raise RpcError(Status.RESOURCE_EXHAUSTED, f"decompressed message larger than max ({limit})")
            rpc.hold.add(len(chunk))
            rest = inflater.unconsumed_tail
            if not rest and len(chunk) < INFLATE_CHUNK:
                return plain
    except zlib.error as exc:
        raise RpcError(Status.INTERNAL, f"the message could not be decompressed: {exc}") from None
