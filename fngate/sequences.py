"""Sequences of a stateful model (Triton's sequence batching): the step an invocation is in its
sequence, read from the request's parameters as every front end gets them; the refusals Triton's
clients expect; and the control inputs a runner feeds the model for a batch of steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fngate.errors import InvalidArgument
from fngate.manifest import FunctionManifest, SequenceSpec

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


def checked(manifest: FunctionManifest, step: Step | None, asynchronous: bool = False) -> Step | None:
    """The call's step where its function takes sequences (refused without one, as Triton
    refuses it); None for any other function, whose calls' sequence parameters mean nothing."""
    if manifest.sequence is None:
        return None
    model = _model_name(manifest)
    if step is None:
        raise InvalidArgument(
            f"inference request to model '{model}' must specify a non-zero or non-empty correlation ID"
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
                parts.append(np.full(shape, value, dtype=_NUMPY[datatype]))
        found[control.input] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return found


_NUMPY = {
    "BOOL": np.bool_,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP32": np.float32,
}
