"""Sequences of a stateful model (Triton's sequence batching): the step an invocation is in its
sequence, read from the request's parameters as every front end gets them; the refusals Triton's
clients expect; and the control inputs a runner feeds the model for a batch of steps."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fngate.errors import InvalidArgument, ModelFailed
from fngate.manifest import FunctionManifest, SequenceSpec, SequenceState
from fngate.tensors import DATATYPES

MAX_ID_CHARS = 128
"""The longest string sequence id (it names a Redis key)."""
MAX_ID = 2**64 - 1
"""Triton's sequence ids are uint64 (or strings)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """Where an invocation stands in its sequence."""

    id: int | str
    start: bool = False
    end: bool = False

    @property
    def flags(self) -> str:
        """'S' for a start, 'E' for an end, both, or neither: as ENQUEUE takes them."""
        return ("S" if self.start else "") + ("E" if self.end else "")

    def encode(self) -> list[Any]:
        return [self.id, self.start, self.end]

    @classmethod
    def decode(cls, raw: Sequence[Any]) -> Step:
        return cls(raw[0], bool(raw[1]), bool(raw[2]))


def step_of(params: Mapping[str, Any]) -> Step | None:
    """The request's `sequence_id`, `sequence_start` and `sequence_end` parameters (HTTP's JSON
    or gRPC's InferParameter values); None without an id (Triton's 0 or '' is none)."""
    sequence_id = params.get("sequence_id")
    flags = []
    for name in ("sequence_start", "sequence_end"):
        value = params.get(name, False)
        if not isinstance(value, bool):
            raise InvalidArgument(f"parameter '{name}' must be true or false")
        flags.append(value)
    if sequence_id is None or sequence_id in {0, ""}:
        return None
    if isinstance(sequence_id, bool) or not isinstance(sequence_id, int | str):
        raise InvalidArgument("parameter 'sequence_id' must be an unsigned integer or a string")
    if isinstance(sequence_id, int) and not 0 < sequence_id <= MAX_ID:
        raise InvalidArgument("parameter 'sequence_id' must be an unsigned 64-bit integer")
    if isinstance(sequence_id, str) and len(sequence_id) > MAX_ID_CHARS:
        raise InvalidArgument(f"parameter 'sequence_id' is longer than {MAX_ID_CHARS} characters")
    return Step(sequence_id, flags[0], flags[1])


def checked(
    manifest: FunctionManifest, step: Step | None, asynchronous: bool = False, rows: int = 1
) -> Step | None:
    """The call's step where its function takes sequences (refused without one, as Triton
    refuses it, and with more than one row where the model batches); None for any other function,
    whose calls' sequence parameters mean nothing."""
    if manifest.sequence is None:
        return None
    model = _model_name(manifest)
    if step is None:
        raise InvalidArgument(
            f"inference request to model '{model}' must specify a non-zero or non-empty correlation ID"
        )
    if manifest.batched and rows != 1:
        raise InvalidArgument(
            f"inference request to model '{model}' must specify batch-size 1 due to requirements of "
            "sequence batcher"
        )
    for control in manifest.sequence.controls:
        if control.kind == "corrid" and control.datatype != "STRING" and isinstance(step.id, str):
            raise InvalidArgument(
                f"inference request for sequence {step.id} to model '{model}': its correlation ID "
                f"must be an unsigned integer (control input '{control.input}' is {control.datatype})"
            )
    if asynchronous:
        raise InvalidArgument(
            f"inference request for sequence {step.id} to model '{model}': a sequence's invocations "
            "are synchronous (the next one may depend on this one's answer)"
        )
    return step


def not_started(manifest: FunctionManifest, step: Step) -> InvalidArgument:
    """The refusal of a step whose sequence is not live (never started, ended, or idle too long)."""
    model = _model_name(manifest)
    return InvalidArgument(
        f"inference request for sequence {step.id} to model '{model}' must specify the START flag on "
        "the first request of the sequence"
    )


