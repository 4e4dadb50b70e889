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
of its own (runner.workdir: a capped tmpfs under a root runner), confined (runner.confinement):
under an unprivileged user when the runner is root (never uid 0), in cgroups of its own where they
can be made (runner.cgroup: memory, pids, and one kill for everything it starts), its output logged
within a budget (runner.output), its answers read only up to max_output_bytes an invocation. A
child that dies, runs past the execution timeout, past memory_limit_mb or pids_limit, or answers
past max_output_bytes fails its batch and is started again for a later one, after a backoff.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import runner
from fngate import custom_metrics
from fngate.errors import FunctionError, InvalidArgument, ModelFailed, ModelTimeout
from fngate.manifest import DEFAULT_MEMORY_LIMIT_MB, FunctionManifest
from fngate.tensors import Tensors
from runner import bls, budget, confinement, gpu, sandbox
from runner.backends import MemberErrors, charge_cpu, streaming
from runner.backends.providers import Acceleration, refuse_fallback
from runner.backends.streams import ModelStreams
from runner.cgroup import FunctionCgroup, current_layout
from runner.cgroup import reap as reap_cgroups
from runner.confinement import Confinement
from runner.metrics import FUNCTION_RESTARTS, PYTHON_GPU
from runner.output import Output
from runner.workdir import WorkingFolder, runner_folder
from runner.workdir import reap as reap_folders

log = logging.getLogger(__name__)

MAX_CALL_BYTES = 64 * 2**20
"""The most a frame from a model's process may hold: a call's inputs may outweigh its outputs."""

