"""A tensor's `data` in a JSON body, decoded as it arrives (gateway.http.decoding finds where it
starts): numbers parsed by orjson a slice of at most SLICE_BYTES of text at a time, with the
brackets blanked out, into a buffer of the size the request declares (or, before its shape is known,
growing up to the most the function takes), refused at the first value past it; the brackets and
commas alone (the data's *outline*) kept, to be compared at the end with the outline its shape
gives. Strings (BYTES) are collected as text, their count bounded by their quotes as they come,
and parsed whole."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from fngate.errors import InvalidArgument
from fngate.manifest import TensorSpec

SLICE_BYTES = 256 * 1024
"""Numbers are parsed this many bytes of text at a time: the most a parse holds as Python objects."""
MAX_NUMBER_BYTES = 4096
"""The longest run of text without a comma that a number may take."""

_OPEN, _CLOSE, _QUOTE = ord("["), ord("]"), ord('"')
_BLANK_BRACKETS = bytes.maketrans(b"[]", b"  ")
_NOT_OUTLINE = bytes(c for c in range(256) if c not in b"[],")
_MARK = re.compile(rb'["\[\]]')
_WHITESPACE = b" \t\r\n"
_POSITION = re.compile(r": line \d+ column \d+ \(char \d+\)")


@dataclasses.dataclass(slots=True)
class Decoded:
    """One tensor's data as the decoder found it: numbers (`values`, flat, with the outline of
    their brackets) or, for strings, the parsed JSON (`strings`)."""

    spec: TensorSpec | None
    values: np.ndarray[Any, Any] | None = None
    outline: bytes = b""
    strings: Any = None


def _depths(text: bytes, depth: int) -> tuple[int, int, int]:
    """Where the list that is open `depth` deep at the start of `text` closes (len(text) when it
    does not), the depth there, and the deepest level reached before."""
    if b"[" not in text and b"]" not in text:
        return len(text), depth, depth
    codes = np.frombuffer(text, np.uint8)
    marks = np.flatnonzero((codes == _OPEN) | (codes == _CLOSE))
    levels = depth + np.cumsum(np.where(codes[marks] == _OPEN, 1, -1))
    closed = np.flatnonzero(levels == 0)
    if closed.size:
        last = int(closed[0])
        return int(marks[last]) + 1, 0, int(levels[: last + 1].max())
    return len(text), int(levels[-1]), int(levels.max())


class NumbersDecoder:
    """A numeric tensor's data, decoded as it arrives into a buffer of at most `limit` elements."""

    def __init__(
        self,
        decoded: Decoded,
        limit: int,
        rank: int,
        dtype: np.dtype[Any] | None,
        exact: bool,
        reserve: Callable[[int], None],
    ) -> None:
        self.decoded = decoded
        self.limit = limit
        self.rank = rank
        self.dtype = dtype
        self.where = f"input '{decoded.spec.name}'" if decoded.spec is not None else "an input"
        self.reserve = reserve
        self.depth = 0
        self.count = 0
        self.flat = b""
        self.outline = bytearray()
        self.parts: list[np.ndarray[Any, Any]] = []
        self.buffer: np.ndarray[Any, Any] | None = None
        if exact and dtype is not None:
            self.buffer = np.empty(limit, dtype)  # its pages are taken (and counted) as it fills

    def feed(self, text: bytes) -> int:
        """Take the data in `text`: how much of it was data when the data ended there, else -1."""
        end, self.depth, deepest = _depths(text, self.depth)
        if deepest > self.rank:
            raise InvalidArgument(
                f"{self.where}: data nested deeper than the {self.rank} dimensions of its shape"
            )
        part = text[:end]
        if _QUOTE in part:
            if self.decoded.spec is None:
                raise InvalidArgument("put each input's 'name' before its 'data'")
            raise InvalidArgument(
                f"{self.where}: data is not a well-formed array of {self.decoded.spec.datatype}"
            )
        self.outline += part.translate(None, _NOT_OUTLINE)
        self.flat = (self.flat + part.translate(_BLANK_BRACKETS)).lstrip(_WHITESPACE)
        done = self.depth == 0
        if done:
            self._parse(self.flat)
            self.flat = b""
            self._finish()
            return end
        while len(self.flat) >= SLICE_BYTES or (b"," in self.flat and len(self.flat) > MAX_NUMBER_BYTES):
            cut = self.flat.rfind(b",", 0, SLICE_BYTES + 1) if len(self.flat) > SLICE_BYTES else -1
            if cut < 0:
                cut = self.flat.rfind(b",")
            if cut < 0:
                raise InvalidArgument(f"{self.where}: a number of more than {MAX_NUMBER_BYTES} characters")
            self._parse(self.flat[:cut])
            self.flat = self.flat[cut + 1 :].lstrip(_WHITESPACE)
        return -1

    def _parse(self, text: bytes) -> None:
        """Numbers separated by commas (none missing) into the buffer."""
        if not text.strip(_WHITESPACE):
            if self.count == 0 and self.outline.count(b",") == 0 and text == self.flat:
                return  # no element at all: '[]', refused with the outline
            raise InvalidArgument(f"{self.where}: data is not a well-formed array (a value is missing)")
        try:
            values = orjson.loads(b"[" + text + b"]")
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(
                f"{self.where}: data is not a well-formed array of {self._datatype()} ({reason(exc)})"
            ) from None
        if not values:
            raise InvalidArgument(f"{self.where}: data is not a well-formed array (a value is missing)")
        boolean = self.decoded.spec is not None and self.decoded.spec.datatype == "BOOL"
        if not boolean and (b"t" in text or b"f" in text):
            raise InvalidArgument(f"{self.where}: booleans in data of datatype {self._datatype()}")
        start = self.count
        self.count += len(values)
        if self.count > self.limit:
            raise InvalidArgument(
                f"{self.where}: more than {self.limit} elements of data"
                + (" for its shape" if self.buffer is not None else " (the most the function takes)")
            )
        try:
            array = np.asarray(values, dtype=self.dtype)
        except (ValueError, TypeError, OverflowError) as exc:
            raise InvalidArgument(
                f"{self.where}: data is not a well-formed array of {self._datatype()}: {exc}"
            ) from None
        if array.dtype.kind == "O":
            raise InvalidArgument(f"{self.where}: data is not a well-formed array of numbers")
        self.reserve(array.nbytes)
        if self.buffer is not None:
            self.buffer[start : self.count] = array
        else:
            self.parts.append(array)

    def _datatype(self) -> str:
        return self.decoded.spec.datatype if self.decoded.spec is not None else "numbers"

    def _finish(self) -> None:
        if self.buffer is not None:
            values = self.buffer[: self.count]
        elif len(self.parts) == 1:
            values = self.parts[0]
        else:
            self.reserve(sum(part.nbytes for part in self.parts))
            values = np.concatenate(self.parts) if self.parts else np.empty(0, self.dtype or np.float64)
        self.parts = []
        self.decoded.values = values
        self.decoded.outline = bytes(self.outline)


