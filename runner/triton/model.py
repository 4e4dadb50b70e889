"""A `TritonPythonModel` run as a Python function: `initialize(args)` with Triton's args at start,
`execute(requests)` with one request per invocation of the batch, `finalize()` at the end. Each
error response fails its own invocation only. A coroutine that any of them answers (`async def
execute`) is awaited on one event loop that lives as long as the model's process."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import sys
import threading
from collections.abc import Awaitable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from fngate.errors import ErrorCode
from runner.triton import python_backend as pb_utils

MODULE = "triton_python_backend_utils"
CODES = {
    pb_utils.TritonError.INVALID_ARG: ErrorCode.INVALID_ARGUMENT,
    pb_utils.TritonError.NOT_FOUND: ErrorCode.NOT_FOUND,
    pb_utils.TritonError.UNAVAILABLE: ErrorCode.UNAVAILABLE,
}
"""Triton's error codes that say the caller's mistake or a passing state; the rest: model_failed."""
KINDS = {"KIND_CPU": "CPU", "KIND_GPU": "GPU", "KIND_MODEL": "MODEL", "KIND_AUTO": "CPU"}
"""An instance group's kind -> `args["model_instance_kind"]` (fngate.triton completes AUTO already)."""
LOOP_STOP_S = 1.0


def instance_args(config: Mapping[str, Any], name: str, index: int) -> dict[str, str]:
    """Instance `index` of the model's instances (its groups' counts in turn, as Triton creates them):
    its name (`<group name>_<index in the group>`, an unnamed group being `<model name>_<group
    index>`), its kind and its device id (0: a runner uses the GPU it was given)."""
    groups = [dict(group) for group in config.get("instance_group") or [{}]]
    counts = [max(int(group.get("count") or 1), 1) for group in groups]
    index %= sum(counts)
    for number, (group, count) in enumerate(zip(groups, counts, strict=True)):
        if index < count:
            group_name = group.get("name") or f"{name}_{number}"
            return {
                "model_instance_kind": KINDS.get(str(group.get("kind") or "KIND_CPU"), "CPU"),
                "model_instance_name": f"{group_name}_{index}",
                "model_instance_device_id": "0",
            }
        index -= count
    raise AssertionError("an index past the instances")  # pragma: no cover (index %= their sum)


def provide_utils() -> None:
    """Make `import triton_python_backend_utils` find fngate's module (before model.py is imported)."""
    sys.modules.setdefault(MODULE, pb_utils)


