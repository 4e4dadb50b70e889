"""HPACK that remembers: hpack's encoder and decoder, answering again what they answered for a header
list or block that left their table as it was.

A gRPC client sends the same header block for each call once its headers are in the dynamic table
(every field indexed), and the gateway answers every call with the same headers and trailers. Such
a block decodes, and such a list encodes, the same way for as long as the table stays as it is, and
pure-Python HPACK spends a third of a unary call's HTTP/2 work on them. So each remembers what it did
while the table did not change, and forgets everything the moment an encode or decode changes it
(an entry added or evicted, a size update). What it remembers is bounded: blocks and lists up to
MAX_REMEMBERED_BYTES, at most MAX_REMEMBERED of them per connection.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import hpack
from hpack.table import HeaderTable

MAX_REMEMBERED = 32
MAX_REMEMBERED_BYTES = 512


def _state(table: HeaderTable) -> tuple[int, int, object]:
    """What says the table changed: an add puts a new tuple first, an eviction or resize changes
    the count or the size."""
    entries = table.dynamic_entries
    return len(entries), table.maxsize, entries[0] if entries else None


def _same(before: tuple[int, int, object], after: tuple[int, int, object]) -> bool:
    return before[0] == after[0] and before[1] == after[1] and before[2] is after[2]


class Decoder(hpack.Decoder):
    def __init__(self, max_header_list_size: int) -> None:
        super().__init__(max_header_list_size)
        self._known: dict[tuple[bytes, bool, int, int], list[Any]] = {}

    def decode(self, data: bytes, raw: bool = False) -> Iterable[hpack.HeaderTuple]:
        if len(data) > MAX_REMEMBERED_BYTES:
            self._known.clear()  # it may change the table; nothing depends on remembering it
            return super().decode(data, raw)
        # The limits are part of the key: a block decoded under one may be refused under another.
        key = (bytes(data), raw, self.max_header_list_size, self.max_allowed_table_size)
        known = self._known.get(key)
        if known is not None:
            return list(known)
        before = _state(self.header_table)
        try:
            headers = list(super().decode(data, raw))
        except Exception:
            self._known.clear()  # a partly decoded block may have changed the table
            raise
        if not _same(before, _state(self.header_table)):
            self._known.clear()
        else:
            if len(self._known) >= MAX_REMEMBERED:
                self._known.clear()
            self._known[key] = headers
        return list(headers)


class Encoder(hpack.Encoder):
    def __init__(self) -> None:
        super().__init__()
        self._known: dict[tuple[tuple[bytes, bytes], ...], bytes] = {}

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        fields = tuple(headers)
        # Only plain (name, value) pairs of bytes: a HeaderTuple that must never be indexed equals
        # the plain pair of the same name and value.
        plain = huffman and all(
            type(field) is tuple and len(field) == 2 and type(field[0]) is bytes and type(field[1]) is bytes
            for field in fields
        )
        if not plain or self.header_table.resized:
            self._known.clear()
            return super().encode(fields, huffman)
        known = self._known.get(fields)
        if known is not None:
            return known
        before = _state(self.header_table)
        block = super().encode(fields, huffman)
        if not _same(before, _state(self.header_table)):
            self._known.clear()
        elif len(block) <= MAX_REMEMBERED_BYTES:
            if len(self._known) >= MAX_REMEMBERED:
                self._known.clear()
            self._known[fields] = block
        return block


def install(connection: Any) -> None:
    """Give a new h2 connection (before its first frame) the remembering encoder and decoder,
    with the limits h2 set on its own."""
    decoder = Decoder(connection.decoder.max_header_list_size)
    decoder.max_allowed_table_size = connection.decoder.max_allowed_table_size
    decoder.header_table_size = connection.decoder.header_table_size
    connection.decoder = decoder
    encoder = Encoder()
    encoder.header_table_size = connection.encoder.header_table_size
    encoder.header_table.resized = connection.encoder.header_table.resized
    connection.encoder = encoder
