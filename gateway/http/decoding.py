"""The streaming decoder of JSON invocation bodies (V2 and /v1): fed the body a chunk at a time as it
arrives (or as it is decompressed), it writes the numbers of each tensor's `data` straight into a
buffer of the size the request declares (or, before the shape is known, the most the function
accepts) and refuses the body at the first value past it, so that the memory a body costs follows
what it may hold rather than how much text it sends.

Everything but the tensor data (names, shapes, parameters: the *fields*) is collected as text, at
most MAX_FIELDS_BYTES of it, with each decoded `data` replaced by `null`, and parsed by orjson once
the body is complete; a tokenizer follows the path to each tensor's data, and hands the data to
gateway.http.tensor_data with what the input's fields said before it (its name, shape, datatype).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from typing import Any

import orjson

from fngate.errors import InvalidArgument
from fngate.manifest import FunctionManifest, TensorSpec
from fngate.tensors import DATATYPES
from gateway.http.tensor_data import SLICE_BYTES, Decoded, NumbersDecoder, StringsDecoder, reason
from gateway.validation import check_datatype, check_shape, input_spec, shown

MAX_FIELDS_BYTES = 64 * 1024
"""The JSON of a body apart from its tensors' data: names, shapes, parameters, outputs."""

_SPACE = re.compile(rb"[ \t\r\n]*")
_TOKEN = re.compile(rb'("(?:[^"\\]|\\.)*")|([{}\[\]:,])|([^ \t\r\n{}\[\]:,"]+)')
_WHITESPACE = b" \t\r\n"


class _Frame:
    __slots__ = ("fields", "index", "is_object", "key", "keys", "start")

    def __init__(self, is_object: bool) -> None:
        self.is_object = is_object
        self.key: Any = None
        """The key of the value being read (objects), or its index (arrays)."""
        self.index = -1
        self.keys: set[str] | None = None
        self.fields: dict[str, Any] | None = None
        """The values read so far, for an input's object (V2): name, shape, datatype."""
        self.start = 0


