"""Run one batch: concatenate the invocations' rows, call the backend, check its outputs against the
manifest, give each invocation its own rows back; the execution timeout of backends that run in the
runner's own process; and which batches are quick enough to run on the event loop itself."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fngate import custom_metrics, sequences
from fngate.errors import FunctionError, ModelFailed, ModelTimeout
from fngate.manifest import FunctionManifest, TensorSpec
from fngate.tensors import DATATYPES, Tensors, encoded_bytes
from fngate.wire import Invocation, Reply
from runner.backends import Backend, MemberErrors, Streaming, set_streaming, take_cpu

if TYPE_CHECKING:
    from runner.models import LoadedModel, LoadedModels

log = logging.getLogger(__name__)


def shape_key(invocation: Invocation) -> tuple[tuple[int, ...], ...]:
    """Invocations batch together only when everything but their first dimension matches."""
    return tuple(array.shape[1:] for array in invocation.inputs.values())


async def run_batch(
    models: LoadedModels,
    model: LoadedModel,
    batch: Sequence[Invocation],
    batch_id: str,
    parts: Streaming | None = None,
) -> list[Reply]:
    """`execute` in a worker thread. A backend of the runner's own process cannot be stopped: past
    the function's execution timeout its invocations are answered model_timeout at once, and the
    runner keeps the model open for the thread, gives it no work and reports it stuck until the
    thread returns. (The python backend enforces the timeout itself, by stopping its process.)
    `parts`: where a streaming model's responses go as they come, and its callers that left
    come from."""
    manifest = model.function.manifest
    loop = asyncio.get_running_loop()
    if parts is not None:
        part_sinks[batch_id] = parts
    pace = _paces.get(model.backend)
    if pace is not None and pace.inline:
        replies = _run_inline(pace, model.backend, manifest, batch, batch_id)
        if replies is not None:
            return replies
    if getattr(model.backend, "isolated", False):
        executor = getattr(model.backend, "executor", None)
        return await loop.run_in_executor(executor, execute, model.backend, manifest, batch, batch_id)
    work = loop.run_in_executor(None, _timed, model.backend, manifest, batch, batch_id)
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


INLINE_BATCH_S = 0.001
"""A batch that takes less runs on the event loop: handing it to a worker thread and back (two
wake-ups and the GIL changing hands) costs more than the batch."""
INLINE_AFTER = 8
"""Consecutive batches this quick, run on a thread, before a backend's batches run inline."""
INLINE_SLOW_S = 0.005
"""An inline batch that takes longer sends the backend's batches back to threads (a batch a little
over INLINE_BATCH_S, from a busy machine, does not)."""
INLINE_LIMIT_S = 0.1
"""An inline batch still running after this is stopped (the event loop must not starve) and runs
again on a worker thread, under the function's execution timeout."""


class Pace:
    """Whether a backend's batches are quick enough to run inline: a streak of quick batches on a
    thread earns it, one slow batch inline loses it."""

    __slots__ = ("quick",)

    def __init__(self) -> None:
        self.quick = 0

    @property
    def inline(self) -> bool:
        return self.quick >= INLINE_AFTER

    def observe(self, took_s: float) -> None:
        if self.inline:
            if took_s > INLINE_SLOW_S:
                self.quick = 0
        else:
            self.quick = self.quick + 1 if took_s < INLINE_BATCH_S else 0


_paces: weakref.WeakKeyDictionary[Backend, Pace] = weakref.WeakKeyDictionary()


def _timed(
    backend: Backend, manifest: FunctionManifest, batch: Sequence[Invocation], batch_id: str
) -> list[Reply]:
    """`execute` on a worker thread, timed for a backend that can run inline (Pace)."""
    if not getattr(backend, "stoppable", False):
        return execute(backend, manifest, batch, batch_id)
    started = time.perf_counter()
    replies = execute(backend, manifest, batch, batch_id)
    pace = _paces.get(backend)
    if pace is None:
        pace = _paces.setdefault(backend, Pace())
    pace.observe(time.perf_counter() - started)
    return replies


def _run_inline(
    pace: Pace, backend: Backend, manifest: FunctionManifest, batch: Sequence[Invocation], batch_id: str
) -> list[Reply] | None:
    """The batch run on the event loop, under the watchdog; None when it had to be stopped (it
    runs again on a thread, and the backend's batches go back to threads until quick again)."""
    started = time.perf_counter()
    with _WATCHDOG.watching(backend) as watch:
        replies = execute(backend, manifest, batch, batch_id)
    pace.observe(time.perf_counter() - started)
    if not watch.stopped:
        return replies
    log.info(
        "%s: a batch stopped on the event loop after %.0f ms; it runs again on a worker thread",
        manifest.name,
        INLINE_LIMIT_S * 1000,
    )
    return None


