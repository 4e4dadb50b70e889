"""Triton's sequence batching: the quickstart's simple_sequence model (its configuration and graph
as Triton's repository has them) answers the quickstart's sequence clients' calls as Triton does,
over HTTP, gRPC and a gRPC stream; the control inputs are fed as declared; a step without an id,
or of a sequence not started, ended or idle too long, is refused with Triton's words."""

from __future__ import annotations

import asyncio
import queue
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton

from tests.conftest import free_port, on_cluster_too
from tests.triton_repository import (
    ACCUMULATOR,
    RUNNING_TOTAL,
    RUNNING_TOTAL_CONFIG,
    SEQUENCE_CONTROLS,
    SIMPLE_SEQUENCE,
    accumulator_onnx,
    model,
    sequence_onnx,
)

VALUES = [11, 7, 5, 3, 2, 0, 1]
"""The quickstart clients' values."""


def expected(first: int, values: list[int]) -> list[int]:
    """What simple_sequence answers a sequence of [first, *values]: the first plus one (START), then
    each value as it is."""
    return [first + 1, *values]


def call_sequence(
    client: triton.InferenceServerClient | triton_grpc.InferenceServerClient,
    sequence_id: int | str,
    values: list[int],
) -> list[int]:
    """A sequence's steps one by one, each after the last one's answer, over either protocol."""
    module: Any = triton if isinstance(client, triton.InferenceServerClient) else triton_grpc
    answers = []
    for index, value in enumerate(values):
        tensor = module.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.full((1, 1), value, dtype=np.int32))
        result = client.infer(
            "simple_sequence",
            [tensor],
            outputs=[module.InferRequestedOutput("OUTPUT")],
            sequence_id=sequence_id,
            sequence_start=index == 0,
            sequence_end=index == len(values) - 1,
        )
        answers.append(int(result.as_numpy("OUTPUT")[0][0]))
    return answers


def grpc_stream(
    client: triton_grpc.InferenceServerClient,
    sequences: dict[int, list[int]],
    interleaved: bool,
    model: str = "simple_sequence",
    tensor_of: Callable[[int], triton_grpc.InferInput] | None = None,
    read: Callable[[np.ndarray], Any] = lambda output: int(output[0][0]),
    timeout_s: float = 30,
) -> dict[int, list[Any]]:
    """The steps of several sequences sent on one stream without waiting: each sequence's steps one
    after the other, as the quickstart's stream client sends them, or interleaved; each sequence's
    answers (`read` from its OUTPUT) in its order. `tensor_of(value)`: a step's INPUT (the quickstart
    model's by default)."""
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    sent = 0
    longest = max(len(values) for values in sequences.values())
    order = [(index, sequence_id) for index in range(longest) for sequence_id in sequences]
    if not interleaved:
        order.sort(key=lambda step: list(sequences).index(step[1]))
    try:
        for index, sequence_id in order:
            values = sequences[sequence_id]
            if index < len(values):
                client.async_stream_infer(
                    model,
                    [(tensor_of or _int32_step)(values[index])],
                    request_id=f"{sequence_id}_{index}",
                    sequence_id=sequence_id,
                    sequence_start=index == 0,
                    sequence_end=index == len(values) - 1,
                )
                sent += 1
        found: dict[int, dict[int, Any]] = {sequence_id: {} for sequence_id in sequences}
        for _ in range(sent):
            result, error = answers.get(timeout=timeout_s)
            assert error is None, str(error)
            sequence_id, index = (int(part) for part in result.get_response().id.split("_"))
            found[sequence_id][index] = read(result.as_numpy("OUTPUT"))
    finally:
        client.stop_stream()
    return {sequence_id: [steps[i] for i in sorted(steps)] for sequence_id, steps in found.items()}


def _int32_step(value: int) -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.full((1, 1), value, dtype=np.int32))
    return tensor


