"""The Backend protocol and the backend name -> loader table.

A backend is loaded from a local folder holding the manifest and the model files. `run` is
called with whole batches (the inputs of several invocations concatenated on the first axis)
from a worker thread, never concurrently for one backend, and returns every output it computes.
A backend that runs its model in another process (python) sets `isolated = True`: it enforces the
function's execution timeout itself, and its batches run on its own `executor`
(runner.execution.run_batch). One whose `stop()` ends a running batch from another thread sets
`stoppable = True`: its quick batches run on the event loop, under a watchdog (runner.execution.Pace).
One that can tell the CPU time its batch took (in a process of its own) says it with `charge_cpu`
from the thread that runs the batch; runner.execution takes it for the batch. One whose model
streams (a decoupled Triton Python model) hands each response to the batch's `streaming()` as it
comes, and learns of the callers that left meanwhile from its `cancels`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fngate.errors import FunctionError
from fngate.manifest import FunctionManifest
from fngate.tensors import Tensors

if TYPE_CHECKING:  # the GPU modules load only with a backend that needs them
    from runner.backends.providers import Acceleration


class MemberErrors(Exception):
    """Raised by a backend that answers each invocation of a batch on its own (`takes_rows`) when
    some of them failed: the others' rows are in `outputs`, in order, each failure in `errors` by
    the invocation's index in the batch."""

    def __init__(self, outputs: Tensors, errors: dict[int, FunctionError]) -> None:
        super().__init__(f"{len(errors)} invocations of the batch failed")
        self.outputs = outputs
        self.errors = errors


_cpu = threading.local()
_parts = threading.local()

PartSink = Callable[[int, Tensors, FunctionError | None], None]
"""Where a streaming batch's responses go: (the invocation's index in the batch, outputs, error)."""


class Mailbox:
    """Items posted from any thread, taken by one that waits on `fileno()` (readable once one
    is posted) to learn of them at once. Posts after `close()` are dropped."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._lock = threading.Lock()
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def post(self, item: Any) -> None:
        with self._lock:
            if self._write < 0:
                return
            self._items.append(item)
            with contextlib.suppress(BlockingIOError):  # full: readable already
                os.write(self._write, b"\0")

    def fileno(self) -> int:
        return self._read

    def take(self) -> list[Any]:
        with self._lock:
            if self._read >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._read, 4096)
            taken, self._items = self._items, []
        return taken

    def close(self) -> None:
        with self._lock:
            for fd in (self._read, self._write):
                if fd >= 0:
                    os.close(fd)
            self._read = self._write = -1


class Streaming:
    """A streaming batch's two ways: its responses out (`send`, from the batch's thread), and its
    invocations whose callers left in (`cancel` from the runner's loop; their indices in
    `cancels`, for the batch's thread). `close()` once it ran."""

    def __init__(self, sink: PartSink) -> None:
        self._sink = sink
        self._gone: set[int] = set()
        self.cancels = Mailbox()
        self.continuing: concurrent.futures.Future[dict[int, FunctionError]] | None = None
        """Set by a backend whose batch's requests stream on once its run returned: done when they
        have all ended, with the errors of those that failed meanwhile (by index)."""

    def send(self, index: int, outputs: Tensors, error: FunctionError | None) -> None:
        """A response of invocation `index`: to its caller, unless the caller left."""
        if index not in self._gone:
            self._sink(index, outputs, error)

    def cancel(self, index: int) -> None:
        """Invocation `index`'s caller left: its responses are dropped from now on, and its model
        is told."""
        self._gone.add(index)
        self.cancels.post(index)

    def close(self) -> None:
        self.cancels.close()


def set_streaming(streaming: Streaming | None) -> None:
    """The running batch's (runner.execution sets it around the batch, on its thread)."""
    _parts.streaming = streaming


def streaming() -> Streaming | None:
    """The running batch's, on its thread; None when it streams to nobody."""
    found: Streaming | None = getattr(_parts, "streaming", None)
    return found


def charge_cpu(seconds: float) -> None:
    """The CPU time the running batch took in the backend's process, from the thread that runs it."""
    _cpu.seconds = getattr(_cpu, "seconds", 0.0) + seconds


def take_cpu() -> float | None:
    """What this thread's batch was charged since the last take; None when its backend says nothing."""
    seconds: float | None = _cpu.__dict__.pop("seconds", None)
    return seconds


class Backend(Protocol):
    def run(self, inputs: Tensors, outputs: list[str]) -> Tensors: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    """What a backend is loaded from."""

    manifest: FunctionManifest
    directory: Path
    threads: int
    accel: Acceleration | None
    model_bytes: bytes | None
    """The model file's verified bytes when in memory."""
    version: str
    instance: int = 0
    """Which of the manifest's model.instances this is (0, 1, ...): a Triton model's instance name."""


Loader = Callable[[Load], Backend]


def _onnx(load: Load) -> Backend:
    from runner.backends.onnx import OnnxBackend

    return OnnxBackend(load.manifest, load.directory, load.threads, load.accel, load.model_bytes)


def _python(load: Load) -> Backend:
    from runner.backends.python import PythonBackend

    return PythonBackend(load.manifest, load.directory, load.accel, load.version, load.instance)


def _tensorrt(load: Load) -> Backend:
    from runner.backends.tensorrt import TensorRTBackend

    return TensorRTBackend(load.manifest, load.directory, load.accel)


def _pytorch(load: Load) -> Backend:
    if load.manifest.model.own_process:  # runner.sandbox runs it (runner.backends.torchscript)
        return _python(load)
    from runner.backends.torchscript import TorchScriptBackend

    return TorchScriptBackend(load.manifest, load.directory, load.threads, load.accel)


LOADERS: dict[str, Loader] = {
    "onnxruntime": _onnx,
    "python": _python,
    "pytorch": _pytorch,
    "tensorrt": _tensorrt,
}


def load_backend(
    manifest: FunctionManifest,
    directory: Path,
    threads: int,
    accel: Acceleration | None = None,
    model_bytes: bytes | None = None,
    version: str = "",
) -> Backend:
    """Load the model of `manifest` from `directory` (its model file from `model_bytes` instead,
    when given and the backend can: those bytes were verified). Blocking: run it in a thread."""
    return _loader(manifest)(Load(manifest, directory, threads, accel, model_bytes, version))


def load_instances(load: Load) -> Backend:
    """The backend once per instance of the manifest's model.instances, one after the other
    (runner.backends.instances.Instances runs each batch on a free one); a failure closes those
    already loaded. Blocking: run it in a thread."""
    loader = _loader(load.manifest)
    first = loader(load)
    if load.manifest.model.instances == 1:
        return first
    from runner.backends.instances import Instances, close_all

    loaded = [first]
    try:
        for instance in range(1, load.manifest.model.instances):
            loaded.append(loader(dataclasses.replace(load, instance=instance)))
    except BaseException:
        close_all(loaded)
        raise
    return Instances(loaded)


def _loader(manifest: FunctionManifest) -> Loader:
    try:
        return LOADERS[manifest.model.backend]
    except KeyError:
        raise NotImplementedError(
            f"backend '{manifest.model.backend}' is not available in this runner"
        ) from None
