"""onnxruntime backend: the model runs on the execution provider its manifest asks for (TensorRT,
CUDA or CPU; providers.py says which this runner can give and why not), with TensorRT's engines
cached in a local folder and, through an EngineStore, in the repository.

After loading, `device` names the provider the model actually runs on and `fallback_reason` why it
is not the one asked for (None when it is); `device_memory_bytes` is the GPU memory it took.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from fngate.errors import InvalidArgument, Unavailable
from fngate.manifest import MANIFEST_FILE, FunctionManifest
from fngate.repository import SHA256, hash_file
from fngate.tensors import DATATYPES, Tensors
from runner import gpu
from runner.backends.engine_cache import EngineCache, EngineKey, options_fingerprint
from runner.backends.providers import (
    CPU,
    NOT_SHAPING,
    SHORT,
    TENSORRT,
    Acceleration,
    Choice,
    choose,
    options,
    probe,
    refuse_fallback,
    session_problem,
)
from runner.metrics import ACCELERATOR_FALLBACKS

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 400


class OnnxBackend:
    def __init__(
        self,
        manifest: FunctionManifest,
        directory: Path,
        threads: int,
        acceleration: Acceleration | None = None,
        model_bytes: bytes | None = None,
    ) -> None:
        """`model_bytes`: the model file's contents, already verified, to build the session from
        (not with TensorRT, whose engine cache is keyed by the file)."""
        accel = acceleration or Acceleration()
        ort = _onnxruntime()
        asked = manifest.model.accelerator
        choice = Choice((CPU,)) if asked == "cpu" else choose(asked, probe(accel.device_index))
        refuse_fallback(manifest, accel, choice.reason)
        path = directory / manifest.model.path
        cache = None
        if choice.providers[0] == TENSORRT:
            cache = _engine_cache(manifest, directory, accel, ort.__version__)
        source: Path | bytes = model_bytes if model_bytes is not None and cache is None else path
        folder = cache.folder if cache is not None else accel.engine_dir
        providers = [(name, options(name, manifest, folder, accel.device_index)) for name in choice.providers]
        on_gpu = choice.providers[0] != CPU
        before = gpu.read_memory(accel.device_index) if on_gpu else None
        self._options = ort.RunOptions()
        self._options.log_severity_level = 4  # a stopped batch is not onnxruntime's error to print
        self._cache: EngineCache | None = None
        self._shapes: set[tuple[tuple[int, ...], ...]] = set()
        self._saving = threading.Lock()
        with cache.locked() if cache is not None else contextlib.nullcontext():
            if cache is not None:
                cache.prepare()
            self._session, problem = create_session(ort, source, threads, providers)
            if problem is not None and cache is not None and cache.event in ("local", "downloaded"):
                # Engines that TensorRT refuses (a damaged file, another driver) make the provider
                # fail: build afresh once, and let the rebuilt engines replace the stored ones.
                cache.discard(problem)
                self._session, problem = create_session(ort, source, threads, providers)
            self.device: str = self._session.get_providers()[0]
            self.fallback_reason: str | None = choice.reason
            if problem is not None:
                self.fallback_reason = f"{choice.reason}; {problem}" if choice.reason else problem
                refuse_fallback(manifest, accel, self.fallback_reason)
            self._check_names(manifest)
            self._text = [item.name for item in self._session.get_inputs() if item.type == "tensor(string)"]
            """Inputs that are ONNX string tensors: onnxruntime takes their elements as str."""
            if on_gpu:
                self._warm_up(manifest)  # where TensorRT builds what no profile let it build before
            if cache is not None and problem is None:
                cache.save()
                self._cache = cache
        self.stoppable = self.device == CPU
        """On the CPU a quick batch may run inline (runner.execution.Pace); a GPU's may not."""
        self.device_memory_bytes = 0
        if on_gpu:
            after = gpu.read_memory(accel.device_index)
            if before is not None and after is not None:
                self.device_memory_bytes = gpu.taken_bytes(before, after)
        self._announce(manifest)

    def run(self, inputs: Tensors, outputs: list[str]) -> Tensors:
        self._options.terminate = False
        if self._text:
            text = {name: as_text(name, inputs[name]) for name in self._text if name in inputs}
            inputs = {**inputs, **text}
        results = self._session.run(outputs, inputs, self._options)
        if self._cache is not None:
            self._store_new_engines(inputs)
        return dict(zip(outputs, results, strict=True))

    def _store_new_engines(self, inputs: Tensors) -> None:
        """TensorRT builds an engine for a shape that none covers on first use (inputs without a
        profile): after a batch of a shape not seen before, store what it built, in a thread of
        its own so that the batch's answers do not wait for the upload."""
        shapes = tuple(array.shape for array in inputs.values())
        if shapes in self._shapes:
            return
        self._shapes.add(shapes)
        cache = self._cache
        if cache is not None and cache.changed() and self._saving.acquire(blocking=False):
            threading.Thread(target=self._save, args=(cache,), name="engine-cache-save", daemon=True).start()

    def _save(self, cache: EngineCache) -> None:
        try:
            with cache.locked():
                cache.save()
        finally:
            self._saving.release()

    def stop(self) -> None:
        """Ends the running batch from another thread: onnxruntime checks the flag between nodes."""
        self._options.terminate = True

    def close(self) -> None:
        del self._session

    def _check_names(self, manifest: FunctionManifest) -> None:
        model_inputs = {item.name for item in self._session.get_inputs()}
        model_outputs = {item.name for item in self._session.get_outputs()}
        missing = [spec.name for spec in manifest.inputs if spec.name not in model_inputs]
        missing += [spec.name for spec in manifest.outputs if spec.name not in model_outputs]
        if missing:
            raise InvalidArgument(
                f"the model has no tensors named {missing}; it has inputs {sorted(model_inputs)} "
                f"and outputs {sorted(model_outputs)}"
            )

    def _warm_up(self, manifest: FunctionManifest) -> None:
        """One batch of zeros at the preferred size, so that the first invocation finds kernels
        chosen and memory allocated (and the memory measured includes them)."""
        batching = manifest.batching
        rows = max(batching.preferred_batch_sizes, default=batching.max_batch_size)
        inputs = {}
        for spec in manifest.inputs:
            shape = (rows, *spec.shape[1:]) if manifest.batched else spec.shape
            if spec.datatype == "BYTES" or -1 in shape:
                return
            inputs[spec.name] = np.zeros(shape, dtype=DATATYPES[spec.datatype])
        self.run(inputs, [spec.name for spec in manifest.outputs])

    def _announce(self, manifest: FunctionManifest) -> None:
        asked = manifest.model.accelerator
        if self.fallback_reason is None:
            log.info("%s runs on %s (asked: %s)", manifest.name, self.device, asked)
            return
        log.warning("%s runs on %s (asked: %s; %s)", manifest.name, self.device, asked, self.fallback_reason)
        ACCELERATOR_FALLBACKS.labels(manifest.name, asked, self.device).inc()


