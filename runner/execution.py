"""Run one batch: concatenate the invocations' rows, call the backend, check its outputs against the
manifest, give each invocation its own rows back; and the execution timeout of backends that run in
the runner's own process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fngate.errors import FunctionError, ModelFailed, ModelTimeout
from fngate.manifest import FunctionManifest, TensorSpec
from fngate.tensors import DATATYPES
from fngate.wire import Invocation, Reply, Tensors
from runner.backends import Backend

if TYPE_CHECKING:
    from runner.models import LoadedModel, LoadedModels


def shape_key(invocation: Invocation) -> tuple[tuple[int, ...], ...]:
    """Invocations batch together only when everything but their first dimension matches."""
    return tuple(array.shape[1:] for array in invocation.inputs.values())


async def run_batch(
    models: LoadedModels, model: LoadedModel, batch: Sequence[Invocation], batch_id: str
) -> list[Reply]:
    """`execute` in a worker thread. A backend of the runner's own process cannot be stopped: past
    the function's execution timeout its invocations are answered model_timeout at once, and the
    runner keeps the model open for the thread, gives it no work and reports it stuck until the
    thread returns. (The python backend enforces the timeout itself, by stopping its process.)"""
    manifest = model.function.manifest
    loop = asyncio.get_running_loop()
    if getattr(model.backend, "isolated", False):
        executor = getattr(model.backend, "executor", None)
        return await loop.run_in_executor(executor, execute, model.backend, manifest, batch, batch_id)
    work = loop.run_in_executor(None, execute, model.backend, manifest, batch, batch_id)
    started = time.monotonic()
    done, _ = await asyncio.wait({work}, timeout=manifest.execution_timeout_s)
    if done:
        return work.result()
    await models.hold_stuck(model, work, started)
    error = ModelTimeout(
        f"function '{manifest.name}': the batch ran past its execution timeout of "
        f"{manifest.execution_timeout_s * 1000:.0f} ms; this runner gives the function no more work "
        "until it returns"
    )
    total = _total_rows(manifest, batch)
    return [_failed(invocation, error, batch_id, total) for invocation in batch]


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
    return check_outputs(manifest, backend.run(inputs, names), total if manifest.batched else None)


def check_outputs(manifest: FunctionManifest, results: Tensors, rows: int | None) -> Tensors:
    """Every output of the manifest, of its declared datatype (converted when no value changes),
    rank and dimensions, with `rows` rows (None: not batched). Raises ModelFailed naming the output
    and what is wrong with it."""
    checked: Tensors = {}
    for spec in manifest.outputs:
        array: Any = results.get(spec.name)
        if not isinstance(array, np.ndarray):
            raise ModelFailed(f"function '{manifest.name}' returned no array for output '{spec.name}'")
        problems = _shape_problems(spec, array.shape, rows)
        converted = _converted(spec, array)
        if converted is None:
            problems.append(f"it is {array.dtype}, declared {spec.datatype}, and its values do not convert")
        if problems:
            raise ModelFailed(
                f"function '{manifest.name}': output '{spec.name}' has shape {list(array.shape)}, "
                f"declared {list(spec.shape)}: {'; '.join(problems)}"
            )
        assert converted is not None
        checked[spec.name] = converted
    return checked


def _shape_problems(spec: TensorSpec, shape: tuple[int, ...], rows: int | None) -> list[str]:
    if len(shape) != len(spec.shape):
        return [f"rank {len(shape)}, not {len(spec.shape)}"]
    problems = []
    if rows is not None and shape[0] != rows:
        problems.append(f"{shape[0]} rows for a batch of {rows}")
    for axis, (dim, declared) in enumerate(zip(shape, spec.shape, strict=True)):
        if declared not in (-1, dim):
            problems.append(f"dimension {axis} is {dim}, not {declared}")
    return problems


def _converted(spec: TensorSpec, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    """The array as the declared datatype; None when that would change a value."""
    if spec.datatype == "BYTES":
        return array if array.dtype.kind in "OSU" else None
    expected = DATATYPES[spec.datatype]
    if array.dtype == expected:
        return array
    if array.dtype.kind not in "biuf":
        return None
    if np.can_cast(array.dtype, expected, casting="safe"):
        return array.astype(expected)
    with np.errstate(all="ignore"):
        converted = array.astype(expected)
        same = np.array_equal(converted, array, equal_nan=array.dtype.kind == "f")
    return converted if same else None


def _total_rows(manifest: FunctionManifest, batch: Sequence[Invocation]) -> int:
    return sum(invocation.rows for invocation in batch) if manifest.batched else len(batch)


def _failed(invocation: Invocation, error: FunctionError, batch_id: str, total: int) -> Reply:
    return Reply(invocation.id, invocation.version, {}, error, batch_id, total)