START_TIMEOUT_S = 120.0
"""How long a child may take to import model.py and construct its Model."""
STOP_TIMEOUT_S = 5.0
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 10.0
PROJECT_ROOT = Path(runner.__file__).resolve().parent.parent
CODE = (PROJECT_ROOT / "fngate", PROJECT_ROOT / "runner")
"""fngate's own packages, which the child imports (and nothing else of the project's folder)."""
OUTPUT_DRAIN_S = 1.0


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
        self,
        manifest: FunctionManifest,
        directory: Path,
        acceleration: Acceleration | None = None,
        version: str = "",
        instance: int = 0,
    ) -> None:
        accel = acceleration or Acceleration()
        self._reported: list[custom_metrics.Update] = []
        """Custom metrics its process reported, until the consumer takes them (take_metric_updates)."""
        self._instance = instance
        self._manifest = manifest
        self._name = manifest.name
        self._version = version
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
        self._memory_limit_mb = limit_mb
        self._memory_limit_bytes = limit_mb * 2**20 if limit_mb else None
        self._limits = _Limits(
            self._memory_limit_bytes,
            (limit_mb or DEFAULT_MEMORY_LIMIT_MB) * 2**20,
            manifest.model.pids_limit,
            manifest.model.working_folder_limit_mb * 2**20,
        )
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._closed = False
        self._failures = 0
        self._next_start = 0.0
        self._last_exit = ""
        if not self._module.is_file():
            raise InvalidArgument(f"{manifest.model.path} is not a file in the function's folder")
        # Before any function code runs: its process may share this runner's user.
        confinement.make_undumpable()
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

    def rss_bytes(self) -> int:
        """The resident memory of the function's process (0 while none runs)."""
        child = self._child
        return child.rss_bytes() if child is not None else 0

    @property
    def pid(self) -> int | None:
        """The child's process id while one runs."""
        child = self._child
        return child.process.pid if child is not None else None

    def _answer_calls(self, child: _Child, deadline: float, max_body_bytes: int) -> tuple[Any, Any]:
        """The batch's reply, once the calls its model made meanwhile (BLS: runner.bls) are answered:
        each goes out as it comes, several at once, and its answer goes back down the pipe as soon
        as it is in (a decoupled callee's each response as it comes). (A decoupled model's own
        batches are read by runner.backends.streams.)"""
        calls = bls.Calls(self._name)
        waits = select.poll()
        waits.register(child.replies, select.POLLIN)
        try:
            while True:
                for frame, buffers in calls.frames():
                    sandbox.send(child.requests, frame, buffers, deadline)
                if calls.fileno() >= 0:  # the pipe, or what comes from the calls' loop
                    left_s = deadline - time.monotonic()
                    if left_s <= 0:
                        raise TimeoutError
                    ready = waits.poll(max(1.0, 1000 * left_s))
                    if not any(fd == child.replies for fd, _events in ready):
                        continue
                header, body = sandbox.receive(child.replies, deadline, max(max_body_bytes, MAX_CALL_BYTES))
                if header.get("op") != "call":
                    return header, body
                first = calls.fileno() < 0
                calls.start(header, body, deadline)
                if first:
                    waits.register(calls.fileno(), select.POLLIN)
        finally:
            calls.close()

    def _exchange(
        self, child: _Child, request: dict[str, Any], buffers: Any, deadline: float, max_body_bytes: int
    ) -> tuple[Any, Any]:
        """The batch down the pipe, and its reply."""
        if self._manifest.model.decoupled:  # its batches overlap: a reader of its own reads it
            timeout_s = self._manifest.execution_timeout_s
            return self._streams(child, timeout_s).exchange(request, buffers, deadline, streaming())
        sandbox.send(child.requests, request, buffers, deadline)
        return self._answer_calls(child, deadline, max_body_bytes)

    def _streams(self, child: _Child, timeout_s: float) -> ModelStreams:
        """A decoupled model's process's reader (runner.backends.streams), started with its first
        batch; a stream past the execution timeout stops the process."""
        if child.streams is None:
            max_frame = max(self._manifest.model.max_output_bytes, MAX_CALL_BYTES)
            overdue = functools.partial(
                self._fail,
                child,
                "timeout",
                f"streamed past its execution timeout of {timeout_s * 1000:.0f} ms",
            )
            child.streams = ModelStreams(
                self._name, child.requests, child.replies, max_frame, timeout_s, overdue
            )
        return child.streams

    def take_metric_updates(self) -> list[custom_metrics.Update]:
        taken, self._reported = self._reported, []
        return taken

    def _take_report(self, raw: Any) -> None:
        """A batch's custom metrics as its process sent them, checked (the process is the function's
        code): a report that is not one is dropped and logged."""
        if raw is None:
            return
        try:
            self._reported += custom_metrics.decode_updates(raw)
        except (ValueError, TypeError) as exc:  # MetricError, or what is not even of the right types
            log.warning("%s: its process sent custom metrics that are dropped: %s", self._name, exc)

    def run(self, inputs: Tensors, outputs: list[str], rows: list[int] | None = None) -> Tensors:
        """Raises MemberErrors when some invocations of the batch failed alone."""
        timeout_s = self._manifest.execution_timeout_s
        specs, buffers = sandbox.pack_tensors(inputs)
        child = self._running_child(time.monotonic() + timeout_s)
        deadline = time.monotonic() + timeout_s
        per_invocation = self._manifest.model.max_output_bytes
        request = {"tensors": specs, "outputs": outputs, "max_output_bytes": per_invocation}
        if rows is not None:
            request["rows"] = rows
        invocations = len(rows) if rows else 1
        child.output.batch_started()
        cpu_before = child.cpu_s()
        try:
            header, body = self._exchange(child, request, buffers, deadline, per_invocation * invocations)
            self._take_report(header.get("metrics"))
            results = {} if "error" in header else sandbox.unpack_tensors(header["tensors"], body)
        except sandbox.FrameTooLarge as exc:  # past the process's own check: never read, and it is stopped
            self._fail(child, "output", f"answered {exc.body_bytes} bytes")
            raise ModelFailed(
                f"function '{self._name}': its process answered {exc.body_bytes} bytes of outputs, over the "
                f"{exc.max_body_bytes} its {invocations} invocation(s) may have (max_output_bytes "
                f"{per_invocation} each); it was stopped and starts again for the next batch"
            ) from None
        except TimeoutError:
            held = child.at_memory_limit()  # the kernel may still be reclaiming, or about to end it
            self._fail(
                child,
                "memory" if held else "timeout",
                f"ran past its execution timeout of {timeout_s * 1000:.0f} ms",
            )
            if held:
                raise ModelFailed(
                    f"{self._out_of_memory()}: its process was held at "
                    "the limit past its execution timeout and stopped; it starts again for the next batch"
                ) from None
            raise ModelTimeout(
                f"function '{self._name}': the batch ran past its execution timeout of "
                f"{timeout_s * 1000:.0f} ms; its process was stopped and starts again for the next batch"
            ) from None
        except sandbox.ChannelClosed:
            exit_text = self._fail(child, "exited", "")
            if child.out_of_memory():
                raise ModelFailed(
                    f"{self._out_of_memory()}: the kernel stopped its "
                    "process at the limit; it starts again for the next batch"
                ) from None
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
        finally:
            child.output.batch_ended()
            child.charge_cpu_since(cpu_before)
        self._failures = 0
        stopped = self._check_pids(child)
        if "error" in header:
            raise FunctionError.from_code(header["code"], header["error"] + stopped)
        if not stopped:
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
        manifest = self._manifest
        torchscript = manifest.model.backend == "pytorch"  # own_process (runner.backends.torchscript)
        try:
            return _Child.start(
                self._name,
                self._version,
                self._module,
                self._directory,
                self._limits,
                self._environment,
                manifest.triton.config if manifest.triton and not torchscript else None,
                self._instance,
                manifest.model_dump(mode="json") if torchscript else None,
            )
        except FunctionError as exc:
            self._note_failure(exc.message)
            raise

    def _fail(self, child: _Child, reason: str, what: str) -> str:
        """The child broke the batch: stop it, count it, schedule its restart; its exit, in words."""
        child.stop(graceful=False)
        if child.out_of_memory():
            reason, what = "memory", what or f"was stopped at its memory_limit_mb of {self._memory_limit_mb}"
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

    def _out_of_memory(self) -> str:
        if self._memory_limit_bytes is not None:
            return sandbox.out_of_memory(self._name, self._memory_limit_bytes)
        return (
            f"function '{self._name}': the batch needed more memory than the default limit of "
            f"{DEFAULT_MEMORY_LIMIT_MB} MiB (its manifest sets no memory_limit_mb)"
        )

    def _check_pids(self, child: _Child) -> str:
        """After a batch: a process whose processes and threads reached pids_limit is stopped with
        all it started (what holds them would hold every later batch); what to add to the batch's
        error, in words ("" when they did not)."""
        refused = child.cgroup.pids_refused() if child.cgroup is not None else 0
        if not refused:
            return ""
        limit = self._limits.pids
        log.warning(
            "function %s: its processes reached pids_limit %d (%d forks or threads refused); restarting it",
            self._name,
            limit,
            refused,
        )
        FUNCTION_RESTARTS.labels(self._name, "pids").inc()
        with self._lock:
            if self._child is child:
                self._child = None
        child.stop(graceful=False)
        return (
            f" (its processes reached its pids_limit of {limit}: they were stopped, and it starts again "
            "for the next batch)"
        )

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


