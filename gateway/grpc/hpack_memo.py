"""HPACK that remembers: hpack's encoder and decoder, answering again what they answered for a header
list or block that left their table as it was.

A gRPC client sends the same header block for each call once its headers are in the dynamic table
(every field indexed), and the gateway answers every call with the same headers and trailers. Such
a block decodes, and such a list encodes, the same way for as long as the table stays as it is, and
pure-Python HPACK would spend on them three quarters of a unary call's HTTP/2 work (about 17 of
23 µs in gateway.grpc.http2, `python -m bench.h2_cost`'s call). So each remembers what it did
while the table did not change, and forgets everything the moment an encode or decode changes it
(an entry added or evicted, a size update). What it remembers is bounded: blocks and lists up to
MAX_REMEMBERED_BYTES, at most MAX_REMEMBERED of them per connection. The decoder remembers with a
block what a judge said of its header list (`decode_judged`: gateway.grpc.fields' RFC 9113 checks).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar, cast

import hpack
from hpack.table import HeaderTable

MAX_REMEMBERED = 32
MAX_REMEMBERED_BYTES = 512
Fields = Sequence[tuple[bytes, bytes]]
V = TypeVar("V")


class _Memory:
    """Answers kept for as long as one HPACK table stays as it was: an add puts a new tuple first,
    an eviction or a resize changes the count or the size, and any of them forgets all."""

    def __init__(self, table: HeaderTable) -> None:
        self._table = table
        self._known: dict[Hashable, Any] = {}

    def __len__(self) -> int:
        return len(self._known)

    def recall(self, key: Hashable) -> Any:
        return self._known.get(key)

    def state(self) -> tuple[int, int, object]:
        entries = self._table.dynamic_entries
        return len(entries), self._table.maxsize, entries[0] if entries else None

    def keep(self, key: Hashable, answer: Any, before: tuple[int, int, object], size: int) -> None:
        """Remember `answer` (of `size` bytes) if the table is as it was `before` it was worked out."""
        after = self.state()
        if before[:2] != after[:2] or before[2] is not after[2]:
            self._known.clear()
        elif size <= MAX_REMEMBERED_BYTES:
            if len(self._known) >= MAX_REMEMBERED:
                self._known.clear()
            self._known[key] = answer

    def forget(self) -> None:
        self._known.clear()


class Decoder(hpack.Decoder):
    def __init__(self, max_header_list_size: int) -> None:
        super().__init__(max_header_list_size)
        self._memory = _Memory(self.header_table)

    def decode(self, data: bytes, raw: bool = False) -> Iterable[hpack.HeaderTuple]:
        # The limits are part of the key: a block decoded under one may be refused under another.
        key = (bytes(data), raw, self.max_header_list_size, self.max_allowed_table_size)
        known = self._memory.recall(key)
        if known is not None:
            return list(known)
        before = self._memory.state()
        try:
            headers = tuple(super().decode(data, raw))
        except Exception:
            self._memory.forget()  # a partly decoded block may have changed the table
            raise
        self._memory.keep(key, headers, before, len(data))
        return list(headers)

    def decode_judged(self, data: bytes, judge: Callable[[Fields], V]) -> tuple[list[tuple[bytes, bytes]], V]:
        """`decode(data, raw=True)` and what `judge` (a pure function of the header list) says of
        it, remembered together: a block decoded from memory is not judged again."""
        key = (bytes(data), judge, self.max_header_list_size, self.max_allowed_table_size)
        known = self._memory.recall(key)
        if known is not None:
            return list(known[0]), known[1]
        before = self._memory.state()
        try:
            headers = cast(Fields, tuple(super().decode(data, True)))
        except Exception:
            self._memory.forget()  # a partly decoded block may have changed the table
            raise
        verdict = judge(headers)
        self._memory.keep(key, (headers, verdict), before, len(data))
        return list(headers), verdict


class Encoder(hpack.Encoder):
    def __init__(self) -> None:
        super().__init__()
        self._memory = _Memory(self.header_table)

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        fields = tuple(headers)
        # Only plain (name, value) pairs of bytes: a HeaderTuple that must never be indexed equals
        # the plain pair of the same name and value.
        plain = huffman and all(
            type(field) is tuple and len(field) == 2 and type(field[0]) is bytes and type(field[1]) is bytes
            for field in fields
        )
        if not plain or self.header_table.resized:
            self._memory.forget()
            return super().encode(fields, huffman)
        known: bytes | None = self._memory.recall(fields)
        if known is not None:
            return known
        before = self._memory.state()
        block = super().encode(fields, huffman)
        self._memory.keep(fields, block, before, len(block))
        return block
