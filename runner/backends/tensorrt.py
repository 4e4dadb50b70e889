"""tensorrt backend: a serialized TensorRT engine (`.plan`) run by TensorRT's Python API, its device
memory and stream through cuda-python (`cuda.bindings.runtime`), both imported lazily: their one
home. Batches of any size the engine's first optimisation profile allows run without a rebuild;
inputs and outputs are bound by name, with one CUDA stream per loaded model.

An engine that TensorRT refuses (built by another TensorRT version or for another GPU, or not an
engine at all) makes the function unavailable with TensorRT's reason, never a crash.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fngate.errors import InvalidArgument, ModelFailed, Unavailable
from fngate.manifest import FunctionManifest
from fngate.tensors import DATATYPES, Tensors
from runner import gpu
from runner.backends.providers import Acceleration, batch_range, profile

log = logging.getLogger(__name__)

DEVICE = "TensorRT"
ONNX_SUFFIXES = (".onnx", ".ort")
NUMPY_TYPES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "INT8": "int8",
    "UINT8": "uint8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
}
"""TensorRT's datatypes (trt.DataType names) that numpy holds; BF16, FP8, INT4, FP4 are refused."""
KEPT_ERRORS = 64


@dataclasses.dataclass(slots=True)
class Binding:
    name: str
    dtype: np.dtype[Any]
    max_shape: tuple[int, ...]
    address: int = 0


class TensorRTBackend:
    device = DEVICE
    fallback_reason: str | None = None

    def __init__(
        self, manifest: FunctionManifest, directory: Path, acceleration: Acceleration | None = None
    ) -> None:
        accel = acceleration or Acceleration()
        path = directory / manifest.model.path
        if path.suffix in ONNX_SUFFIXES:
            raise InvalidArgument(
                f"backend tensorrt loads a serialized TensorRT engine (.plan), not {path.name}; for an "
                "ONNX model use backend: onnxruntime with accelerator: tensorrt"
            )
        trt, self._cuda = _imports()
        self._index = accel.device_index
        device = gpu.find_device(self._index)
        if isinstance(device, gpu.NoDevice):
            raise Unavailable(f"{manifest.name} needs an NVIDIA GPU: {device.reason}")
        self._name = manifest.name
        self._buffers: list[int] = []
        self._stream: Any = None
        self._call("cudaSetDevice", self._index)
        logger = process_logger(trt)
        mark = logger.mark()
        self._runtime = trt.Runtime(logger)
        plan = path.read_bytes()
        self._engine = self._runtime.deserialize_cuda_engine(plan)
        if self._engine is None:
            said = logger.errors_since(mark)
            raise Unavailable(f"{manifest.name}: {explain(said, trt.__version__, device)}")
        try:
            self._bind(trt, manifest)
        except BaseException:
            self.close()
            raise
        self.device_memory_bytes = len(plan) + self._workspace_bytes() + self._buffer_bytes
        log.info(
            "%s runs on TensorRT %s (%s, compute capability %s), %d MiB of device memory",
            manifest.name,
            trt.__version__,
            device.name,
            device.compute_capability,
            self.device_memory_bytes // gpu.MIB,
        )

    def _bind(self, trt: Any, manifest: FunctionManifest) -> None:
        """Check the engine against the manifest, then give every tensor a buffer for the largest
        shapes the profile allows (outputs sized by TensorRT's shape inference at those)."""
        engine = self._engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [name for name in names if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT]
        outputs = [name for name in names if name not in inputs]
        _check_names(manifest, inputs, outputs)
        self._stream = self._call("cudaStreamCreate")
        self._context = engine.create_execution_context()
        self._context.set_optimization_profile_async(0, int(self._stream))
        self._inputs: dict[str, Binding] = {}
        self._outputs: dict[str, Binding] = {}
        for name in inputs:
            low, _opt, high = (tuple(dims) for dims in engine.get_tensor_profile_shape(name, 0))
            self._inputs[name] = Binding(
                name, numpy_dtype(self._name, name, engine.get_tensor_dtype(name).name), high
            )
            self._check_rows(manifest, name, low, high)
            self._context.set_input_shape(name, high)
        for name in outputs:
            shape = tuple(self._context.get_tensor_shape(name))
            if any(dim < 0 for dim in shape):
                raise Unavailable(f"{self._name}: output '{name}' has a data-dependent shape {list(shape)}")
            self._outputs[name] = Binding(
                name, numpy_dtype(self._name, name, engine.get_tensor_dtype(name).name), shape
            )
        _check_types(manifest, {**self._inputs, **self._outputs})
        self._buffer_bytes = 0
        for binding in (*self._inputs.values(), *self._outputs.values()):
            size = max(math.prod(binding.max_shape), 1) * binding.dtype.itemsize
            binding.address = int(self._call("cudaMalloc", size))
            self._buffers.append(binding.address)
            self._buffer_bytes += size
            self._context.set_tensor_address(binding.name, binding.address)

    def _check_rows(
        self, manifest: FunctionManifest, name: str, low: tuple[int, ...], high: tuple[int, ...]
    ) -> None:
        if not manifest.batched:
            return
        wanted = manifest.batching.max_batch_size
        if low[0] > 1 or high[0] < wanted:
            raise Unavailable(
                f"{self._name}: the engine's profile takes {low[0]} to {high[0]} rows of '{name}', "
                f"but max_batch_size is {wanted}; rebuild the engine with a profile from 1 to {wanted} "
                "rows or lower max_batch_size"
            )

    def run(self, inputs: Tensors, outputs: list[str]) -> Tensors:
        self._call("cudaSetDevice", self._index)
        kept = []
        to_device = self._cuda.cudaMemcpyKind.cudaMemcpyHostToDevice
        for name, binding in self._inputs.items():
            array = np.ascontiguousarray(inputs[name], dtype=binding.dtype)
            if not self._context.set_input_shape(name, array.shape):
                raise InvalidArgument(
                    f"input '{name}' has shape {list(array.shape)}; the engine takes at most "
                    f"{list(binding.max_shape)}"
                )
            kept.append(array)
            self._call(
                "cudaMemcpyAsync", binding.address, array.ctypes.data, array.nbytes, to_device, self._stream
            )
        if not self._context.execute_async_v3(int(self._stream)):
            raise ModelFailed(f"{self._name}: TensorRT could not run the batch")
        results = {}
        to_host = self._cuda.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for name in outputs:
            binding = self._outputs[name]
            result = np.empty(tuple(self._context.get_tensor_shape(name)), dtype=binding.dtype)
            self._call(
                "cudaMemcpyAsync", result.ctypes.data, binding.address, result.nbytes, to_host, self._stream
            )
            results[name] = result
        self._call("cudaStreamSynchronize", self._stream)
        return results

    def close(self) -> None:
        """Idempotent: frees the buffers, the stream, the context and the engine, on this model's
        GPU (another thread may have made another one current), each even when freeing another
        failed; then raises the first failure."""
        buffers, self._buffers = self._buffers, []
        stream, self._stream = self._stream, None
        failure = release(self._call, self._index, buffers, stream)
        for attribute in ("_context", "_engine", "_runtime"):
            if hasattr(self, attribute):
                delattr(self, attribute)
        if failure is not None:
            raise failure

    def _workspace_bytes(self) -> int:
        size: Any = getattr(self._engine, "device_memory_size_v2", None)
        if size is None:
            size = getattr(self._engine, "device_memory_size", 0)
        return int(size)

    def _call(self, function: str, *arguments: Any) -> Any:
        """A cuda-python runtime call: (error, result...) becomes the result or a ModelFailed."""
        answer = getattr(self._cuda, function)(*arguments)
        error, *rest = answer if isinstance(answer, tuple) else (answer,)
        if error != self._cuda.cudaError_t.cudaSuccess:
            _, text = self._cuda.cudaGetErrorString(error)
            raise ModelFailed(f"{self._name}: {function} failed: {text.decode(errors='replace')}")
        return rest[0] if rest else None