@dataclasses.dataclass(frozen=True)
class _Limits:
    """What a function's process and everything it starts may use."""

    memory_bytes: int | None
    """The manifest's memory_limit_mb: RLIMIT_DATA where no cgroup holds its memory."""
    cgroup_memory_bytes: int
    """Its cgroup's memory limit: memory_limit_mb, or DEFAULT_MEMORY_LIMIT_MB."""
    pids: int
    folder_bytes: int


AUTO_COMPLETE_LIMITS = _Limits(None, DEFAULT_MEMORY_LIMIT_MB * 2**20, 64, 64 * 2**20)
"""What a model's auto_complete_config may use: a function's default memory, few processes."""


def auto_complete(name: str, module: Path, config: dict[str, Any]) -> dict[str, Any]:
    """A Triton Python model's configuration as its `auto_complete_config` completes `config`,
    run in a process of its own confined as a Python function's (never in the process that reads
    the repository). Raises InvalidArgument with the model's error, ModelFailed when its process
    does not answer."""
    child = _Child.start(
        name, "auto-complete", module, module.parent, AUTO_COMPLETE_LIMITS, {}, complete=config
    )
    try:
        completed = child.completed
    finally:
        child.stop(graceful=False)
    if not isinstance(completed, dict):
        raise ModelFailed(f"model '{name}': its auto_complete_config answered no configuration")
    return completed