class _Watch:
    __slots__ = ("backend", "deadline", "stopped")

    def __init__(self, backend: Backend, deadline: float) -> None:
        self.backend = backend
        self.deadline = deadline
        self.stopped = False

    def __enter__(self) -> _Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        with _WATCHDOG.lock:
            _WATCHDOG.current = None


class _Watchdog:
    """One thread that stops an inline batch running past INLINE_LIMIT_S (the backend's `stop`).
    It polls while inline batches run and sleeps on an event after a quiet second, so a batch pays
    no thread wake-up to be watched. The lock makes a stop reach only the batch it was meant for:
    the next batch of that backend cannot begin before the watchdog is done with this one."""

    POLL_S = 0.05

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: _Watch | None = None
        self._busy = threading.Event()
        self._last = 0.0
        self._thread: threading.Thread | None = None

    def watching(self, backend: Backend) -> _Watch:
        now = time.monotonic()
        watch = _Watch(backend, now + INLINE_LIMIT_S)
        with self.lock:
            self.current = watch
        self._last = now
        if not self._busy.is_set():
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="inline watchdog", daemon=True)
                self._thread.start()
            self._busy.set()
        return watch

    def _watch(self) -> None:
        while True:
            self._busy.wait()
            time.sleep(self.POLL_S)
            now = time.monotonic()
            with self.lock:
                watch = self.current
                if watch is not None and now > watch.deadline and not watch.stopped:
                    watch.stopped = True
                    watch.backend.stop()  # type: ignore[attr-defined]
            if watch is None and now - self._last > 1.0:
                self._busy.clear()


_WATCHDOG = _Watchdog()


part_sinks: dict[str, Streaming] = {}
"""batch id -> where its responses go as they come (a streaming model's batch), until it runs."""
_batch_cpu: dict[str, float] = {}
"""batch id -> the CPU seconds its backend measured, until the consumer takes it (batch_cpu_s)."""


def left_by(backend: Backend, batch_id: str) -> tuple[list[custom_metrics.Update], float | None]:
    """What the batch left besides its replies: the custom metrics its model reported, and the CPU
    time it took where its backend measures it (a process of its own: python); None where it does
    not (a backend in the runner's process, whose compute threads the runner's batches share)."""
    take = getattr(backend, "take_metric_updates", None)
    return (take() if take is not None else []), _batch_cpu.pop(batch_id, None)


def execute(
    backend: Backend, manifest: FunctionManifest, batch: Sequence[Invocation], batch_id: str
) -> list[Reply]:
    """Blocking: run it in a worker thread. Never raises; a failure becomes each member's reply."""
    take_cpu()  # what an earlier batch on this thread left, if it ended before saying it
    set_streaming(part_sinks.pop(batch_id, None))
    try:
        return _execute(backend, manifest, batch, batch_id)
    finally:
        set_streaming(None)
        seconds = take_cpu()
        if seconds is not None:
            _batch_cpu[batch_id] = seconds


def _execute(
    backend: Backend, manifest: FunctionManifest, batch: Sequence[Invocation], batch_id: str
) -> list[Reply]:
    rows = [invocation.rows if manifest.batched else 1 for invocation in batch]
    total = sum(rows)
    failed: dict[int, FunctionError] = {}
    try:
        try:
            results = _run(backend, manifest, batch, rows)
        except MemberErrors as exc:  # some members failed alone (a Triton model's error responses)
            results, failed = exc.outputs, exc.errors
            if len(failed) == len(batch):
                return [_failed(item, failed[index], batch_id, total) for index, item in enumerate(batch)]
        if manifest.model.decoupled:  # its responses went to their callers as they came
            return [
                _failed(item, failed[index], batch_id, total)
                if index in failed
                else Reply(item.id, item.version, {}, None, batch_id, total)
                for index, item in enumerate(batch)
            ]
        served = sum(count for index, count in enumerate(rows) if index not in failed)
        kept = _kept_states(manifest, results, len(batch) - len(failed))
        given = reshaped(manifest.outputs, results, manifest.batched)
        outputs = check_outputs(manifest, given, served if manifest.batched else None)
    except FunctionError as exc:
        return [_failed(invocation, exc, batch_id, total) for invocation in batch]
    except Exception as exc:
        error = ModelFailed(f"function '{manifest.name}' failed: {type(exc).__name__}: {exc}")
        return [_failed(invocation, error, batch_id, total) for invocation in batch]
    replies = []
    offset = 0
    for index, (invocation, count) in enumerate(zip(batch, rows, strict=True)):
        if index in failed:
            replies.append(_failed(invocation, failed[index], batch_id, total))
            continue
        wanted = invocation.outputs or outputs.keys()
        own = {
            name: outputs[name][offset : offset + count] if manifest.batched else outputs[name]
            for name in wanted
        }
        offset += count
        too_large = _too_large(manifest, own)
        if too_large is not None:
            if kept is not None:
                next(kept)  # its state stays as it was
            replies.append(_failed(invocation, too_large, batch_id, total))
            continue
        state = next(kept) if kept is not None else b""
        replies.append(Reply(invocation.id, invocation.version, own, None, batch_id, total, state=state))
    return replies


