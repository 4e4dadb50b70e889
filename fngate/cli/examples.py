"""Example request bodies of a function, for the curl lines that `fngate up` and `fngate deploy`
print: zeros with one row, from the manifest alone (light: the `fngate up` process imports it)."""

from __future__ import annotations

import math
from typing import Any

import orjson

from fngate.manifest import FunctionManifest

EXAMPLE_ELEMENTS = 64
"""An input larger than this is not printed: the line would not be read."""


def example_body(manifest: FunctionManifest) -> str | None:
    """A /v1 body of zeros with one row, or None when it would be too long to print."""
    inputs: dict[str, Any] = {}
    for spec, shape, zero in _example_inputs(manifest) or ():
        value: Any = zero
        for dim in reversed(shape):
            value = [value] * dim
        inputs[spec.name] = value
    return orjson.dumps({"inputs": inputs}).decode() if inputs or not manifest.inputs else None


def example_v2_body(manifest: FunctionManifest) -> str | None:
    """The same zeros as a V2 request body, or None when too long to print."""
    tensors = [
        {"name": spec.name, "datatype": spec.datatype, "shape": shape, "data": [zero] * math.prod(shape)}
        for spec, shape, zero in _example_inputs(manifest) or ()
    ]
    return orjson.dumps({"inputs": tensors}).decode() if tensors or not manifest.inputs else None


def _example_inputs(manifest: FunctionManifest) -> list[tuple[Any, list[int], Any]] | None:
    """Each input with a one-row shape and its zero; None when one would be too long to print."""
    found = []
    for spec in manifest.inputs:
        shape = [1 if dim == -1 else dim for dim in spec.shape]
        if math.prod(shape) > EXAMPLE_ELEMENTS:
            return None
        zero: Any = {"BOOL": False, "BYTES": ""}.get(
            spec.datatype, 0.0 if spec.datatype.startswith("FP") else 0
        )
        found.append((spec, shape, zero))
    return found