def exercise_quickstart(url: str, grpc_url: str) -> None:
    """The calls of the quickstart's simple_http_sequence_sync_infer_client,
    simple_grpc_sequence_sync_infer_client and simple_grpc_sequence_stream_infer_client, and their
    checks."""
    http = triton.InferenceServerClient(url.removeprefix("http://"))
    rpc = triton_grpc.InferenceServerClient(grpc_url)
    negatives = [-value for value in VALUES]
    runs: list[Callable[[int | str, list[int]], list[int]]] = [
        lambda sequence_id, values: call_sequence(http, sequence_id, values),
        lambda sequence_id, values: call_sequence(rpc, sequence_id, values),
    ]
    try:
        for run in runs:
            assert run(1000, [0, *VALUES]) == expected(0, VALUES)
            assert run(1001, [100, *negatives]) == expected(100, negatives)
            # A string sequence id (the clients' uuid4): simple_sequence has no CORRID control.
            assert run(str(uuid.uuid4()), [20, *negatives]) == expected(20, negatives)
        for interleaved in (False, True):
            streamed = grpc_stream(rpc, {1000: [0, *VALUES], 1001: [100, *negatives]}, interleaved)
            assert streamed == {1000: expected(0, VALUES), 1001: expected(100, negatives)}
    finally:
        http.close()
        rpc.close()


@pytest.fixture
async def sequence_models(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path
) -> tuple[str, str]:
    """The two sequence models served: (HTTP base URL, gRPC address)."""
    root = tmp_path / "models"
    sequence_onnx(model(root, "simple_sequence", SIMPLE_SEQUENCE, {"1": {}}) / "1" / "model.onnx")
    sequence_onnx(model(root, "sequence_controls", SEQUENCE_CONTROLS, {"1": {}}) / "1" / "model.onnx", True)
    model(root, "running_total", RUNNING_TOTAL_CONFIG, {"1": {"model.py": RUNNING_TOTAL}})
    # At most two sequences live, each idle for up to a minute (none idles out during the test).
    capped = SIMPLE_SEQUENCE.replace('"simple_sequence"', '"capped_sequence"').replace(
        "sequence_batching {", "sequence_batching {\n  max_sequence_idle_microseconds: 60000000"
    )
    capped += 'parameters { key: "fngate_max_live_sequences" value: { string_value: "2" } }\n'
    sequence_onnx(model(root, "capped_sequence", capped, {"1": {}}) / "1" / "model.onnx")
    grpc_port = free_port()
    base = await serve_gateway(repo=str(root), grpc_port=grpc_port)
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    return base, f"127.0.0.1:{grpc_port}"


async def test_the_quickstart_sequence_clients_get_tritons_answers(sequence_models: tuple[str, str]) -> None:
    await asyncio.to_thread(exercise_quickstart, *sequence_models)


def step(
    sequence_id: int | str | None = None, start: bool = False, end: bool = False, value: int = 1
) -> dict[str, Any]:
    parameters: dict[str, Any] = {}
    if sequence_id is not None:
        parameters["sequence_id"] = sequence_id
    if start:
        parameters["sequence_start"] = True
    if end:
        parameters["sequence_end"] = True
    return {
        "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [value]}],
        "parameters": parameters,
    }