def release(call: Callable[..., Any], index: int, buffers: Sequence[int], stream: Any) -> ModelFailed | None:
    """Free a model's device memory through `call` (a cuda-python runtime call that raises
    ModelFailed): select its GPU first (cudaFree and cudaStreamDestroy act on the current one),
    then free every buffer and destroy the stream, each even when one before it failed. Returns
    the first failure."""
    failures: list[ModelFailed] = []
    steps = [("cudaSetDevice", index), *(("cudaFree", address) for address in buffers)]
    if stream is not None:
        steps.append(("cudaStreamDestroy", stream))
    for function, argument in steps:
        try:
            call(function, argument)
        except ModelFailed as exc:
            failures.append(exc)
    return failures[0] if failures else None


def numpy_dtype(function: str, tensor: str, datatype: str) -> np.dtype[Any]:
    """The numpy type of an engine tensor of TensorRT's `datatype` (its DataType's name), or
    Unavailable for the ones numpy cannot hold (BF16, FP8, INT4, FP4), where trt.nptype would
    raise a bare TypeError."""
    found = NUMPY_TYPES.get(datatype)
    if found is None:
        raise Unavailable(
            f"{function}: tensor '{tensor}' of the engine is {datatype}, which fngate's tensors (numpy) "
            "cannot hold; rebuild the engine with FP32, FP16 or integer inputs and outputs (casting "
            "inside the network)"
        )
    return np.dtype(found)


