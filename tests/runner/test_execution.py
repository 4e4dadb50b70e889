from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fngate.errors import ModelFailed, ModelTimeout, Unavailable
from fngate.manifest import FunctionManifest, parse_manifest
from fngate.registry import READY, ModelState
from fngate.repository import open_repository
from fngate.wire import Invocation
from runner import execution
from runner.execution import check_outputs, run_batch
from runner.models import LoadedModels
from tests.runner.slow_model import build_slow_model


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


def invocation(loops: float) -> Invocation:
    x = np.full((1, 4), loops, dtype=np.float32)
    return Invocation("i", "slow", "1", "replies", int(time.time() * 1000) + 60_000, {"x": x})


async def test_an_in_process_batch_past_its_timeout_is_answered_and_its_model_held_stuck(
    tmp_path: Path,
) -> None:
    build_slow_model(tmp_path / "slow")
    records = open_repository(str(tmp_path)).scan()
    states: list[ModelState] = []

    async def report(_function: str, _version: str, state: ModelState) -> None:
        states.append(state)

    models = LoadedModels(1, report=report)
    models.offer(records)
    function = records["slow"].versions["1"]
    key = ("slow", "1")

    async def run(loops: float) -> Any:
        model = await models.acquire(function)
        try:
            return (await run_batch(models, model, [invocation(loops)], "b"))[0]
        finally:
            await models.release(model)

    async def settled(reason: str) -> None:
        for _ in range(600):
            if states[-1].reason == reason and not models.stuck:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"never {reason!r}: {states[-1]}")

    await models.get(function)  # loaded before the loop is timed
    started = time.perf_counter()
    assert (await run(2000)).error is None
    loops = max(200_000.0, 1.5 / ((time.perf_counter() - started) / 2000))  # 1.5 s or more: over 200 ms

    stuck = await run(loops)
    assert isinstance(stuck.error, ModelTimeout)
    assert "ran past its execution timeout of 200 ms" in stuck.error.message
    assert models.stuck == [key]
    assert states[-1].reason.startswith("stuck: a batch has run for")
    with pytest.raises(Unavailable, match="past its execution timeout of 200 ms"):
        await models.get(function)
    await settled("")  # the batch returned: ready again
    assert states[-1].state == READY
    np.testing.assert_array_equal((await run(3)).outputs["y"], invocation(3).inputs["x"])

    assert isinstance((await run(loops)).error, ModelTimeout)
    assert await models.unload(key)
    assert states[-1].reason.startswith("unloading: a batch has run for")
    assert states[-1].reason.endswith("it is freed when that batch returns")
    await settled("unloaded")
    assert key not in models.loaded


async def test_quick_batches_run_inline_and_one_that_turns_slow_is_moved_off_the_event_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="runner.execution")
    build_slow_model(tmp_path / "slow", execution_timeout_ms=60_000)
    records = open_repository(str(tmp_path)).scan()
    models = LoadedModels(1)
    models.offer(records)
    function = records["slow"].versions["1"]
    model = await models.get(function)

    async def run(loops: float) -> Any:
        held = await models.acquire(function)
        try:
            return (await run_batch(models, held, [invocation(loops)], "b"))[0]
        finally:
            await models.release(held)

    started = time.perf_counter()
    assert (await run(2000)).error is None
    loops = max(200_000.0, 1.0 / ((time.perf_counter() - started) / 2000))  # a second or more
    # A streak of INLINE_AFTER quick batches earns inline runs; a busy machine may break a streak
    # (one batch over INLINE_BATCH_S starts it again), so allow a bounded number of tries.
    for _ in range(50 * execution.INLINE_AFTER):
        assert (await run(1)).error is None
        pace = execution._paces[model.backend]
        if pace.inline:
            break
    assert pace.inline  # quick batches now skip the worker thread

    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    before = ticks
    slow = await run(loops)
    during = ticks - before
    ticker.cancel()
    # Stopped on the event loop by the watchdog and run again on a thread: the answer is whole,
    # the loop went on meanwhile, and the backend's batches go to threads until quick again.
    assert slow.error is None
    np.testing.assert_array_equal(slow.outputs["y"], invocation(loops).inputs["x"])
    assert during > 5
    assert not pace.inline
    assert "stopped on the event loop" in caplog.text
    await models.unload(("slow", "1"))