def _kept_states(manifest: FunctionManifest, results: Tensors, served: int) -> Iterator[bytes] | None:
    """What each served step of a stateful model's batch leaves for its sequence (in order); None
    for a model without implicit state."""
    if manifest.sequence is None or not manifest.sequence.states:
        return None
    return iter(sequences.kept_states(manifest.sequence, results, served, manifest.batched))


def _too_large(manifest: FunctionManifest, outputs: Tensors) -> ModelFailed | None:
    """The error of an invocation whose outputs pass the function's max_output_bytes; None when
    they do not."""
    limit = manifest.model.max_output_bytes
    size = sum(encoded_bytes(array) for array in outputs.values())
    if size <= limit:
        return None
    return ModelFailed(
        f"function '{manifest.name}': the outputs of this invocation are {size} bytes, over its "
        f"max_output_bytes of {limit}"
    )


def _run(
    backend: Backend, manifest: FunctionManifest, batch: Sequence[Invocation], rows: list[int]
) -> Tensors:
    """The backend's outputs for the batch, as it gave them; raises MemberErrors when some of the
    invocations failed alone."""
    if len(batch) == 1:
        inputs = batch[0].inputs
    else:
        inputs = {
            spec.name: np.concatenate([invocation.inputs[spec.name] for invocation in batch])
            for spec in manifest.inputs
        }
    inputs = reshaped(manifest.inputs, inputs, manifest.batched, to_model=True)
    names = [spec.name for spec in manifest.outputs]
    if manifest.sequence is not None:
        inputs = {**inputs, **_controls(manifest, batch)}
        if manifest.sequence.states:
            steps = [(invocation.sequence, invocation.state) for invocation in batch]
            inputs.update(sequences.states(manifest.sequence, steps, manifest.batched))  # type: ignore[arg-type]
            names += [state.output for state in manifest.sequence.states]
    if getattr(backend, "takes_rows", False):  # it answers each invocation on its own (python)
        return backend.run(inputs, names, rows)  # type: ignore[call-arg]
    return backend.run(inputs, names)


def _controls(manifest: FunctionManifest, batch: Sequence[Invocation]) -> Tensors:
    """The control inputs of a sequence model's batch, as Triton feeds them (fngate.sequences)."""
    assert manifest.sequence is not None
    steps = []
    for invocation in batch:
        if invocation.sequence is None:  # a gateway refuses it; a pipeline's step may not be a sequence
            raise ModelFailed(
                f"function '{manifest.name}' takes sequences: an invocation came without its step"
            )
        steps.append((invocation.sequence, invocation.rows))
    return sequences.controls(manifest.sequence, steps, manifest.batched)


def reshaped(specs: Sequence[TensorSpec], tensors: Tensors, batched: bool, to_model: bool = False) -> Tensors:
    """Tensors whose spec has a `reshape` (Triton's), to the shape the model takes (`to_model`) or
    from the shape it gives to the declared one; the batch dimension stays as it is."""
    if not any(spec.reshape is not None for spec in specs):
        return tensors
    out = dict(tensors)
    for spec in specs:
        array = tensors.get(spec.name)
        if spec.reshape is None or not isinstance(array, np.ndarray):
            continue
        target = spec.reshape if to_model else (spec.shape[1:] if batched else spec.shape)
        try:
            out[spec.name] = array.reshape((array.shape[0], *target) if batched else target)
        except ValueError as exc:
            raise ModelFailed(f"tensor '{spec.name}' of shape {list(array.shape)}: {exc}") from None
    return out


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


def failed_together(replies: Sequence[Reply]) -> FunctionError | None:
    """The one error all replies of a batch of several share when its backend failed it as a
    whole (its process died, hung or ran out of memory, it raised, its outputs were wrong): which
    invocation caused it is unknown. None when the batch is of one, or its replies differ."""
    if len(replies) < 2:
        return None
    error = replies[0].error
    if error is None or any(reply.error is not error for reply in replies):
        return None
    return error


def _total_rows(manifest: FunctionManifest, batch: Sequence[Invocation]) -> int:
    return sum(invocation.rows for invocation in batch) if manifest.batched else len(batch)


def _failed(invocation: Invocation, error: FunctionError, batch_id: str, total: int) -> Reply:
    return Reply(invocation.id, invocation.version, {}, error, batch_id, total)
