"""gRPC's length-prefixed messages out of one stream's bytes, and into an answer's: a 5-byte
prefix (compressed or not, the length), then the message. A message is held once, in a buffer that
grows as it arrives, so that a size declared but not sent allocates nothing; a compressed one is
inflated a step at a time and no further than the limit."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

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


SCAN_FROM_BYTES = 64 << 10
"""Messages this large are walked (count_fields) before protobuf builds them; a smaller one holds
too few fields to cost much, whatever they are."""
MAX_FIELDS = 65_536
"""Fields one request message may hold, nested ones included. protobuf builds an object for each
(64 MiB of empty repeated entries would be 33 million of them): a tensor travels as a few fields
with its data in one of them, so a real request is far below it."""


def nested_fields(descriptor: Any) -> dict[int, Any]:
    """The field numbers of a message type that hold messages, each with its own table (map
    entries included: a map is a repeated message). Recursive types share their table."""
    tables: dict[str, dict[int, Any]] = {}

    def table(message: Any) -> dict[int, Any]:
        found = tables.get(message.full_name)
        if found is None:
            found = tables[message.full_name] = {}
            for field in message.fields:
                if field.message_type is not None:
                    found[field.number] = table(field.message_type)
        return found

    return table(descriptor)


def count_fields(payload: Buffer, nested: dict[int, Any], limit: int = MAX_FIELDS) -> int:
    """The fields of a message in protobuf's wire format, counted without building it, nested
    messages included; stops and raises RESOURCE_EXHAUSTED past `limit`. What is not well formed
    ends the count (protobuf's parse then says what is wrong)."""
    count = 0
    todo = [(0, len(payload), nested)]
    try:
        while todo:
            position, end, fields = todo.pop()
            while position < end:
                tag, position = _varint(payload, position, end)
                count += 1
                if count > limit:
                    raise RpcError(
                        Status.RESOURCE_EXHAUSTED, f"a request message of more than {limit} fields"
                    )
                kind = tag & 7
                if kind == 0:
                    _, position = _varint(payload, position, end)
                elif kind == 1:
                    position += 8
                elif kind == 5:
                    position += 4
                elif kind == 2:
                    size, position = _varint(payload, position, end)
                    inner = fields.get(tag >> 3)
                    if inner is not None and size:
                        todo.append((position, min(position + size, end), inner))
                    position += size
                else:  # groups, or not protobuf
                    return count
    except _Malformed:
        pass
    return count


class _Malformed(Exception):
    pass


def _varint(data: Buffer, position: int, end: int) -> tuple[int, int]:
    """A varint of at most 10 bytes (a 64-bit value), or _Malformed."""
    value = shift = 0
    for index in range(position, min(position + 10, end)):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, index + 1
        shift += 7
    raise _Malformed
