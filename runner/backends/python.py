"""python backend: a `model.py` in the function's folder, run in a process of its own.

The contract: `model.py` defines `class Model` whose constructor takes the function's folder
(a pathlib.Path) and whose `infer(inputs: dict[str, numpy.ndarray]) -> dict[str, numpy.ndarray]`
takes a whole batch (rows of several invocations concatenated on the first axis) and returns every
output of the manifest with the same number of rows. An optional `close()` is called on unload.
With `accelerator: cuda` the process is given the runner's GPU (CUDA_VISIBLE_DEVICES names it, by
UUID where NVML can tell: CUDA's device 0 there), and the Model says where it runs with a `device`
attribute ("cuda", or "cpu" and why not in `fallback_reason`); the backend reports it, and the GPU
memory the process holds once its Model is constructed.

The model lives in a child process (runner.sandbox) with a clean environment and a working folder
of its own. A child that dies or runs past the execution timeout fails its batch and is started
again for a later one, after a backoff; one over memory_limit_mb is restarted between batches.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import orjson

import runner
from fngate.errors import FunctionError, InvalidArgument, ModelFailed, ModelTimeout
from fngate.manifest import FunctionManifest
from runner import gpu, sandbox
from runner.backends import MemberErrors, Tensors
from runner.backends.providers import Acceleration, refuse_fallback
from runner.metrics import FUNCTION_RESTARTS, PYTHON_GPU

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""How long a child may take to import model.py and construct its Model."""
STOP_TIMEOUT_S = 5.0
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 10.0
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
PROJECT_ROOT = Path(runner.__file__).resolve().parent.parent


