"""onnxruntime backend (CPU execution provider)."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from fngate.errors import InvalidArgument
from fngate.manifest import FunctionManifest
from runner.backends import Tensors


class OnnxBackend:
    def __init__(self, manifest: FunctionManifest, directory: Path, threads: int) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Spinning worker threads burn a core the gateway needs; block instead.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = ort.InferenceSession(
            str(directory / manifest.model.path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        model_inputs = {item.name for item in self._session.get_inputs()}
        model_outputs = {item.name for item in self._session.get_outputs()}
        missing = [spec.name for spec in manifest.inputs if spec.name not in model_inputs]
        missing += [spec.name for spec in manifest.outputs if spec.name not in model_outputs]
        if missing:
            raise InvalidArgument(
                f"the model has no tensors named {missing}; it has inputs {sorted(model_inputs)} "
                f"and outputs {sorted(model_outputs)}"
            )

    def run(self, inputs: Tensors, outputs: list[str]) -> Tensors:
        results = self._session.run(outputs, inputs)
        return dict(zip(outputs, results, strict=True))

    def close(self) -> None:
        del self._session