@on_cluster_too
async def test_steps_outside_a_live_sequence_are_refused_with_tritons_words(
    sequence_models: tuple[str, str],
) -> None:
    base, _ = sequence_models
    url = "/v2/models/simple_sequence/infer"
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for body in (step(), step(0), step("")):
            refused = await client.post(url, json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"] == (
                "inference request to model 'simple_sequence' must specify a non-zero or non-empty "
                "correlation ID"
            )
        not_started = (
            "inference request for sequence 7 to model 'simple_sequence' must specify the START flag on "
            "the first request of the sequence"
        )
        refused = await client.post(url, json=step(7))
        assert (refused.status_code, refused.json()["error"]) == (400, not_started)
        assert (await client.post(url, json=step(7, start=True, value=4))).json()["outputs"][0]["data"] == [5]
        assert (await client.post(url, json=step(7, value=4))).json()["outputs"][0]["data"] == [4]
        assert (await client.post(url, json=step(7, end=True, value=3))).json()["outputs"][0]["data"] == [3]
        refused = await client.post(url, json=step(7))  # ended: the next must start it again
        assert (refused.status_code, refused.json()["error"]) == (400, not_started)
        # A sequence's steps are answered when they are asked: never asynchronously.
        refused = await client.post(url, json=step(8, start=True), headers={"Prefer": "respond-async"})
        assert refused.status_code == 400 and "are synchronous" in refused.json()["error"], refused.text
        for bad, why in (
            ({"sequence_id": 8, "sequence_start": 1}, "'sequence_start' must be true or false"),
            ({"sequence_id": -3}, "unsigned 64-bit integer"),
            ({"sequence_id": 2.5}, "unsigned integer or a string"),
            ({"sequence_id": "x" * 129}, "longer than 128 characters"),
        ):
            body = step()
            body["parameters"] = bad
            refused = await client.post(url, json=body)
            assert refused.status_code == 400 and why in refused.json()["error"], refused.text
        # A string id where the model takes a numeric CORRID.
        refused = await client.post("/v2/models/sequence_controls/infer", json=step("abc", start=True))
        assert refused.status_code == 400 and "must be an unsigned integer" in refused.json()["error"]


@on_cluster_too
async def test_a_function_holds_at_most_max_live_sequences(sequence_models: tuple[str, str]) -> None:
    """Two live at most (the parameter fngate_max_live_sequences): a third start is refused with
    503 and Retry-After until one ends; the steps of live sequences, and a start of one already
    live, are never refused for it."""
    base, _ = sequence_models
    url = "/v2/models/capped_sequence/infer"
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for sequence_id in (1, 2):
            answered = await client.post(url, json=step(sequence_id, start=True, value=sequence_id))
            assert answered.status_code == 200, answered.text
        refused = await client.post(url, json=step(3, start=True))
        assert refused.status_code == 503, refused.text
        assert "has 2 sequences live (sequence.max_live)" in refused.json()["error"]
        assert int(refused.headers["retry-after"]) >= 1
        assert (await client.post(url, json=step(1, value=5))).status_code == 200  # a live one's step
        assert (await client.post(url, json=step(2, start=True))).status_code == 200  # restarted, not new
        assert (await client.post(url, json=step(3, start=True))).status_code == 503
        assert (await client.post(url, json=step(1, end=True))).status_code == 200
        answered = await client.post(url, json=step(3, start=True, value=4))
        assert answered.status_code == 200, answered.text
        assert answered.json()["outputs"][0]["data"] == [5]


def controls_of(answer: dict[str, Any]) -> dict[str, Any]:
    return {output["name"]: output["data"][0] for output in answer["outputs"]}


async def test_the_control_inputs_are_fed_as_declared_across_a_batch(
    sequence_models: tuple[str, str],
) -> None:
    """Steps of several sequences at once (batched together where they meet): each row gets its
    own sequence's START, END, READY and CORRID, in the declared datatypes and values."""
    base, _ = sequence_models
    url = "/v2/models/sequence_controls/infer"
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:

        async def sequence(sequence_id: int) -> list[dict[str, Any]]:
            answers = []
            for index in range(3):
                body = step(
                    sequence_id, start=index == 0, end=index == 2, value=sequence_id % 1000 * 10 + index
                )
                response = await client.post(url, json=body)
                assert response.status_code == 200, response.text
                answers.append(controls_of(response.json()))
                sizes.append(response.json()["parameters"]["batch_size"])
            return answers

        sizes: list[int] = []
        ids = [2**64 - 1, *range(1, 12)]
        results = await asyncio.gather(*(sequence(sequence_id) for sequence_id in ids))
    assert max(sizes) > 1, sizes  # steps of several sequences met in one batch
    for sequence_id, answers in zip(ids, results, strict=True):
        assert [answer["START_OUT"] for answer in answers] == [1.0, 0.0, 0.0]
        assert [answer["END_OUT"] for answer in answers] == [5, 5, 7]
        assert [answer["READY_OUT"] for answer in answers] == [True, True, True]
        assert [answer["CORRID_OUT"] for answer in answers] == [sequence_id] * 3
        assert [answer["OUTPUT"] for answer in answers] == [
            sequence_id % 1000 * 10 + index for index in range(3)
        ]