class TritonModel:
    """The sandbox's model (runner.sandbox): `infer(inputs, rows)` answers a batch whose inputs
    hold the rows of each invocation in turn; the invocations whose response was an error are
    left out of the outputs and named in `member_errors` (index -> [code, message])."""

    takes_rows = True

    def __init__(
        self,
        module: ModuleType,
        path: Path,
        directory: Path,
        config: Mapping[str, Any],
        instance: int = 0,
    ) -> None:
        self._config = dict(config)
        self._batched = int(self._config.get("max_batch_size", 0)) > 0
        self._decoupled = pb_utils.using_decoupled_model_transaction_policy(self._config)
        self._finals = threading.Lock()
        self._open: dict[int, set[int]] = {}
        """A decoupled model's batches (by number) and their requests whose final flag has not been
        sent yet."""
        self.open_requests: list[int] = []
        """The last batch's requests that stream on after its `execute` returned."""
        self.member_errors: dict[str, list[str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        name = str(self._config.get("name", path.parent.parent.name))
        self._model = module.TritonPythonModel()
        args = {
            "model_config": json.dumps(self._config),
            **instance_args(self._config, name, instance),
            "model_repository": str(directory),
            "model_version": path.parent.name,
            "model_name": name,
        }
        self.args = args
        """What `initialize` was given, as Triton gives it."""
        initialize = getattr(self._model, "initialize", None)
        if callable(initialize):
            self._settle(initialize(args))

    def _settle(self, answer: Any) -> Any:
        """`answer`, or what it resolves to when it is awaitable: awaited on the model's loop, a
        thread of its own started at the first coroutine (tasks a model leaves on it run on between
        batches, as on Triton's stub). Blocks until it resolves; the runner's execution timeout
        bounds it."""
        if not inspect.isawaitable(answer):
            return answer
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(
                target=self._loop.run_forever, name="triton-execute-loop", daemon=True
            )
            self._loop_thread.start()
        return asyncio.run_coroutine_threadsafe(_awaited(answer), self._loop).result()

    def infer(
        self, inputs: Mapping[str, np.ndarray[Any, Any]], rows: Sequence[int] | None = None, batch: int = 0
    ) -> dict[str, Any]:
        counts = (
            list(rows) if rows is not None else [next(iter(inputs.values())).shape[0] if self._batched else 1]
        )
        requests = []
        offset = 0
        for count in counts:
            own = {
                name: array[offset : offset + count] if self._batched else array
                for name, array in inputs.items()
            }
            offset += count
            tensors = [pb_utils.Tensor(name, array) for name, array in own.items()]
            outputs = [item["name"] for item in self._config.get("output", ())]
            requests.append(pb_utils.InferenceRequest(self._config.get("name", ""), outputs, tensors))
        if self._decoupled:
            return self._stream(requests, batch)
        responses = self._settle(self._model.execute(requests))
        if not isinstance(responses, list | tuple) or len(responses) != len(requests):
            got = len(responses) if isinstance(responses, list | tuple) else type(responses).__name__
            raise TypeError(f"execute answered {got} for {len(requests)} requests (one response each)")
        self.member_errors = {}
        parts: dict[str, list[np.ndarray[Any, Any]]] = {}
        for index, response in enumerate(responses):
            if not isinstance(response, pb_utils.InferenceResponse):
                raise TypeError(
                    f"execute's answer {index} is a {type(response).__name__}, not an InferenceResponse"
                )
            error = response.error()
            if error is not None:
                code = CODES.get(error.code(), ErrorCode.MODEL_FAILED)
                self.member_errors[str(index)] = [code.value, error.message()]
                continue
            for tensor in response.output_tensors():
                parts.setdefault(tensor.name(), []).append(tensor.as_numpy())
        if not self._batched:
            return {name: arrays[0] for name, arrays in parts.items()}
        return {name: np.concatenate(arrays) for name, arrays in parts.items()}

    def _stream(self, requests: list[pb_utils.InferenceRequest], batch: int) -> dict[str, Any]:
        """A decoupled model's batch: each request answered through its response sender, each
        response sent up to the runner as it is made, the final flag too. The batch is done here
        once `execute` returns: the requests without their final flag yet stream on
        (`open_requests`; from threads the model left running), and the next batch may come
        meanwhile, as on Triton. No outputs of its own."""
        self.member_errors = {}
        with self._finals:
            self._open[batch] = set(range(len(requests)))
        for index, request in enumerate(requests):
            sender = pb_utils.InferenceResponseSender(index, functools.partial(self._sent, batch), batch)
            request._sender = sender  # type: ignore[attr-defined]
            request._index = index  # type: ignore[attr-defined]  # is_cancelled() asks by these
            request._batch = batch  # type: ignore[attr-defined]
        answer = self._settle(self._model.execute(requests))
        if answer is not None:
            raise TypeError(
                f"a decoupled model's execute answers None (its responses go through each request's "
                f"response sender), not a {type(answer).__name__}"
            )
        with self._finals:
            self.open_requests = sorted(self._open.get(batch, ()))
            if not self.open_requests:
                self._open.pop(batch, None)
        return {}

    def _sent(self, batch: int, index: int, response: pb_utils.InferenceResponse | None, final: bool) -> None:
        channel = pb_utils._CHANNEL
        if channel is None:
            raise pb_utils.TritonModelException("a response sender works in a runner's model process only")
        outputs: dict[str, np.ndarray[Any, Any]] | None = None
        error = None
        if response is not None:
            failed = response.error()
            if failed is not None:
                error = (CODES.get(failed.code(), ErrorCode.MODEL_FAILED).value, failed.message())
            else:
                outputs = {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}
        with self._finals:
            if final:  # taken out first: a batch that returns meanwhile no longer names it open
                requests = self._open.get(batch)
                if requests is not None:
                    requests.discard(index)
                    if not requests:
                        del self._open[batch]
                        channel.forget(batch)
        channel.sent(batch, index, final, outputs, error)

    def take_metrics(self) -> list[dict[str, Any]]:
        """The custom metrics (pb_utils.MetricFamily) changed since the last batch's reply."""
        return pb_utils.take_metrics()

    def close(self) -> None:
        finalize = getattr(self._model, "finalize", None)
        if callable(finalize):
            self._settle(finalize())
        if self._loop is not None and self._loop_thread is not None:
            _stop(self._loop, self._loop_thread)


async def _awaited(answer: Awaitable[Any]) -> Any:
    return await answer


async def _cancel_the_rest() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Cancel the tasks the model left on its loop, then stop and close the loop (within a few
    seconds: the process exits next in any case)."""
    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(_cancel_the_rest(), loop).result(LOOP_STOP_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(LOOP_STOP_S)
    if not thread.is_alive():
        loop.close()
