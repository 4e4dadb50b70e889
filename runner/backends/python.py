"""python backend: a `model.py` in the function's folder.

The contract: `model.py` defines `class Model` whose constructor takes the function's folder
(a pathlib.Path) and whose `infer(inputs: dict[str, numpy.ndarray]) -> dict[str, numpy.ndarray]`
takes a whole batch (rows of several invocations concatenated on the first axis) and returns every
output of the manifest with the same number of rows. An optional `close()` is called on unload.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from typing import Any

from fngate.errors import InvalidArgument
from fngate.manifest import FunctionManifest
from runner.backends import Tensors

_counter = itertools.count()


class PythonBackend:
    def __init__(self, manifest: FunctionManifest, directory: Path) -> None:
        path = directory / manifest.model.path
        spec = importlib.util.spec_from_file_location(
            f"fngate_function_{manifest.name}_{next(_counter)}", path
        )
        if spec is None or spec.loader is None:
            raise InvalidArgument(f"{path} is not a Python module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model_class = getattr(module, "Model", None)
        if model_class is None:
            raise InvalidArgument(f"{path} defines no class Model")
        self._model: Any = model_class(directory)

    def run(self, inputs: Tensors, outputs: list[str]) -> Tensors:
        results = self._model.infer(inputs)
        if not isinstance(results, dict):
            raise TypeError(f"Model.infer returned {type(results).__name__}, not a dict of arrays")
        return {name: results[name] for name in outputs if name in results}

    def close(self) -> None:
        close = getattr(self._model, "close", None)
        if callable(close):
            close()