async def test_a_sequence_idle_past_its_timeout_must_start_again(sequence_models: tuple[str, str]) -> None:
    """sequence_controls' max_sequence_idle_microseconds is 1,500,000: a step 1.5 s after the
    last is refused; one sooner is served."""
    base, _ = sequence_models
    url = "/v2/models/sequence_controls/infer"
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await client.post(url, json=step(21, start=True))).status_code == 200
        assert (await client.post(url, json=step(21))).status_code == 200
        await asyncio.sleep(1.7)
        refused = await client.post(url, json=step(21))
        assert refused.status_code == 400 and "must specify the START flag" in refused.json()["error"]


async def test_a_step_that_waits_longer_than_the_idle_timeout_keeps_its_sequence(
    sequence_models: tuple[str, str],
) -> None:
    """A sequence is idle only while none of its steps is queued or running (as Triton counts it):
    running_total's idle timeout is 1 s, and a step that runs 1.5 s neither ends its sequence nor
    lets the next step be refused. The model keeps each sequence's total in its process (one
    runner, one instance here)."""
    base, _ = sequence_models
    url = "/v2/models/running_total/infer"

    def total(sequence_id: int, value: int, delay_ms: int = 0, start: bool = False, end: bool = False) -> Any:
        body = step(sequence_id, start=start, end=end)
        body["inputs"] = [
            {"name": "VALUE", "datatype": "INT32", "shape": [1, 1], "data": [value]},
            {"name": "DELAY_MS", "datatype": "INT32", "shape": [1, 1], "data": [delay_ms]},
        ]
        return client.post(url, json=body)

    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        answers = []
        for value, delay_ms, start, end in (
            (5, 0, True, False),
            (2, 1500, False, False),
            (1, 0, False, True),
        ):
            response = await total(41, value, delay_ms, start, end)
            assert response.status_code == 200, response.text
            answers.append(response.json()["outputs"][0]["data"][0])
        assert answers == [5, 7, 8]
        assert (await total(42, 3, start=True)).status_code == 200
        await asyncio.sleep(1.2)  # idle past its timeout from its last answer
        refused = await total(42, 1)
        assert refused.status_code == 400 and "must specify the START flag" in refused.json()["error"]


@pytest.fixture
async def accumulator(
    serve_gateway: Callable[..., Any], runner_process: Callable[..., Any], tmp_path: Path
) -> tuple[str, Callable[[], Any], str]:
    """The accumulator served by a runner process: (HTTP base URL, a factory of runner processes,
    gRPC address)."""
    root = tmp_path / "models"
    accumulator_onnx(model(root, "accumulator", ACCUMULATOR, {"1": {}}) / "1" / "model.onnx")
    grpc_port = free_port()
    base = await serve_gateway(repo=str(root), grpc_port=grpc_port)

    def start() -> Any:
        return runner_process(FNGATE_REPO=str(root), FNGATE_ARTIFACT_DIR=str(tmp_path / "artifacts"))

    return base, start, f"127.0.0.1:{grpc_port}"