class PythonBackend:
    isolated = True
    """Enforces its own execution timeout: a late batch kills the child, never blocks a thread."""
    takes_rows = True
    """Told each invocation's rows: a Triton model answers (and fails) each on its own."""

    executor: concurrent.futures.ThreadPoolExecutor
    """The thread that waits on this function's process: its own, so that functions that hang or
    back off never hold the threads other functions' batches need."""

    device = "python"
    """"python" on the CPU, "python:cuda" when the Model says it runs on its GPU."""
    fallback_reason: str | None = None
    device_memory_bytes = 0

    def __init__(
        self, manifest: FunctionManifest, directory: Path, acceleration: Acceleration | None = None
    ) -> None:
        accel = acceleration or Acceleration()
        self._manifest = manifest
        self._name = manifest.name
        self._module = directory / manifest.model.path
        self._directory = directory
        self._environment: dict[str, str] = {}
        on_gpu = manifest.model.accelerator == "cuda"
        if on_gpu:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            device = gpu.find_device(accel.device_index)
            self._environment["CUDA_VISIBLE_DEVICES"] = gpu.child_visible_devices(
                device, accel.device_index, visible
            )
        limit_mb = manifest.model.memory_limit_mb
        self._memory_limit_bytes = limit_mb * 2**20 if limit_mb else None
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._closed = False
        self._failures = 0
        self._next_start = 0.0
        self._last_exit = ""
        if not self._module.is_file():
            raise InvalidArgument(f"{manifest.model.path} is not a file in the function's folder")
        before = gpu.read_memory(accel.device_index) if on_gpu else None
        self._child = child = self._start()
        if on_gpu:
            try:
                self._place(child, accel, before)
            except BaseException:
                child.stop(graceful=False)
                raise
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"function-{self._name}")

    def _place(self, child: _Child, accel: Acceleration, before: gpu.MemoryReading | None) -> None:
        """Where a function that asked for cuda runs, as its Model says, and the GPU memory its
        process holds once the Model is constructed (NVML, by the process's id)."""
        if child.device.startswith("cuda"):
            self.device = PYTHON_GPU
        else:
            self.fallback_reason = child.reason or f"its Model runs on {child.device!r}, not on the GPU"
        refuse_fallback(self._manifest, accel, self.fallback_reason)
        after = gpu.read_memory(accel.device_index, child.process.pid)
        if before is not None and after is not None:
            fresh = gpu.MemoryReading(before.device_used_bytes, None)  # a new process holds nothing
            self.device_memory_bytes = gpu.taken_bytes(fresh, after)

    @property
    def pid(self) -> int | None:
        """The child's process id while one runs."""
        child = self._child
        return child.process.pid if child is not None else None

    def run(self, inputs: Tensors, outputs: list[str], rows: list[int] | None = None) -> Tensors:
        """Raises MemberErrors when some invocations of the batch failed alone."""
        timeout_s = self._manifest.execution_timeout_s
        specs, buffers = sandbox.encode_tensors(inputs)
        child = self._running_child(time.monotonic() + timeout_s)
        deadline = time.monotonic() + timeout_s
        request = {"tensors": specs, "outputs": outputs, **({"rows": rows} if rows is not None else {})}
        try:
            sandbox.send(child.requests, request, buffers, deadline)
            header, body = sandbox.receive(child.replies, deadline)
            results = {} if "error" in header else sandbox.decode_tensors(header["tensors"], body)
        except TimeoutError:
            self._fail(child, "timeout", f"ran past its execution timeout of {timeout_s * 1000:.0f} ms")
            raise ModelTimeout(
                f"function '{self._name}': the batch ran past its execution timeout of "
                f"{timeout_s * 1000:.0f} ms; its process was stopped and starts again for the next batch"
            ) from None
        except sandbox.ChannelClosed:
            exit_text = self._fail(child, "exited", "")
            raise ModelFailed(
                f"function '{self._name}': its process {exit_text} while running the batch; "
                "it starts again for the next batch"
            ) from None
        except Exception as exc:  # not a frame: whatever wrote it, the pipe is out of step now
            problem = f"wrote what is not an answer ({type(exc).__name__}: {exc})"
            self._fail(child, "protocol", problem)
            raise ModelFailed(
                f"function '{self._name}': its process {problem}; it starts again for the next batch"
            ) from None
        self._failures = 0
        if "error" in header:
            raise FunctionError.from_code(header["code"], header["error"])
        self._check_memory(child)
        if header.get("errors"):
            errors = {
                int(index): FunctionError.from_code(code, text)
                for index, (code, text) in header["errors"].items()
            }
            raise MemberErrors(results, errors)
        return results

    def close(self) -> None:
        with self._lock:
            self._closed = True
            child, self._child = self._child, None
        if child is not None:
            # Model.close and the interpreter's exit take a while: an unload does not wait for them.
            threading.Thread(target=child.stop, args=(True,), name=f"stop-{self._name}", daemon=True).start()
        self.executor.shutdown(wait=False)

    def _running_child(self, deadline: float) -> _Child:
        """The child, started again when the last one is gone: after its backoff, which the batch
        waits out if its deadline allows, else the batch fails at once. (Neither the wait nor the
        start holds the lock: an unload meanwhile is not held up.)"""
        with self._lock:
            if self._closed:
                raise ModelFailed(f"function '{self._name}' was unloaded")
            if self._child is not None:
                return self._child
            wait_s = self._next_start - time.monotonic()
        if wait_s > 0 and time.monotonic() + wait_s >= deadline:
            raise ModelFailed(
                f"function '{self._name}': its process {self._last_exit}; it starts again in {wait_s:.1f} s"
            )
        if wait_s > 0:
            time.sleep(wait_s)
        child = self._start()
        with self._lock:
            if not self._closed:
                self._child = child
                return child
        child.stop(graceful=False)
        raise ModelFailed(f"function '{self._name}' was unloaded")

    def _start(self) -> _Child:
        triton = self._manifest.triton
        try:
            return _Child.start(
                self._name,
                self._module,
                self._directory,
                self._environment,
                triton.config if triton else None,
            )
        except FunctionError as exc:
            self._note_failure(exc.message)
            raise

    def _fail(self, child: _Child, reason: str, what: str) -> str:
        """The child broke the batch: stop it, count it, schedule its restart; its exit, in words."""
        child.stop(graceful=False)
        exit_text = what or _describe_exit(child.process.returncode)
        with self._lock:
            if self._child is child:
                self._child = None
        self._note_failure(exit_text)
        FUNCTION_RESTARTS.labels(self._name, reason).inc()
        log.warning(
            "function %s: its process %s; restarting after %.1f s", self._name, exit_text, self._backoff_s()
        )
        return exit_text

    def _note_failure(self, exit_text: str) -> None:
        self._failures += 1
        self._last_exit = exit_text
        self._next_start = time.monotonic() + self._backoff_s()

    def _backoff_s(self) -> float:
        return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** max(0, self._failures - 1))

    def _check_memory(self, child: _Child) -> None:
        if self._memory_limit_bytes is None:
            return
        rss = child.rss_bytes()
        if rss <= self._memory_limit_bytes:
            return
        log.warning(
            "function %s: its process holds %.0f MiB, over memory_limit_mb %d; restarting it",
            self._name,
            rss / 2**20,
            self._memory_limit_bytes // 2**20,
        )
        FUNCTION_RESTARTS.labels(self._name, "memory").inc()
        with self._lock:
            if self._child is child:
                self._child = None
        # Killed rather than closed: the batch's replies wait for this, and a graceful exit of a
        # large heap is slow. The next batch starts a fresh process.
        child.stop(graceful=False)


