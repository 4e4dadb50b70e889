"""A `TritonPythonModel` run as a Python function: `initialize(args)` with Triton's args at start,
`execute(requests)` with one request per invocation of the batch, `finalize()` at the end. Each
error response fails its own invocation only."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
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


def provide_utils() -> None:
    """Make `import triton_python_backend_utils` find fngate's module (before model.py is imported)."""
    sys.modules.setdefault(MODULE, pb_utils)


class TritonModel:
    """The sandbox's model (runner.sandbox): `infer(inputs, rows)` answers a batch whose inputs
    hold the rows of each invocation in turn; the invocations whose response was an error are
    left out of the outputs and named in `member_errors` (index -> [code, message])."""

    takes_rows = True

    def __init__(self, module: ModuleType, path: Path, directory: Path, config: Mapping[str, Any]) -> None:
        self._config = dict(config)
        self._batched = int(self._config.get("max_batch_size", 0)) > 0
        self.member_errors: dict[str, list[str]] = {}
        name = str(self._config.get("name", path.parent.parent.name))
        groups = self._config.get("instance_group") or [{}]
        self._model = module.TritonPythonModel()
        args = {
            "model_config": json.dumps(self._config),
            "model_instance_kind": "CPU",
            "model_instance_name": f"{groups[0].get('name', name)}_0_0",
            "model_instance_device_id": "0",
            "model_repository": str(directory),
            "model_version": path.parent.name,
            "model_name": name,
        }
        self.args = args
        """What `initialize` was given, as Triton gives it."""
        initialize = getattr(self._model, "initialize", None)
        if callable(initialize):
            initialize(args)

    def infer(
        self, inputs: Mapping[str, np.ndarray[Any, Any]], rows: Sequence[int] | None = None
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
        responses = self._model.execute(requests)
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

    def close(self) -> None:
        finalize = getattr(self._model, "finalize", None)
        if callable(finalize):
            finalize()