async def test_implicit_state_follows_each_sequence_across_batches_and_runners(
    accumulator: tuple[str, Callable[[], Any], str],
) -> None:
    """The state a step leaves is the next step's state input, per sequence, with steps of many
    sequences in one batch; a restart resets it; and it lives in Redis, not in the runner: a step
    after its runner was killed finds it, on the runner that replaced it. A sequence's steps are
    one row each where the model batches (Triton's rule)."""
    base, start, _ = accumulator
    url = "/v2/models/accumulator/infer"

    def body(sequence_id: int, values: list[int], start: bool = False, end: bool = False) -> dict[str, Any]:
        parameters = {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
        tensor = {"name": "INPUT", "datatype": "INT64", "shape": [1, 2], "data": values}
        return {"inputs": [tensor], "parameters": parameters}

    first = start()
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        async def total(sequence_id: int, values: list[int], start: bool = False, end: bool = False) -> Any:
            response = await client.post(url, json=body(sequence_id, values, start, end))
            assert response.status_code == 200, response.text
            sizes.append(response.json()["parameters"]["batch_size"])
            return response.json()["outputs"][0]["data"]

        async def sequence(sequence_id: int) -> list[Any]:
            return [
                await total(sequence_id, [sequence_id, 1], start=True),
                await total(sequence_id, [sequence_id, 2]),
                await total(sequence_id, [sequence_id, 3]),
            ]

        sizes: list[int] = []
        ids = list(range(1, 9))
        found = await asyncio.gather(*(sequence(sequence_id) for sequence_id in ids))
        assert max(sizes) > 1, sizes  # steps of several sequences met in one batch
        assert found == [[[i, 1], [2 * i, 3], [3 * i, 6]] for i in ids]
        assert await total(1, [5, 5], start=True) == [5, 5]  # started again: from zeros

        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait, 30)
        start()
        assert await total(1, [1, 1]) == [6, 6]
        assert await total(2, [1, 1], end=True) == [3 * 2 + 1, 7]
        refused = await client.post(url, json=body(2, [1, 1]))  # ended
        assert refused.status_code == 400 and "START flag" in refused.json()["error"], refused.text

        two_rows = body(3, [1, 1, 2, 2], start=True)
        two_rows["inputs"][0]["shape"] = [2, 2]
        refused = await client.post(url, json=two_rows)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == (
            "inference request to model 'accumulator' must specify batch-size 1 due to requirements "
            "of sequence batcher"
        )


def stream_totals(address: str, sequences: dict[int, list[int]]) -> dict[int, list[int]]:
    """Each sequence's steps sent on one gRPC stream one after the other without waiting, as
    Triton's stream client sends them; the OUTPUT of each step, by sequence, in order."""

    def accumulated(value: int) -> triton_grpc.InferInput:
        tensor = triton_grpc.InferInput("INPUT", [1, 2], "INT64")
        tensor.set_data_from_numpy(np.array([[value, 1]], dtype=np.int64))
        return tensor

    client = triton_grpc.InferenceServerClient(address)
    try:
        return grpc_stream(
            client, sequences, False, "accumulator", accumulated, lambda output: output[0].tolist(), 60
        )
    finally:
        client.close()


async def test_steps_sent_without_waiting_run_in_order_each_on_the_last_ones_state(
    redis: aioredis.Redis, accumulator: tuple[str, Callable[[], Any], str]
) -> None:
    """A stream's steps of one sequence, sent back to back, run one after the other: each adds to
    the total the one before left (were two to run at once, or one to read the state before the
    last had written it, a total would be short). With the scripts flushed first, as on a new
    Redis: the first call of each script does not let a later step overtake its start."""
    base, start, address = accumulator  # after `redis`, which empties Redis first
    start()
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:  # the runner started, loaded
        warm = {"sequence_id": 20, "sequence_start": True, "sequence_end": True}
        tensor = {"name": "INPUT", "datatype": "INT64", "shape": [1, 2], "data": [0, 0]}
        response = await client.post(
            "/v2/models/accumulator/infer", json={"inputs": [tensor], "parameters": warm}
        )
        assert response.status_code == 200, response.text
    await redis.script_flush()
    values = {21: [1, 2, 3, 4, 5, 6], 22: [10, 20, 30]}
    totals = await asyncio.to_thread(stream_totals, address, values)
    assert totals == {
        21: [[1, 1], [3, 2], [6, 3], [10, 4], [15, 5], [21, 6]],
        22: [[10, 1], [30, 2], [60, 3]],
    }
