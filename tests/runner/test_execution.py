from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fngate.errors import ModelFailed
from fngate.manifest import FunctionManifest, parse_manifest
from runner.execution import check_outputs


def manifest(datatype: str = "FP32", shape: tuple[int, ...] = (-1, 4), batch: int = 8) -> FunctionManifest:
    return parse_manifest(
        {
            "name": "f",
            "model": {"backend": "python", "path": "model.py"},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "datatype": datatype, "shape": list(shape)}],
            "batching": {"max_batch_size": batch},
        },
        "f.yaml",
    )


@pytest.mark.parametrize(
    ("datatype", "array", "expected_dtype"),
    [
        ("FP32", np.zeros((3, 4), np.float32), np.float32),
        ("FP64", np.zeros((3, 4), np.float32), np.float64),  # widening: always lossless
        ("INT64", np.ones((3, 4), np.int8), np.int64),
        ("FP32", np.full((3, 4), 0.5, np.float64), np.float32),  # every value fits FP32
        ("INT32", np.full((3, 4), 7, np.int64), np.int32),
        ("UINT8", np.full((3, 4), 255, np.int64), np.uint8),
        ("FP32", np.full((3, 4), np.nan, np.float64), np.float32),
        ("BOOL", np.ones((3, 4), np.int64), np.bool_),
    ],
)
def test_lossless_datatypes_are_converted(datatype: str, array: Any, expected_dtype: Any) -> None:
    checked = check_outputs(manifest(datatype), {"y": array}, 3)
    assert checked["y"].dtype == np.dtype(expected_dtype)
    np.testing.assert_array_equal(checked["y"], array)


@pytest.mark.parametrize(
    ("spec", "array", "rows", "problem"),
    [
        (
            manifest(),
            np.full((3, 7, 3), 0.1),
            3,
            "output 'y' has shape [3, 7, 3], declared [-1, 4]: rank 3, not 2; it is float64, declared FP32",
        ),
        (manifest(), np.zeros((3, 5), np.float32), 3, "has shape [3, 5], declared [-1, 4]: dimension 1 is 5"),
        (manifest(), np.zeros((2, 4), np.float32), 3, "2 rows for a batch of 3"),
        (manifest(), np.zeros((), np.float32), 3, "rank 0, not 2"),
        (manifest(), np.full((3, 4), 0.1), 3, "it is float64, declared FP32, and its values do not convert"),
        (manifest("INT32"), np.full((3, 4), 2**40), 3, "it is int64, declared INT32"),
        (manifest("UINT8"), np.full((3, 4), -1), 3, "declared UINT8"),
        (manifest("INT32"), np.full((3, 4), 1.5, np.float32), 3, "declared INT32"),
        (manifest("BYTES"), np.zeros((3, 4), np.float32), 3, "declared BYTES"),
        (manifest(), np.array([["a"] * 4] * 3, dtype=object), 3, "declared FP32"),
        (manifest(shape=(2, 4), batch=0), np.zeros((3, 4), np.float32), None, "dimension 0 is 3, not 2"),
    ],
)
def test_wrong_outputs_fail_naming_the_output(
    spec: FunctionManifest, array: Any, rows: int | None, problem: str
) -> None:
    with pytest.raises(ModelFailed) as caught:
        check_outputs(spec, {"y": array}, rows)
    assert caught.value.message.startswith("function 'f': ")
    assert problem in caught.value.message


def test_a_missing_output_is_named() -> None:
    with pytest.raises(ModelFailed, match="returned no array for output 'y'"):
        check_outputs(manifest(), {"z": np.zeros((3, 4), np.float32)}, 3)


def test_bytes_outputs_pass() -> None:
    array = np.array([[b"a"], [b"b"]], dtype=object)
    assert check_outputs(manifest("BYTES", (-1, 1)), {"y": array}, 2)["y"] is array


def test_unbatched_outputs_keep_their_declared_shape() -> None:
    array = np.zeros((2, 4), np.float32)
    assert check_outputs(manifest(shape=(2, 4), batch=0), {"y": array}, None)["y"] is array