def idle_ms(spec: SequenceSpec) -> int:
    """How long a sequence lives after a step's answer without another step, in ms."""
    return -(-spec.idle_timeout_us // 1000)


def _model_name(manifest: FunctionManifest) -> str:
    return manifest.triton.name if manifest.triton is not None else manifest.name


def controls(spec: SequenceSpec, steps: Sequence[tuple[Step, int]], batched: bool) -> dict[str, np.ndarray]:
    """The control inputs of a batch: for each (step, rows) in order, `rows` rows of each control
    (shape [rows, 1] batched, [1] not), as Triton feeds them."""
    found: dict[str, np.ndarray] = {}
    for control in spec.controls:
        datatype = control.datatype
        parts = []
        for step, rows in steps:
            if control.kind == "corrid":
                value: Any = step.id
            else:
                on = {"start": step.start, "end": step.end, "ready": True}[control.kind]
                value = control.false_true[1] if on else control.false_true[0]
            shape = (rows, 1) if batched else (1,)
            if datatype == "STRING":
                parts.append(np.full(shape, str(value).encode(), dtype=object))
            else:
                parts.append(np.full(shape, value, dtype=DATATYPES[datatype]))
        found[control.input] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return found


def states(spec: SequenceSpec, steps: Sequence[tuple[Step, bytes]], batched: bool) -> dict[str, np.ndarray]:
    """The implicit state inputs of a batch, one row per step in order (no batch dimension where
    the model does not batch): each its sequence's state as its last step left it, zeros at its
    start. Raises ModelFailed for a kept state that is not this model's (its states changed)."""
    found: dict[str, list[np.ndarray]] = {state.input: [] for state in spec.states}
    size = spec.state_bytes
    for step, kept in steps:
        if step.start or not kept:
            for state in spec.states:
                found[state.input].append(np.zeros((1, *state.dims), DATATYPES[state.datatype]))
            continue
        if len(kept) != size:
            raise ModelFailed(
                f"the state of sequence {step.id} is {len(kept)} bytes, not the {size} the model's "
                "states hold (they changed): start the sequence again"
            )
        offset = 0
        for state in spec.states:
            dtype = DATATYPES[state.datatype]
            count = math.prod(state.dims)
            array = np.frombuffer(kept, dtype, count, offset).reshape((1, *state.dims))
            found[state.input].append(array)
            offset += count * dtype.itemsize
    return {
        name: (np.concatenate(arrays) if len(arrays) > 1 else arrays[0]) if batched else arrays[0][0]
        for name, arrays in found.items()
    }


def kept_states(spec: SequenceSpec, outputs: Mapping[str, Any], count: int, batched: bool) -> list[bytes]:
    """What each of a batch's `count` steps leaves for its sequence's next: its row of each state
    output, of the declared datatype and dimensions, back to back. Raises ModelFailed for a state
    output that is missing or of another shape."""
    rows: list[list[bytes]] = [[] for _ in range(count)]
    for state in spec.states:
        array = outputs.get(state.output)
        shape = (count, *state.dims) if batched else state.dims
        if not isinstance(array, np.ndarray) or tuple(array.shape) != tuple(shape):
            given = list(array.shape) if isinstance(array, np.ndarray) else "nothing"
            raise ModelFailed(
                f"state output '{state.output}' is {given}, declared {list(state.dims)} a sequence"
            )
        converted = _state_array(state, array)
        for index in range(count):
            rows[index].append((converted[index] if batched else converted).tobytes())
    return [b"".join(parts) for parts in rows]


def _state_array(state: SequenceState, array: np.ndarray) -> np.ndarray:
    dtype = DATATYPES[state.datatype]
    if array.dtype == dtype:
        return np.ascontiguousarray(array)
    converted = array.astype(dtype)
    if not np.array_equal(converted, array):
        raise ModelFailed(f"state output '{state.output}' is {array.dtype}, declared {state.datatype}")
    return converted
