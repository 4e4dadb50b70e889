"""Run one batch: concatenate the invocations' rows, call the backend, give each its own rows back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fngate.errors import FunctionError, ModelFailed
from fngate.manifest import FunctionManifest
from fngate.tensors import DATATYPES
from fngate.wire import Invocation, Reply, Tensors
from runner.backends import Backend


def shape_key(invocation: Invocation) -> tuple[tuple[int, ...], ...]:
    """Invocations batch together only when everything but their first dimension matches."""
    return tuple(array.shape[1:] for array in invocation.inputs.values())


def execute(
    backend: Backend, manifest: FunctionManifest, batch: Sequence[Invocation], batch_id: str
) -> list[Reply]:
    """Blocking: run it in a worker thread. Never raises; a failure becomes each member's reply."""
    rows = [invocation.rows if manifest.batched else 1 for invocation in batch]
    total = sum(rows)
    try:
        outputs = _run(backend, manifest, batch, total)
    except FunctionError as exc:
        return [_failed(invocation, exc, batch_id, total) for invocation in batch]
    except Exception as exc:
        error = ModelFailed(f"function '{manifest.name}' failed: {type(exc).__name__}: {exc}")
        return [_failed(invocation, error, batch_id, total) for invocation in batch]
    replies = []
    offset = 0
    for invocation, count in zip(batch, rows, strict=True):
        wanted = invocation.outputs or outputs.keys()
        own = {
            name: outputs[name][offset : offset + count] if manifest.batched else outputs[name]
            for name in wanted
        }
        offset += count
        replies.append(Reply(invocation.id, invocation.version, own, None, batch_id, total))
    return replies


def _run(backend: Backend, manifest: FunctionManifest, batch: Sequence[Invocation], total: int) -> Tensors:
    if len(batch) == 1:
        inputs = batch[0].inputs
    else:
        inputs = {
            spec.name: np.concatenate([invocation.inputs[spec.name] for invocation in batch])
            for spec in manifest.inputs
        }
    names = [spec.name for spec in manifest.outputs]
    results = backend.run(inputs, names)
    checked: Tensors = {}
    for spec in manifest.outputs:
        array: Any = results.get(spec.name)
        if not isinstance(array, np.ndarray):
            raise ModelFailed(f"function '{manifest.name}' returned no array for output '{spec.name}'")
        if manifest.batched and (array.ndim == 0 or array.shape[0] != total):
            raise ModelFailed(
                f"function '{manifest.name}': output '{spec.name}' has shape {list(array.shape)}, "
                f"expected {total} rows"
            )
        expected = DATATYPES[spec.datatype]
        if spec.datatype != "BYTES" and array.dtype != expected:
            if not np.can_cast(array.dtype, expected, casting="same_kind"):
                raise ModelFailed(
                    f"function '{manifest.name}': output '{spec.name}' is {array.dtype}, not {spec.datatype}"
                )
            array = array.astype(expected)
        checked[spec.name] = array
    return checked


def _failed(invocation: Invocation, error: FunctionError, batch_id: str, total: int) -> Reply:
    return Reply(invocation.id, invocation.version, {}, error, batch_id, total)