def as_text(name: str, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A BYTES tensor for an ONNX string input: each element decoded from UTF-8 (given bytes,
    onnxruntime would see "b'1'"). Its outputs come back as str, which BYTES encodes as UTF-8."""
    flat = array.ravel()
    text = np.empty(flat.size, dtype=np.object_)
    for index, item in enumerate(flat):
        if not isinstance(item, bytes):
            text[index] = item if isinstance(item, str) else str(item)
            continue
        try:
            text[index] = item.decode()
        except UnicodeDecodeError as exc:
            raise InvalidArgument(
                f"input '{name}': element {index} is not UTF-8 text ({exc.reason} at byte "
                f"{exc.start}), and the model's string tensors hold text"
            ) from None
    return text.reshape(array.shape)


def _onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise Unavailable(
            f"onnxruntime is not installed in this runner ({exc}); install fngate[cpu] or fngate[gpu]"
        ) from exc
    return onnxruntime


def create_session(
    ort: Any, model: Path | bytes, threads: int, providers: list[tuple[str, dict[str, str]]]
) -> tuple[Any, str | None]:
    """A session of the model on `providers`, and how it differs from what was asked for (None when
    it does not). onnxruntime's own fallback is off: it would retry on its fallback providers with
    none of the options (device_id included) and say so only on stdout. Instead a provider that
    fails is reported and the next one tried with its options; only the last one's failure (the
    CPU's: the model itself) raises. At run time a failing provider fails its batch rather than
    moving the model, unseen, to another device."""
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = threads
    session_options.inter_op_num_threads = 1
    session_options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Spinning worker threads burn a core the gateway needs; block instead.
    session_options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    problems = []
    for start in range(len(providers)):
        chain = providers[start:]
        try:
            # enable_fallback=0 is read by onnxruntime 1.32 and later; older ones ignore it, and
            # the comparison below catches their fallback.
            session = ort.InferenceSession(
                model if isinstance(model, bytes) else str(model),
                sess_options=session_options,
                providers=chain,
                enable_fallback=0,
            )
        except Exception as exc:  # onnxruntime's Fail, RuntimeError, ...: the provider did not start
            if len(chain) == 1:
                raise
            said = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:MAX_ERROR_CHARS]
            problems.append(
                f"onnxruntime could not create the {SHORT.get(chain[0][0], chain[0][0])} provider: {said}"
            )
            continue
        session.disable_fallback()
        mismatch = session_problem(chain, session.get_providers(), session.get_provider_options())
        if mismatch is not None:
            problems.append(mismatch)
        return session, "; ".join(problems) or None
    raise AssertionError("unreachable: the last provider's failure raises")


def _engine_cache(
    manifest: FunctionManifest, directory: Path, accel: Acceleration, ort_version: str
) -> EngineCache:
    environment = probe(accel.device_index)
    assert isinstance(environment.device, gpu.Device)  # choose() put TensorRT first: there is one
    shaping = options(TENSORRT, manifest, Path(), accel.device_index)
    key = EngineKey(
        files_sha256(directory, manifest.model.path),
        environment.tensorrt_version,
        environment.device.compute_capability,
        environment.device.name,
        environment.device.driver_major,
        manifest.model.precision,
        f"onnxruntime {ort_version}",
        options_fingerprint(shaping, NOT_SHAPING),
    )
    return EngineCache(accel.engine_dir, key, accel.store, manifest.name)


def files_sha256(directory: Path, model_path: str) -> str:
    """A digest of the version's files in `directory` (each file's path and sha256, but the
    manifest's, whose settings that shape an engine are in its options) and of `model_path`, the
    model among them: ONNX external data changes an engine as much as the .onnx does."""
    digest = hashlib.sha256(f"model {model_path}\n".encode())
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory).as_posix()
        if relative != MANIFEST_FILE and path.is_file():
            digest.update(f"{relative} {file_sha256(path)}\n".encode())
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """A file's sha256: the artifact cache links each file to a blob named by it, so that is read
    from the link when it can be; otherwise the file is hashed."""
    if path.is_symlink():
        target = path.readlink().name
        if SHA256.match(target):
            return target
    return hash_file(path)