def process_cpu_s(pid: int) -> float | None:
    """The CPU time (user and system, all its threads) the kernel has counted for process `pid`, to
    the nanosecond, read from Linux's CPU clock of that process (clockid (~pid << 3) | 2,
    CPUCLOCK_SCHED): measured by the runner, not reported by the function's code. None once the
    process is gone."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        return None


class _Child:
    """One `python -m runner.sandbox` process, its pipes, its output's reader, its working folder
    and its cgroups."""

    device = "cpu"
    """Where its Model says it runs, and why not on the GPU (`reason`), from its first frame."""
    reason: str | None = None
    completed: Any = None
    """What a process started only for auto_complete_config answered."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        workdir: WorkingFolder,
        output: Output,
        cgroup: FunctionCgroup | None,
    ) -> None:
        self.process = process
        self.workdir = workdir
        self.output = output
        self.cgroup = cgroup
        self._out_of_memory: bool | None = None
        stdin, stdout = process.stdin, process.stdout
        assert stdin is not None and stdout is not None
        self._pipes: tuple[IO[bytes], IO[bytes]] = (stdin, stdout)
        self.requests = stdin.fileno()
        self.replies = stdout.fileno()
        self.streams: ModelStreams | None = None
        """A decoupled model's reader of its pipe (PythonBackend._streams)."""
        os.set_blocking(self.requests, False)
        os.set_blocking(self.replies, False)

    def cpu_s(self) -> float | None:
        """The CPU time its process has taken (process_cpu_s)."""
        return process_cpu_s(self.process.pid)

    def charge_cpu_since(self, before: float | None) -> None:
        """Charge the running batch (runner.backends.charge_cpu) with the CPU time its process took
        since `before` (cpu_s); nothing when either reading failed (the process is gone)."""
        after = self.cpu_s()
        if before is not None and after is not None:
            charge_cpu(after - before)

    @classmethod
    def start(
        cls,
        name: str,
        version: str,
        module: Path,
        directory: Path,
        limits: _Limits,
        environment: dict[str, str],
        triton_config: dict[str, Any] | None = None,
        instance: int = 0,
        torchscript: dict[str, Any] | None = None,
        complete: dict[str, Any] | None = None,
    ) -> _Child:
        """Start the process (`environment` added to the runner's, less its secrets), confine it and
        wait until its Model (or Triton model, with its configuration `triton_config`, as instance
        `instance` of the function's; or, given its manifest `torchscript`, its TorchScript model)
        is constructed. Raises InvalidArgument when model.py does not
        load, ModelFailed when the process dies or takes too long, or cannot run as an unprivileged
        user."""
        user = _function_user()
        folder = WorkingFolder.make(name, limits.folder_bytes, user)
        cgroup = FunctionCgroup.create(name, limits.cgroup_memory_bytes, limits.pids)
        seen = directory
        passed: list[int] = []
        if user is not None and not confinement.searchable_by_others(directory):
            # Its folder is handed over open: the folders above it may be root's alone (a cache in /root).
            passed.append(os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            seen = Path(f"/proc/self/fd/{passed[-1]}")
        try:
            child = cls._spawn(name, version, folder, cgroup, passed, environment)
        except OSError:
            folder.remove()
            if cgroup is not None:
                cgroup.remove()
            raise
        held = cgroup is not None and cgroup.layout.memory is not None
        # With a cgroup the kernel counts what the process uses; RLIMIT_DATA (what it maps) is the fallback.
        plan = confinement.function_confinement(
            seen,
            folder.path,
            CODE,
            None if held else limits.memory_bytes,
            confinement.link_targets(directory),
            user,
            None if folder.mounted else limits.folder_bytes,  # a plain folder: each file capped at least
        )
        load: dict[str, Any] = {
            "op": "load",
            "module": str(seen / module.relative_to(directory)),
            "directory": str(seen),
            "confinement": plan.encode(),
        }
        if triton_config is not None:
            load["triton_config"] = triton_config
            load["instance"] = instance
        if torchscript is not None:
            load["torchscript"] = torchscript
        if complete is not None:
            load["complete"] = complete
        header = child._load(name, load, user)
        child.completed = header.get("config")
        child.device, child.reason = str(header.get("device", "cpu")), header.get("reason")
        limits_text = [*header.get("confined", ())]
        if held:
            limits_text.append(f"memory cgroup {limits.cgroup_memory_bytes // 2**20} MiB")
        if cgroup is not None and cgroup.layout.pids is not None:
            limits_text.append(f"pids.max {limits.pids}")
        if folder.mounted:
            limits_text.append(f"working folder a tmpfs of {limits.folder_bytes // 2**20} MiB")
        who = f"uid {user[0]}" if user is not None else f"uid {os.geteuid()}, as its runner"
        log.info(
            "function %s runs in process %d (%s) as %s: %s",
            name,
            child.process.pid,
            child.device,
            who,
            ", ".join(limits_text),
        )
        return child

    @classmethod
    def _spawn(
        cls,
        name: str,
        version: str,
        workdir: WorkingFolder,
        cgroup: FunctionCgroup | None,
        passed: list[int],
        environment: dict[str, str],
    ) -> _Child:
        env = sandbox.clean_environment(os.environ) | environment
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
        env["TMPDIR"] = str(workdir.path)
        prints, prints_write = os.pipe()
        passed.append(prints_write)
        try:
            # Never a fork of the runner: a fresh interpreter holds none of its sockets, threads or
            # loop. Under a root runner it starts as root and becomes its user itself (runner.confinement).
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "runner.sandbox",
                    *("--function", name, "--parent", str(os.getpid()), "--prints", str(prints_write)),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir.path,
                env=env,
                start_new_session=True,
                pass_fds=passed,
            )
        finally:
            for fd in passed:
                os.close(fd)
        assert process.stderr is not None
        stderr = os.dup(process.stderr.fileno())
        process.stderr.close()
        output = Output(name, version, {"stdout": prints, "stderr": stderr})
        output.start()
        return cls(process, workdir, output, cgroup)

    def _load(self, name: str, load: dict[str, Any], user: tuple[int, int] | None) -> sandbox.Header:
        """Place the process (its cgroups), hand it its function and confinement, and wait for it."""
        try:
            if self.cgroup is not None:
                self.cgroup.add(self.process.pid)  # before it loads anything of the function's
            deadline = time.monotonic() + START_TIMEOUT_S
            sandbox.send(self.requests, load, (), deadline)
            header, _body = sandbox.receive(self.replies, deadline)
        except (TimeoutError, sandbox.ChannelClosed, OSError) as exc:
            self.stop(graceful=False)
            if isinstance(exc, TimeoutError):
                detail = f"did not start within {START_TIMEOUT_S:.0f} s"
            else:
                detail = f"exited while starting: {_describe_exit(self.process.returncode)}"
            if user is not None:
                detail += f" (as uid {user[0]}; its output is in the runner's log)"
            raise ModelFailed(f"function '{name}': its process {detail}") from None
        if "error" in header:
            self.stop(graceful=False)
            if header.get("code") == "model_failed":
                shown = Confinement.decode(load["confinement"]).shown
                why = (
                    f" ({_SHOWN_FAILED.format(uid=user[0], paths=', '.join(shown))})"
                    if user and shown
                    else ""
                )
                raise ModelFailed(f"function '{name}': {header['error']}{why}")
            raise InvalidArgument(header["error"])
        return header

    def rss_bytes(self) -> int:
        return budget.rss_bytes(self.process.pid)

    def at_memory_limit(self) -> bool:
        """It is running, and its memory cgroup's use has reached the limit."""
        return self.cgroup is not None and self.cgroup.at_limit()

    def out_of_memory(self) -> bool:
        """The kernel stopped it at its memory cgroup's limit."""
        if self._out_of_memory is None:
            return self.cgroup is not None and self.cgroup.out_of_memory()
        return self._out_of_memory

    def stop(self, graceful: bool) -> None:
        """Graceful: close its stdin (it calls Model.close and exits), kill it if it takes longer
        than STOP_TIMEOUT_S. Else kill it now. Either way wait for it, kill whatever it started
        (its cgroup, else its process group), log the rest of its output and remove its working
        folder and cgroups."""
        if not graceful:
            self._kill()
        for pipe in self._pipes:
            pipe.close()
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill()
            self.process.wait()
        if self.cgroup is not None:
            self.cgroup.kill()
        else:
            with contextlib.suppress(OSError):  # its session's leader: the group is still its own
                os.killpg(self.process.pid, signal.SIGKILL)
        self.output.join(OUTPUT_DRAIN_S)
        self.workdir.remove()
        if self.cgroup is not None:
            self._out_of_memory = self.cgroup.out_of_memory()
            self.cgroup.remove()

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)