class _Child:
    """One `python -m runner.sandbox` process and its pipes."""

    device = "cpu"
    """Where its Model says it runs, and why not on the GPU (`reason`), from its first frame."""
    reason: str | None = None

    def __init__(self, process: subprocess.Popen[bytes], workdir: Path) -> None:
        self.process = process
        self.workdir = workdir
        stdin, stdout = process.stdin, process.stdout
        assert stdin is not None and stdout is not None
        self._pipes: tuple[IO[bytes], IO[bytes]] = (stdin, stdout)
        self.requests = stdin.fileno()
        self.replies = stdout.fileno()
        os.set_blocking(self.requests, False)
        os.set_blocking(self.replies, False)

    @classmethod
    def start(
        cls,
        name: str,
        module: Path,
        directory: Path,
        environment: dict[str, str],
        triton_config: dict[str, Any] | None = None,
    ) -> _Child:
        """Start the process (`environment` added to the runner's, less its secrets) and wait until
        its Model (or Triton model, with its configuration `triton_config`) is constructed. Raises
        InvalidArgument when model.py does not load, ModelFailed when the process dies or takes too
        long."""
        workdir = Path(tempfile.mkdtemp(prefix=f"fngate-{name}-"))
        env = sandbox.clean_environment(os.environ) | environment
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
        env["TMPDIR"] = str(workdir)
        # Never a fork of the runner: a fresh interpreter holds none of its sockets, threads or loop.
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "runner.sandbox",
                *("--function", name, "--module", str(module)),
                *("--directory", str(directory), "--parent", str(os.getpid())),
                *(
                    ("--triton-config", orjson.dumps(triton_config).decode())
                    if triton_config is not None
                    else ()
                ),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,
        )
        child = cls(process, workdir)
        try:
            header, _body = sandbox.receive(child.replies, time.monotonic() + START_TIMEOUT_S)
        except (TimeoutError, sandbox.ChannelClosed) as exc:
            child.stop(graceful=False)
            what = "did not start within" if isinstance(exc, TimeoutError) else "exited while starting:"
            detail = (
                f"{START_TIMEOUT_S:.0f} s"
                if isinstance(exc, TimeoutError)
                else _describe_exit(process.returncode)
            )
            raise ModelFailed(f"function '{name}': its process {what} {detail}") from None
        if "error" in header:
            child.stop(graceful=False)
            raise InvalidArgument(header["error"])
        child.device, child.reason = str(header.get("device", "cpu")), header.get("reason")
        log.info("function %s runs in process %d (%s)", name, process.pid, child.device)
        return child

    def rss_bytes(self) -> int:
        try:
            with open(f"/proc/{self.process.pid}/statm") as statm:
                return int(statm.read().split()[1]) * PAGE_BYTES
        except (OSError, ValueError, IndexError):
            return 0

    def stop(self, graceful: bool) -> None:
        """Graceful: close its stdin (it calls Model.close and exits), kill it if it takes longer
        than STOP_TIMEOUT_S. Else kill it now. Either way wait for it and remove its working folder."""
        if not graceful:
            self._kill()
        for pipe in self._pipes:
            pipe.close()
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill()
            self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "stopped answering"
    if returncode < 0:
        try:
            return f"was killed by signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"
