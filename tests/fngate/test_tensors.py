from __future__ import annotations

import numpy as np
import pytest

from fngate.errors import InvalidArgument
from fngate.tensors import DATATYPES, datatype_of, from_bytes, from_json, to_bytes, to_json_data


@pytest.mark.parametrize("datatype", sorted(set(DATATYPES) - {"BYTES"}))
def test_fixed_size_round_trip(datatype: str) -> None:
    rng = np.random.default_rng(1)
    array = (rng.random((3, 4)) * 100).astype(DATATYPES[datatype])
    assert datatype_of(array) == datatype
    assert np.array_equal(from_bytes(datatype, [3, 4], to_bytes(array), "x"), array)
    assert np.array_equal(from_json(datatype, [3, 4], to_json_data(array), "x"), array)


def test_bytes_round_trip() -> None:
    array = np.array([[b"a", b""], [b"\x00\xff", "héllo".encode()]], dtype=object)
    raw = to_bytes(array)
    assert raw[:5] == b"\x01\x00\x00\x00a"
    back = from_bytes("BYTES", [2, 2], raw, "x")
    assert back.tolist() == array.tolist()
    assert from_json("BYTES", [2], ["a", "b"], "x").tolist() == [b"a", b"b"]


def test_nested_and_flat_json_are_equal() -> None:
    flat = from_json("INT32", [2, 2], [1, 2, 3, 4], "x")
    nested = from_json("INT32", [2, 2], [[1, 2], [3, 4]], "x")
    assert np.array_equal(flat, nested)


@pytest.mark.parametrize(
    ("datatype", "shape", "data", "fragment"),
    [
        ("FP32", [2, 2], [1, 2, 3], "3 elements of data but shape [2, 2] needs 4"),
        ("FP32", [2], ["a", "b"], "not a well-formed array"),
        ("INT8", [1], [1000], "not a well-formed array"),
        ("FP32", [2], [True, False], "booleans"),
        ("BYTES", [2], ["a"], "1 elements"),
        ("BYTES", [1], [1], "must be strings"),
        ("FP32", [2, 2], [[1, 2], [3]], "ragged"),
        ("BYTES", [1], [["a"]], "nested deeper than the 1 dimensions"),
        ("BYTES", [1, 1], [[[["a"]]]], "nested deeper than the 2 dimensions"),
    ],
)
def test_bad_json_data(datatype: str, shape: list[int], data: object, fragment: str) -> None:
    with pytest.raises(InvalidArgument, match="x: ") as caught:
        from_json(datatype, shape, data, "x")
    assert fragment in caught.value.message


def test_bad_binary_data() -> None:
    with pytest.raises(InvalidArgument, match="12 bytes of data but shape \\[4\\] of FP32 needs 16"):
        from_bytes("FP32", [4], b"\x00" * 12, "x")
    with pytest.raises(InvalidArgument, match="runs past the end"):
        from_bytes("BYTES", [1], b"\x05\x00\x00\x00ab", "x")
    with pytest.raises(InvalidArgument, match="left over"):
        from_bytes("BYTES", [1], b"\x01\x00\x00\x00abc", "x")
    with pytest.raises(InvalidArgument, match="ends after 1 of 2"):
        from_bytes("BYTES", [2], b"\x01\x00\x00\x00a\x00\x00\x00", "x")
    with pytest.raises(InvalidArgument, match="5 bytes of data hold at most 1"):
        from_bytes("BYTES", [2], b"\x01\x00\x00\x00a", "x")
    with pytest.raises(InvalidArgument, match="hold at most 1"):  # checked before anything is allocated
        from_bytes("BYTES", [1, 10**12], b"\x00\x00\x00\x00", "x")


def deep(depth: int, leaf: object) -> object:
    data = leaf
    for _ in range(depth):
        data = [data]
    return data


@pytest.mark.parametrize("datatype", ["BYTES", "FP32", "BOOL"])
def test_data_nested_far_deeper_than_the_shape_is_invalid_not_a_crash(datatype: str) -> None:
    leaf = True if datatype == "BOOL" else "a" if datatype == "BYTES" else 1.0
    with pytest.raises(InvalidArgument, match="x: "):
        from_json(datatype, [1, 1], deep(5000, leaf), "x")
    assert from_json("BYTES", [2, 1], [["a"], ["b"]], "x").tolist() == [[b"a"], [b"b"]]