class StringsDecoder:
    """A BYTES tensor's data: its text, collected whole while its strings stay within `limit`,
    scanned once (a string's end is looked for from where the last chunk left off)."""

    def __init__(self, decoded: Decoded, limit: int, rank: int, reserve: Callable[[int], None]) -> None:
        self.decoded = decoded
        self.limit = limit
        self.rank = rank
        self.reserve = reserve
        self.where = f"input '{decoded.spec.name if decoded.spec is not None else ''}'"
        self.text = bytearray()
        self.scanned = 0
        self.depth = 0
        self.in_string = False
        self.strings = 0

    def feed(self, text: bytes) -> int:
        self.reserve(len(text))
        start = len(self.text)
        self.text += text
        buffer = self.text
        position = self.scanned
        while position < len(buffer):
            if self.in_string:
                quote = buffer.find(b'"', position)
                if quote < 0:
                    position = len(buffer)
                    break
                position = quote + 1
                if not _escaped(buffer, quote):
                    self.in_string = False
                    self.strings += 1
                    if self.strings > self.limit:
                        raise InvalidArgument(f"{self.where}: more than {self.limit} elements of data")
                continue
            found = _MARK.search(buffer, position)
            if found is None:
                position = len(buffer)
                break
            position = found.end()
            mark = found.group()
            if mark == b'"':
                self.in_string = True
            elif mark == b"[":
                self.depth += 1
                if self.depth > self.rank:
                    raise InvalidArgument(
                        f"{self.where}: data nested deeper than the {self.rank} dimensions of its shape"
                    )
            else:
                self.depth -= 1
                if self.depth == 0:
                    self._finish(bytes(buffer[:position]))
                    return position - start
        self.scanned = position
        return -1

    def _finish(self, text: bytes) -> None:
        self.text = bytearray()
        try:
            self.decoded.strings = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"the body is not valid JSON: {reason(exc)}") from None


def _escaped(buffer: bytearray, quote: int) -> bool:
    """Whether the quote at `quote` follows an odd run of backslashes."""
    run = 0
    while quote - run - 1 >= 0 and buffer[quote - run - 1] == ord("\\"):
        run += 1
    return run % 2 == 1


def reason(exc: orjson.JSONDecodeError) -> str:
    """orjson's reason, without a position (in the text it saw, which is not the body's)."""
    return _POSITION.sub("", str(exc))


def outline_of(shape: tuple[int, ...] | list[int]) -> bytes:
    """The brackets and commas of data nested like `shape`: (2, 3) -> b'[[,,],[,,]]'."""
    text = b"[" + b"," * (shape[-1] - 1) + b"]"
    for dim in reversed(shape[:-1]):
        text = b"[" + b",".join([text] * dim) + b"]"
    return text


def shape_of_outline(outline: bytes, where: str) -> tuple[int, ...]:
    """The shape of nested lists from their outline, refusing ragged or empty ones."""
    rank = len(outline) - len(outline.lstrip(b"["))
    if rank == 0 or b"[]" in outline:
        raise InvalidArgument(f"{where}: empty lists are not tensors")
    codes = np.frombuffer(outline, np.uint8)
    levels = np.cumsum(np.where(codes == _OPEN, 1, np.where(codes == _CLOSE, -1, 0)))
    commas = codes == ord(",")
    shape = []
    for level in range(1, rank + 1):
        # The first list `level` deep: from its bracket to the first close back to `level - 1`.
        start = level - 1
        closes = np.flatnonzero((codes[start:] == _CLOSE) & (levels[start:] == level - 1))
        end = start + int(closes[0])
        shape.append(int(np.count_nonzero(commas[start:end] & (levels[start:end] == level))) + 1)
    if outline_of(shape) != outline:
        raise InvalidArgument(f"{where}: nested lists of different lengths (ragged) are not a tensor")
    return tuple(shape)