class JsonBodyDecoder:
    """Feed it a body's text (`feed`, any number of times), then `finish()` for the parsed fields
    and each tensor's decoded data. Raises InvalidArgument as soon as the body is known to be bad.
    `reserve(n)` is called before n more bytes are held for a tensor (a budget may refuse it)."""

    def __init__(
        self,
        manifest: FunctionManifest,
        dialect: str,
        reserve: Callable[[int], None],
        max_elements: int,
    ) -> None:
        self.manifest = manifest
        self.dialect = dialect
        """'v2' (the tensors under inputs[i].data) or 'v1' (under inputs.<name>)."""
        self._reserve = reserve
        self._max_elements = max_elements
        """The bound when neither the shape nor the function bounds a tensor (the body limit's)."""
        self._fields = bytearray()
        self._pending = b""
        self._stack: list[_Frame] = []
        self._done = False
        self.decoded: dict[Any, Decoded] = {}
        """By input index (V2) or name (/v1)."""
        self._data: NumbersDecoder | StringsDecoder | None = None

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        view = memoryview(chunk)
        for start in range(0, len(view), SLICE_BYTES):  # what a step holds stays small
            self._feed(bytes(view[start : start + SLICE_BYTES]))

    def _feed(self, text: bytes) -> None:
        while text:
            if self._data is not None:
                used = self._data.feed(text)
                if used < 0:
                    return
                self._end_data()
                text = text[used:]
            else:
                text = self._tokens(self._pending + text)

    def finish(self) -> dict[str, Any]:
        """The body's fields, each decoded `data` a null (find it in `decoded`)."""
        if self._data is not None:
            raise InvalidArgument("the body is not valid JSON: it ends inside a tensor's data")
        rest = self._pending.strip(_WHITESPACE)
        if rest:
            self._tokens(self._pending, final=True)
        try:
            doc = orjson.loads(bytes(self._fields))
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"the body is not valid JSON: {reason(exc)}") from None
        if not isinstance(doc, dict):
            raise InvalidArgument("the body must be a JSON object")
        return doc

    # The fields: a tokenizer that follows the path to each tensor's data.

    def _tokens(self, text: bytes, final: bool = False) -> bytes:
        """Tokens of `text` into the fields until a tensor's data starts (returns the text from
        there) or the text ends (returns b''; an incomplete token waits for more)."""
        position = 0
        end = len(text)
        while True:
            position = _SPACE.match(text, position).end()  # type: ignore[union-attr]
            if position == end:
                break
            found = _TOKEN.match(text, position)
            if found is None:  # a string that has not ended
                if not final:
                    break
                self._append(text[position:])  # orjson names what is wrong with it
                self._pending = b""
                return b""
            if found.end() == end and not final and not found.group(2):
                break  # a string or literal that may go on in the next chunk
            string, mark, literal = found.groups()
            position = found.end()
            if mark is not None:
                if mark in b"{[":
                    if self._starts_data(mark):
                        self._pending = b""
                        return text[found.start(2) :]
                    self._append(mark)
                    self._open(mark == b"{")
                elif mark in b"}]":
                    self._append(mark)
                    self._close()
                elif mark == b":":
                    self._append(mark)
                else:  # a comma
                    self._append(mark)
                    self._next()
            else:
                token = string if string is not None else literal
                self._append(token)
                self._scalar(token, string is not None)
        self._pending = text[position:]
        if len(self._pending) > MAX_FIELDS_BYTES:
            raise InvalidArgument(
                f"the body's fields other than tensor data are over {MAX_FIELDS_BYTES} bytes"
            )
        return b""

    def _append(self, token: bytes) -> None:
        self._fields += token
        if len(self._fields) > MAX_FIELDS_BYTES:
            raise InvalidArgument(
                f"the body's fields other than tensor data are over {MAX_FIELDS_BYTES} bytes"
            )

    def _open(self, is_object: bool) -> None:
        if not self._stack and not is_object:
            raise InvalidArgument("the body must be a JSON object")
        frame = _Frame(is_object)
        if len(self._stack) < 3:
            frame.keys = set() if is_object else None
        if self._is_input_object(frame):
            frame.fields = {}
        if not is_object:
            frame.index = 0
            frame.key = 0
        self._stack.append(frame)
        frame.start = len(self._fields)

    def _close(self) -> None:
        if not self._stack:
            return  # orjson refuses the stray bracket
        frame = self._stack.pop()
        if self._stack:
            self._value_done(self._stack[-1], frame.start - 1)

    def _next(self) -> None:
        if self._stack:
            frame = self._stack[-1]
            if frame.is_object:
                frame.key = None
            else:
                frame.index += 1
                frame.key = frame.index

    def _scalar(self, token: bytes, is_string: bool) -> None:
        if not self._stack:
            return
        frame = self._stack[-1]
        if frame.is_object and frame.key is None:
            if not is_string:
                return  # orjson refuses a key that is not a string
            key = _string(token)
            if frame.keys is not None:
                if key in frame.keys:
                    raise InvalidArgument(f"the key '{shown(key)}' is given twice")
                frame.keys.add(key)
            frame.key = key
            return
        self._value_done(frame, len(self._fields) - len(token))

    def _value_done(self, frame: _Frame, start: int) -> None:
        """A value of `frame` ended: an input's name, shape and datatype are kept, to bound its data."""
        if frame.fields is not None and frame.key in ("name", "shape", "datatype"):
            with contextlib.suppress(orjson.JSONDecodeError):  # the final parse names it
                frame.fields[frame.key] = orjson.loads(bytes(self._fields[start:]))

    def _is_input_object(self, frame: _Frame) -> bool:
        """inputs[i] of a V2 body: the frame about to open under root -> "inputs" -> array."""
        stack = self._stack
        return (
            self.dialect == "v2"
            and frame.is_object
            and len(stack) == 2
            and stack[0].is_object
            and stack[0].key == "inputs"
            and not stack[1].is_object
        )

    def _starts_data(self, mark: bytes) -> bool:
        """Whether the list opening here is a tensor's data; if so the decoder switches to it."""
        stack = self._stack
        if mark != b"[" or not stack or not stack[0].is_object or stack[0].key != "inputs":
            return False
        if self.dialect == "v1":
            if len(stack) != 2 or not stack[1].is_object or not isinstance(stack[1].key, str):
                return False
            slot: Any = stack[1].key
            spec: TensorSpec | None = input_spec(self.manifest, slot, "inputs")
            fields: dict[str, Any] = {}
        else:
            if len(stack) != 3 or stack[2].fields is None or stack[2].key != "data":
                return False
            slot = stack[1].index
            fields = stack[2].fields
            name = fields.get("name")
            spec = input_spec(self.manifest, name, f"inputs[{slot}].name") if "name" in fields else None
            if len(self.decoded) >= len(self.manifest.inputs):
                raise InvalidArgument(f"more inputs than function '{self.manifest.name}' takes")
        decoded = Decoded(spec)
        self.decoded[slot] = decoded
        self._data = self._start(decoded, fields)
        return True

    def _start(self, decoded: Decoded, fields: dict[str, Any]) -> NumbersDecoder | StringsDecoder:
        spec = decoded.spec
        manifest = self.manifest
        count: int | None = None
        if spec is not None and "datatype" in fields:
            check_datatype(spec, fields["datatype"])
        if spec is not None and "shape" in fields:
            shape = check_shape(spec, fields["shape"], manifest)
            count = math.prod(shape)
            if count > self._max_elements:
                raise InvalidArgument(
                    f"input '{spec.name}': shape {list(shape)[:16]} needs {count} elements, more than "
                    f"the body can hold ({self._max_elements})"
                )
        limit = count if count is not None else _most(manifest, spec, self._max_elements)
        rank = len(spec.shape) if spec is not None else max(len(s.shape) for s in manifest.inputs)
        if spec is not None and spec.datatype == "BYTES":
            return StringsDecoder(decoded, limit, rank, self._reserve)
        dtype = DATATYPES[spec.datatype] if spec is not None else None
        return NumbersDecoder(decoded, limit, rank, dtype, count is not None, self._reserve)

    def _end_data(self) -> None:
        """The data ended: it reads as null in the fields, and the tokenizer goes on after it."""
        self._data = None
        self._append(b"null")
        self._value_done(self._stack[-1], len(self._fields) - 4)


def _string(token: bytes) -> str:
    try:
        value = orjson.loads(token)
    except orjson.JSONDecodeError:
        raise InvalidArgument("the body is not valid JSON: a key is not a valid string") from None
    return str(value)


def _most(manifest: FunctionManifest, spec: TensorSpec | None, fallback: int) -> int:
    """The most elements the function accepts for an input (any input, for None)."""
    specs = [spec] if spec is not None else list(manifest.inputs)
    most = 0
    for item in specs:
        dims = list(item.shape)
        if manifest.batched and dims:
            dims[0] = manifest.batching.max_batch_size
        if any(dim < 0 for dim in dims):
            return fallback
        most = max(most, math.prod(dims))
    return most
