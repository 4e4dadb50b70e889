"""What a request's tensors must be to reach a runner, whatever the protocol that carried them:
names, datatypes, ranks, dimensions, batch rows and outputs, checked against the manifest. Front
ends turn their bodies into tensors with these checks; nothing that fails them is queued."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from fngate.errors import FunctionError, InvalidArgument
from fngate.manifest import FunctionManifest, TensorSpec
from fngate.tensors import Tensors

log = logging.getLogger(__name__)
T = TypeVar("T")
OFF_LOOP_BYTES = 256 * 1024
"""Bodies this large or larger are parsed in a worker thread."""
MAX_NAME_CHARS = 128
"""Names a caller sent are cut to this length in error messages."""


async def parse(parser: Callable[..., T], body: Any, size: int, *args: Any) -> T:
    """`parse_now(parser, body, *args)`: on the event loop for small bodies (`size` bytes), in a
    worker thread for large ones, so that the event loop serves other clients meanwhile (as far as
    the GIL lets it)."""
    if size < OFF_LOOP_BYTES:
        return parse_now(parser, body, *args)
    return await asyncio.to_thread(parse_now, parser, body, *args)


def parse_now(parser: Callable[..., T], *args: Any) -> T:
    """`parser(*args)` (a body and what it is parsed against). A failure nobody foresaw while
    parsing is still the body's fault: InvalidArgument (logged as a warning with its traceback),
    never an internal error."""
    try:
        return parser(*args)
    except FunctionError:
        raise
    except Exception as exc:  # RecursionError, MemoryError, numpy's ValueError...
        log.warning("a body failed to parse unexpectedly", exc_info=True)
        raise InvalidArgument(f"the body could not be parsed ({type(exc).__name__})") from exc


def natural(value: Any, what: str) -> int:
    """`value` if it is a non-negative integer (of 63 bits at most), else `what` refused as none."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise InvalidArgument(f"{what} must be a non-negative integer")
    return value


def shown(name: object) -> str:
    """A name a caller sent, as error messages quote it: cut to MAX_NAME_CHARS."""
    text = name if isinstance(name, str) else repr(name)
    return text if len(text) <= MAX_NAME_CHARS else f"{text[:MAX_NAME_CHARS]}..."


def input_spec(manifest: FunctionManifest, name: Any, where: str) -> TensorSpec:
    if not isinstance(name, str):
        raise InvalidArgument(f"{where}: an input name must be a string")
    spec = manifest.input(name)
    if spec is None:
        known = [spec.name for spec in manifest.inputs]
        raise InvalidArgument(f"unknown input '{shown(name)}': function '{manifest.name}' takes {known}")
    return spec


def output_spec(manifest: FunctionManifest, name: Any) -> TensorSpec:
    spec = manifest.output(name) if isinstance(name, str) else None
    if spec is None:
        known = [spec.name for spec in manifest.outputs]
        raise InvalidArgument(f"unknown output '{shown(name)}': function '{manifest.name}' has {known}")
    return spec


def check_datatype(spec: TensorSpec, datatype: Any) -> str:
    if datatype != spec.datatype:
        raise InvalidArgument(
            f"input '{spec.name}': datatype {shown(datatype)!r} but the function takes {spec.datatype}"
        )
    return spec.datatype


def check_shape(spec: TensorSpec, shape: Any, manifest: FunctionManifest) -> tuple[int, ...]:
    where = f"input '{spec.name}'"
    if not isinstance(shape, list | tuple) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) for dim in shape
    ):
        raise InvalidArgument(f"{where}: 'shape' must be a list of integers")
    if len(shape) != len(spec.shape):
        raise InvalidArgument(
            f"{where}: shape {list(shape)[:16]} has rank {len(shape)} but the function takes "
            f"rank {len(spec.shape)} {list(spec.shape)}"
        )
    for axis, (dim, expected) in enumerate(zip(shape, spec.shape, strict=True)):
        if dim < 1:
            raise InvalidArgument(f"{where}: dimension {axis} is {dim}; dimensions must be at least 1")
        if expected not in (-1, dim):
            raise InvalidArgument(
                f"{where}: dimension {axis} is {dim} but the function takes {expected} "
                f"(shape {list(spec.shape)})"
            )
    limit = manifest.batching.max_batch_size
    if manifest.batched and shape[0] > limit:
        raise InvalidArgument(f"{where}: {shape[0]} rows is over the function's max_batch_size {limit}")
    return tuple(shape)


def check_complete(manifest: FunctionManifest, inputs: Tensors) -> None:
    missing = [spec.name for spec in manifest.inputs if spec.name not in inputs]
    if missing:
        raise InvalidArgument(f"missing inputs {missing} for function '{manifest.name}'")
    if manifest.batched:
        rows = {name: array.shape[0] for name, array in inputs.items()}
        if len(set(rows.values())) > 1:
            raise InvalidArgument(f"inputs disagree on the batch dimension: {rows}")


def check_new(inputs: Tensors, spec: TensorSpec) -> None:
    if spec.name in inputs:
        raise InvalidArgument(f"input '{spec.name}' is given twice")
