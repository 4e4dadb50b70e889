"""pytorch backend: a TorchScript model (`model.pt`, saved by `torch.jit.save`; Triton's
`pytorch_libtorch`), run in the runner's process on the CPU or, with `accelerator: cuda`, on the
runner's GPU. torch comes with `fngate[torch]`: a runner without it says so when the model loads.

The model's inputs are its `forward`'s arguments, in order. Each input of the manifest is given to
one of them: by Triton's naming `NAME__<index>` (the index-th argument), else by the argument's
own name, else in the manifest's order. Its outputs are what `forward` returns: one tensor, a tuple
or list of them (an output named `NAME__<index>` is the index-th, the others in the manifest's
order), or a dict of them by name. Batches are the concatenated rows, as for every backend.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from fngate.errors import InvalidArgument, ModelFailed, Unavailable
from fngate.manifest import FunctionManifest
from fngate.tensors import Tensors
from runner import gpu
from runner.backends.providers import Acceleration, refuse_fallback
from runner.metrics import ACCELERATOR_FALLBACKS

log = logging.getLogger(__name__)

INDEXED = re.compile(r"^.+__(\d+)$")
"""Triton's naming of a TorchScript model's tensors: the position after the last `__`."""
MAX_ERROR_CHARS = 400


class TorchScriptBackend:
    def __init__(
        self,
        manifest: FunctionManifest,
        directory: Path,
        threads: int,
        acceleration: Acceleration | None = None,
    ) -> None:
        torch = _torch()
        accel = acceleration or Acceleration()
        self._torch = torch
        self.fallback_reason: str | None = None
        device = "cpu"
        if manifest.model.accelerator == "cuda":
            if torch.cuda.is_available():
                device = f"cuda:{accel.device_index}"
            else:
                self.fallback_reason = (
                    "torch sees no CUDA device (a CPU build, or no GPU given to this runner)"
                )
                refuse_fallback(manifest, accel, self.fallback_reason)
        self.device = device
        if device == "cpu" and threads > 0:
            torch.set_num_threads(threads)
        before = gpu.read_memory(accel.device_index) if device != "cpu" else None
        path = directory / manifest.model.path
        try:
            self._module = torch.jit.load(str(path), map_location=device)
        except Exception as exc:  # torch's own errors: not a TorchScript file, saved by a newer torch
            raise InvalidArgument(
                f"function '{manifest.name}': {manifest.model.path} is not a TorchScript model torch "
                f"{torch.__version__} can load: {str(exc)[:MAX_ERROR_CHARS]}"
            ) from None
        self._module.eval()
        self._inputs = _argument_order(manifest, self._module)
        self._outputs = [spec.name for spec in manifest.outputs]
        self._running = threading.Lock()
        self.device_memory_bytes = 0
        if before is not None:
            after = gpu.read_memory(accel.device_index)
            if after is not None:
                self.device_memory_bytes = gpu.taken_bytes(before, after)
        if self.fallback_reason is None:
            log.info("%s runs on %s (torch %s)", manifest.name, device, torch.__version__)
        else:
            log.warning("%s runs on the CPU (asked: cuda; %s)", manifest.name, self.fallback_reason)
            ACCELERATOR_FALLBACKS.labels(manifest.name, "cuda", "cpu").inc()
        self._name = manifest.name

    def run(self, inputs: Tensors, outputs: list[str]) -> Tensors:
        torch = self._torch
        with self._running, torch.inference_mode():
            # torch takes arrays it may write to: the wire's read-only ones are copied, others not.
            arguments = [
                torch.from_numpy(np.require(inputs[name], requirements=["C", "W"])) for name in self._inputs
            ]
            if self.device != "cpu":
                arguments = [tensor.to(self.device, non_blocking=True) for tensor in arguments]
            try:
                answer = self._module(*arguments)
            except Exception as exc:
                raise ModelFailed(f"function '{self._name}' failed: {str(exc)[:MAX_ERROR_CHARS]}") from None
            named = self._named(answer)
            return {name: named[name].detach().cpu().numpy() for name in outputs}

    def _named(self, answer: Any) -> dict[str, Any]:
        torch = self._torch
        if isinstance(answer, dict):
            return {str(key): value for key, value in answer.items()}
        values = [answer] if isinstance(answer, torch.Tensor) else list(answer)
        if len(values) != len(self._outputs):
            raise ModelFailed(
                f"function '{self._name}': its model returned {len(values)} tensors for "
                f"{len(self._outputs)} outputs ({', '.join(self._outputs)})"
            )
        return dict(zip(_positions(self._outputs), values, strict=True))

    def close(self) -> None:
        self._module = None
        if self.device != "cpu":
            self._torch.cuda.empty_cache()


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise Unavailable(
            "the pytorch backend needs torch in the runner's environment: install fngate[torch] "
            "(a runner image of its own)"
        ) from None
    return torch


def _positions(names: list[str]) -> list[str]:
    """The names in the order of the positions they stand for: `NAME__<index>` at its index, the
    others in the order given, in the places left."""
    placed: dict[int, str] = {}
    rest = []
    for name in names:
        match = INDEXED.match(name)
        if match is not None and int(match.group(1)) < len(names) and int(match.group(1)) not in placed:
            placed[int(match.group(1))] = name
        else:
            rest.append(name)
    order = []
    for position in range(len(names)):
        order.append(placed[position] if position in placed else rest.pop(0))
    return order


def _argument_order(manifest: FunctionManifest, module: Any) -> list[str]:
    """The manifest's inputs in the order of forward's arguments."""
    names = [spec.name for spec in manifest.inputs]
    try:
        arguments = [argument.name for argument in module.forward.schema.arguments][1:]  # after self
    except (AttributeError, RuntimeError):
        arguments = []
    if arguments and len(arguments) != len(names):
        raise InvalidArgument(
            f"function '{manifest.name}': its model's forward takes {len(arguments)} tensors "
            f"({', '.join(arguments)}), its manifest names {len(names)} inputs ({', '.join(names)})"
        )
    if not all(INDEXED.match(name) for name in names) and set(names) == set(arguments):
        return arguments
    return _positions(names)


class OwnProcess:
    """A TorchScript model in a process of its own (model.own_process): what runner.sandbox serves
    there, as it serves a Python function's Model. Its runner speaks to it as to a Python function
    (runner.backends.python), confined the same way."""

    def __init__(self, manifest: dict[str, Any], directory: Path) -> None:
        self._manifest = FunctionManifest.model_validate(manifest)
        self._backend = TorchScriptBackend(self._manifest, directory, 0)
        self.device = self._backend.device
        self.fallback_reason = self._backend.fallback_reason
        self._outputs = [spec.name for spec in self._manifest.outputs]

    def infer(self, inputs: Tensors) -> Tensors:
        return self._backend.run(inputs, self._outputs)

    def close(self) -> None:
        self._backend.close()