def explain(errors: Sequence[str], runtime_version: str, device: gpu.Device) -> str:
    """Why TensorRT refused an engine, from its logged errors, in the words a user needs."""
    said = " / ".join(errors) or (
        "no reason given; TensorRT logs to the first logger of the process, which may be "
        "onnxruntime's: see the runner's log"
    )
    lower = said.lower()
    if "incompatible device" in lower or "expecting compute" in lower:
        return (
            f"the engine was built for another GPU than this runner's {device.name} (compute capability "
            f"{device.compute_capability}); rebuild it on such a GPU (TensorRT: {said})"
        )
    if "version" in lower:
        return (
            f"the engine was built by another TensorRT version than this runner's {runtime_version}; "
            f"rebuild it with TensorRT {runtime_version} (TensorRT: {said})"
        )
    if "magic tag" in lower:
        return f"the file is not a TensorRT engine, or it is damaged (TensorRT: {said})"
    return f"TensorRT cannot load the engine (TensorRT: {said})"


def build_plan(manifest: FunctionManifest, onnx_path: Path, plan_path: Path, fp16: bool = False) -> None:
    """Build a `.plan` for this runner's TensorRT and GPU from an ONNX model, with the profile the
    manifest's batch range asks for (1 to max_batch_size rows). Blocking; needs a GPU."""
    trt, _cuda = _imports()
    logger = process_logger(trt)
    mark = logger.mark()
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        problems = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise InvalidArgument(f"TensorRT cannot parse {onnx_path.name}: {problems}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    found, why = profile(manifest)
    if found is None and why:
        raise InvalidArgument(f"no optimisation profile for {manifest.name}: {why}")
    if found is not None:
        shapes = builder.create_optimization_profile()
        rows = batch_range(manifest)
        for spec in manifest.inputs:
            low, opt, high = ((count, *spec.shape[1:]) for count in rows)
            shapes.set_shape(spec.name, low, opt, high)
        config.add_optimization_profile(shapes)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise Unavailable(
            f"TensorRT could not build {manifest.name}: {' / '.join(logger.errors_since(mark))}"
        )
    plan_path.write_bytes(bytes(plan))


def _imports() -> tuple[Any, Any]:
    try:
        import tensorrt as trt  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise Unavailable(
            f"the tensorrt backend needs TensorRT's Python package, which this runner lacks ({exc}); "
            "install fngate[gpu,tensorrt]"
        ) from exc
    try:
        from cuda.bindings import runtime as cudart  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise Unavailable(
            f"the tensorrt backend needs cuda-python (cuda.bindings), which this runner lacks ({exc}); "
            "install fngate[gpu]"
        ) from exc
    return trt, cudart


@functools.cache
def process_logger(trt: Any) -> Any:
    """The process's one TensorRT logger (TensorRT keeps the first one it is given and warns about
    any other): it keeps the last errors, to explain a refused engine, and logs the rest. Loads in
    parallel threads may see each other's errors among their own."""

    class Logger(trt.ILogger):  # type: ignore[misc,name-defined,unused-ignore]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self._lock = threading.Lock()
            self._errors: collections.deque[str] = collections.deque(maxlen=KEPT_ERRORS)
            self._count = 0

        def log(self, severity: Any, message: str) -> None:
            if int(severity) <= int(trt.ILogger.Severity.ERROR):
                with self._lock:
                    self._errors.append(message)
                    self._count += 1
                log.error("TensorRT: %s", message)
            elif int(severity) <= int(trt.ILogger.Severity.WARNING):
                log.warning("TensorRT: %s", message)

        def mark(self) -> int:
            with self._lock:
                return self._count

        def errors_since(self, mark: int) -> list[str]:
            with self._lock:
                return list(self._errors)[max(len(self._errors) - (self._count - mark), 0) :]

    return Logger()


def _check_names(manifest: FunctionManifest, inputs: list[str], outputs: list[str]) -> None:
    missing = [spec.name for spec in manifest.inputs if spec.name not in inputs]
    missing += [spec.name for spec in manifest.outputs if spec.name not in outputs]
    unfed = [name for name in inputs if manifest.input(name) is None]
    if missing or unfed:
        raise InvalidArgument(
            f"the engine's tensors do not match the manifest (missing {missing}, inputs the manifest "
            f"does not give {unfed}); it has inputs {sorted(inputs)} and outputs {sorted(outputs)}"
        )


def _check_types(manifest: FunctionManifest, bindings: dict[str, Binding]) -> None:
    for spec in (*manifest.inputs, *manifest.outputs):
        binding = bindings.get(spec.name)
        if binding is not None and spec.datatype != "BYTES" and DATATYPES[spec.datatype] != binding.dtype:
            raise InvalidArgument(
                f"tensor '{spec.name}' is {spec.datatype} in the manifest but {binding.dtype} in the engine"
            )
