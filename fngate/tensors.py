"""The one datatype table (Open Inference Protocol name <-> numpy dtype) and the tensor codecs.

A tensor travels as (datatype, shape, raw bytes) in the V2 binary layout: fixed-size types as
little-endian C-order buffers, BYTES as a 4-byte little-endian length before each element.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from fngate.errors import InvalidArgument

Tensors = dict[str, np.ndarray[Any, Any]]
"""Tensors by name: what every codec, backend and queue entry carries."""

DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(np.object_),
}
# onnx.TensorProto element types by number (the protocol buffer's stable enum values).
ONNX_DATATYPES: dict[int, str] = {
    1: "FP32",
    2: "UINT8",
    3: "INT8",
    4: "UINT16",
    5: "INT16",
    6: "INT32",
    7: "INT64",
    8: "BYTES",
    9: "BOOL",
    10: "FP16",
    11: "FP64",
    12: "UINT32",
    13: "UINT64",
}
_BY_KIND: dict[tuple[str, int], str] = {
    (dt.kind, dt.itemsize): name for name, dt in DATATYPES.items() if name != "BYTES"
}


def datatype_of(array: np.ndarray[Any, Any]) -> str:
    """The Open Inference Protocol datatype of an array (object and string arrays are BYTES)."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    try:
        return _BY_KIND[(array.dtype.kind, array.dtype.itemsize)]
    except KeyError:
        raise InvalidArgument(f"numpy dtype {array.dtype} has no Open Inference Protocol datatype") from None


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


def from_bytes(
    datatype: str, shape: Sequence[int], data: bytes | memoryview, where: str
) -> np.ndarray[Any, Any]:
    """Decode a raw buffer; `where` names the tensor in error messages. No copy for fixed-size types."""
    count = element_count(shape)
    if datatype == "BYTES":
        return _unpack_bytes(data, count, shape, where)
    dtype = DATATYPES[datatype]
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise InvalidArgument(
            f"{where}: {len(data)} bytes of data but shape {list(shape)} of {datatype} needs {expected}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def to_bytes(array: np.ndarray[Any, Any]) -> bytes:
    if array.dtype.kind in "OSU":
        return _pack_bytes(array)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def encoded_bytes(array: np.ndarray[Any, Any]) -> int:
    """How many bytes `to_bytes` makes of `array`, without making them."""
    if array.dtype.kind not in "OSU":
        return int(array.nbytes)
    return sum(4 + len(item if isinstance(item, bytes) else str(item).encode()) for item in array.ravel())


def from_json(datatype: str, shape: Sequence[int], data: Any, where: str) -> np.ndarray[Any, Any]:
    """Decode the `data` of a JSON tensor (flat or nested, row-major) and check it against `shape`."""
    count = element_count(shape)
    if datatype == "BYTES":
        flat = _flatten(data, len(shape), where)
        if len(flat) != count:
            raise InvalidArgument(
                f"{where}: {len(flat)} elements of data but shape {list(shape)} needs {count}"
            )
        if not all(isinstance(item, str | bytes) for item in flat):
            raise InvalidArgument(f"{where}: BYTES data must be strings")
        items = [item.encode() if isinstance(item, str) else item for item in flat]
        out = np.empty(count, dtype=np.object_)
        out[:] = items
        return out.reshape(shape)
    try:
        array = np.asarray(data, dtype=DATATYPES[datatype])
    except (ValueError, TypeError, OverflowError) as exc:
        if "inhomogeneous" in str(exc):
            raise InvalidArgument(
                f"{where}: nested lists of different lengths (ragged) are not a tensor"
            ) from None
        raise InvalidArgument(f"{where}: data is not a well-formed array of {datatype}: {exc}") from None
    if array.size != count:
        raise InvalidArgument(f"{where}: {array.size} elements of data but shape {list(shape)} needs {count}")
    if datatype != "BOOL" and _has_bool(data):
        raise InvalidArgument(f"{where}: booleans in data of datatype {datatype}")
    return array.reshape(shape)


def to_json_data(array: np.ndarray[Any, Any]) -> Any:
    """A flat list for the `data` of a JSON tensor."""
    if array.dtype.kind in "OSU":
        return [
            item.decode(errors="replace") if isinstance(item, bytes) else str(item) for item in array.ravel()
        ]
    return array.ravel().tolist()


def _has_bool(data: Any) -> bool:
    while isinstance(data, list) and data:
        data = data[0]
    return isinstance(data, bool)


def _flatten(data: Any, max_depth: int, where: str) -> list[Any]:
    """The leaves of nested lists, row-major; without recursion, and no deeper than `max_depth`
    levels of lists (the rank of the shape: the data is flat or nested like the shape)."""
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) >= max_depth:
                    raise InvalidArgument(
                        f"{where}: data nested deeper than the {max_depth} dimensions of its shape"
                    )
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def _pack_bytes(array: np.ndarray[Any, Any]) -> bytes:
    parts: list[bytes] = []
    for item in array.ravel():
        raw = item if isinstance(item, bytes) else str(item).encode()
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def _unpack_bytes(
    data: bytes | memoryview, count: int, shape: Sequence[int], where: str
) -> np.ndarray[Any, Any]:
    view = memoryview(data)
    # Each element carries a 4-byte length: check the count against the bytes received before
    # allocating anything for it (a shape can claim far more elements than its data holds).
    if count * 4 > len(view):
        raise InvalidArgument(
            f"{where}: shape {list(shape)} has {count} BYTES elements but {len(view)} bytes of data "
            f"hold at most {len(view) // 4}"
        )
    out = np.empty(count, dtype=np.object_)
    offset = 0
    for i in range(count):
        if offset + 4 > len(view):
            raise InvalidArgument(f"{where}: BYTES data ends after {i} of {count} elements")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > len(view):
            raise InvalidArgument(f"{where}: BYTES element {i} runs past the end of the data")
        out[i] = bytes(view[offset : offset + length])
        offset += length
    if offset != len(view):
        raise InvalidArgument(f"{where}: {len(view) - offset} bytes left over after {count} BYTES elements")
    return out.reshape(shape)