_SHOWN_FAILED = (
    "uid {uid} cannot reach this runner's Python at {paths}, and it could not be shown to the "
    "function's process: a function's process never runs as uid 0; install Python where other users "
    "can read it, or run the runner as a plain user"
)
_USER: list[tuple[int, int] | None] = []


def _function_user() -> tuple[int, int] | None:
    """FUNCTION_UID for a root runner (decided once; raises ModelFailed where that user could not
    run this runner's Python even shown to it), else None."""
    if not _USER:
        user = confinement.function_user()
        shown = confinement.hidden([*confinement.python_paths(), *CODE]) if user is not None else []
        if shown:
            log.info(
                "uid %d cannot reach this runner's Python (%s): each function process is shown it in "
                "a mount namespace of its own",
                confinement.FUNCTION_UID,
                ", ".join(shown),
            )
        closed = confinement.unshowable(shown)
        if closed:
            raise ModelFailed(
                f"Python functions are refused: uid {confinement.FUNCTION_UID} cannot read "
                f"{', '.join(closed)} (not readable by others), and a function's process never runs as uid 0"
            )
        _USER.append(user)
    return _USER[0]


def prepare() -> None:
    """At a runner's start: kill and remove what runners that died left (processes, cgroups,
    working folders), and say what will hold its function processes, as a warning where something
    is not held. Blocking."""
    killed, removed = reap_cgroups()
    folders = reap_folders()
    if killed or removed or folders:
        log.warning(
            "removed what runners that are gone left: %d processes killed, %d cgroups and %d runner "
            "folders removed",
            killed,
            removed,
            folders,
        )
    user = confinement.function_user()
    shown = confinement.hidden([*confinement.python_paths(), *CODE]) if user is not None else []
    closed = confinement.unshowable(shown)
    if user is None:
        who = f"as uid {os.geteuid()}, the runner's (a user of their own needs a root runner)"
    elif closed:
        who = (
            f"nowhere: Python functions are refused, as uid {user[0]} cannot read {', '.join(closed)} "
            "and a function's process never runs as uid 0"
        )
    elif shown:
        python = ", ".join(shown)
        who = f"as uid {user[0]}, shown the runner's Python ({python}) in mount namespaces of their own"
    else:
        who = f"as uid {user[0]}"
    layout = current_layout()
    _base, unmounted = runner_folder()
    folder = "working folders on tmpfs" if not unmounted else f"working folders not capped: {unmounted}"
    degraded = bool(closed or layout.missing or unmounted or user is None)
    log.log(
        logging.WARNING if degraded else logging.INFO,
        "Python function processes run %s; %s; %s",
        who,
        layout.describe(),
        folder,
    )


def _describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "stopped answering"
    if returncode < 0:
        try:
            return f"was killed by signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"
