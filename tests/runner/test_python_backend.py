"""The python backend with real child processes: round trips, crashes, timeouts, memory limits and
the environment a function sees."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from fngate.errors import InvalidArgument, ModelFailed, ModelTimeout, Unavailable
from fngate.manifest import load_manifest, parse_manifest
from runner import cgroup, gpu, sandbox, workdir
from runner.backends import load_backend
from runner.backends.providers import Acceleration
from runner.backends.python import PythonBackend

ROOT = Path(__file__).resolve().parents[2]
STEERED = '''
import json, os, time
from pathlib import Path
import numpy as np


class Model:
    """y = 2x; x[0, 0] steers it: -1 raises, -2 exits with code 3, -3 never returns, -4 keeps
    100 MiB, -5 prints what the process sees (JSON, one line), -6 writes garbage where its answers
    go (fd 3: stdout as the process found it)."""

    def __init__(self, directory):
        self.directory = directory
        self.kept = []

    def infer(self, inputs):
        x = inputs["x"]
        first = x[0, 0]
        if first == -1:
            raise ValueError("asked to fail")
        if first == -2:
            os._exit(3)
        if first == -3:
            while True:
                time.sleep(1)
        if first == -4:
            self.kept.append(np.ones(25 * 2**20, dtype=np.float32))
        if first == -6:
            os.write(3, b"\\xff" * 64)
        if first == -5:
            view = {"environ": dict(os.environ), "cwd": os.getcwd(), "ppid": os.getppid()}
            print(json.dumps(view))
        return {"y": x * 2}
'''


X = {"name": "x", "datatype": "FP32", "shape": [-1, 4]}
Y = {"name": "y", "datatype": "FP32", "shape": [-1, 4]}


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[Callable[..., PythonBackend]]:
    """Factory: a PythonBackend of the steered model (or `source`), closed at the end."""
    started: list[PythonBackend] = []
    folders = iter(range(100))

    def start(
        source: str = STEERED,
        accel: Acceleration | None = None,
        tensors: tuple[dict[str, Any], dict[str, Any]] = (X, Y),
        **model: Any,
    ) -> PythonBackend:
        folder = tmp_path / f"f{next(folders)}"
        folder.mkdir()
        (folder / "model.py").write_text(source)
        manifest = parse_manifest(
            {
                "name": "f",
                "model": {"backend": "python", "path": "model.py", **model},
                "inputs": [tensors[0]],
                "outputs": [tensors[1]],
            },
            "f.yaml",
        )
        started.append(PythonBackend(manifest, folder, accel))
        return started[-1]

    yield start
    for item in started:
        item.close()


def batch(first: float, rows: int = 2) -> dict[str, np.ndarray[Any, Any]]:
    x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    x[0, 0] = first
    return {"x": x}


def printed_lines(caplog: pytest.LogCaptureFixture, timeout_s: float = 10) -> list[dict[str, Any]]:
    """The fields of the function output records logged so far, once there is one (the lines are
    read from the process's pipes by a thread of their own)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [record.__dict__["fields"] for record in caplog.records if record.name == "runner.function"]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def restarts(reason: str) -> float:
    return (
        REGISTRY.get_sample_value("fngate_function_restarts_total", {"function": "f", "reason": reason}) or 0
    )


def test_runs_batches_in_a_process_of_its_own(backend: Callable[..., PythonBackend]) -> None:
    python = backend()
    assert python.pid is not None and python.pid != os.getpid()
    inputs = batch(5.0, rows=300)
    outputs = python.run(inputs, ["y"])
    np.testing.assert_array_equal(outputs["y"], inputs["x"] * 2)
    assert outputs["y"].dtype == np.float32


def test_an_exception_fails_the_batch_and_keeps_the_process(backend: Callable[..., PythonBackend]) -> None:
    python = backend()
    pid = python.pid
    with pytest.raises(ModelFailed, match="function 'f' failed: ValueError: asked to fail"):
        python.run(batch(-1.0), ["y"])
    assert python.pid == pid
    np.testing.assert_array_equal(python.run(batch(1.0), ["y"])["y"], batch(1.0)["x"] * 2)


def test_a_process_that_exits_fails_its_batch_and_starts_again(backend: Callable[..., PythonBackend]) -> None:
    python = backend()
    pid = python.pid
    before = restarts("exited")
    with pytest.raises(ModelFailed, match="its process exited with code 3 while running the batch"):
        python.run(batch(-2.0), ["y"])
    assert python.pid is None
    assert restarts("exited") == before + 1
    np.testing.assert_array_equal(python.run(batch(1.0), ["y"])["y"], batch(1.0)["x"] * 2)
    assert python.pid not in (None, pid)


def test_the_backoff_grows_and_a_batch_that_cannot_wait_it_out_fails_at_once(
    backend: Callable[..., PythonBackend],
) -> None:
    python = backend(execution_timeout_ms=300)
    for _ in range(3):  # each waits out the backoff (0.1 s, then 0.2 s), starts a process, kills it
        with pytest.raises(ModelFailed, match="its process exited with code 3 while running the batch"):
            python.run(batch(-2.0), ["y"])
    # 0.4 s now, longer than the batch may take
    with pytest.raises(ModelFailed, match=r"its process exited with code 3; it starts again in 0\.\d s"):
        python.run(batch(1.0), ["y"])
    assert python.pid is None


def test_a_process_that_writes_garbage_is_restarted(backend: Callable[..., PythonBackend]) -> None:
    python = backend()
    before = restarts("protocol")
    with pytest.raises(ModelFailed, match="its process wrote what is not an answer"):
        python.run(batch(-6.0), ["y"])
    assert restarts("protocol") == before + 1
    np.testing.assert_array_equal(python.run(batch(1.0), ["y"])["y"], batch(1.0)["x"] * 2)


def test_a_batch_past_the_execution_timeout_stops_the_process(backend: Callable[..., PythonBackend]) -> None:
    python = backend(execution_timeout_ms=300)
    pid = python.pid
    assert pid is not None
    with pytest.raises(ModelTimeout, match="ran past its execution timeout of 300 ms"):
        python.run(batch(-3.0), ["y"])
    assert not Path(f"/proc/{pid}").exists()
    np.testing.assert_array_equal(python.run(batch(1.0), ["y"])["y"], batch(1.0)["x"] * 2)


def test_a_batch_past_the_memory_limit_fails_naming_it(backend: Callable[..., PythonBackend]) -> None:
    python = backend(memory_limit_mb=80)
    with pytest.raises(ModelFailed, match="the batch needed more memory than its memory_limit_mb of 80 MiB"):
        python.run(batch(-4.0), ["y"])  # 100 MiB kept within the one batch: stopped there
    np.testing.assert_array_equal(python.run(batch(1.0), ["y"])["y"], batch(1.0)["x"] * 2)


def test_the_process_sees_no_secrets_and_works_in_its_own_folder(
    backend: Callable[..., PythonBackend], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="runner.function")
    monkeypatch.setenv("FNGATE_REDIS_URL", "redis://:hunter2@redis:6379/0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    monkeypatch.setenv("SERVICE_API_TOKEN", "token")
    monkeypatch.setenv("MODEL_SETTING", "visible")
    python = backend()
    python.run(batch(-5.0), ["y"])
    printed = printed_lines(caplog)
    view = json.loads(printed[-1]["line"])
    assert printed[-1]["function"] == "f" and printed[-1]["stream"] == "stdout"
    leaked = [name for name in view["environ"] if name.startswith(("FNGATE_", "AWS_")) or "TOKEN" in name]
    assert leaked == []
    assert "hunter2" not in json.dumps(view["environ"])
    assert view["environ"]["MODEL_SETTING"] == "visible"
    assert view["ppid"] == os.getpid()
    assert Path(view["cwd"]) != Path.cwd()
    assert Path(view["environ"]["TMPDIR"]) == Path(view["cwd"])


def test_a_model_that_does_not_load_names_the_reason(backend: Callable[..., PythonBackend]) -> None:
    with pytest.raises(InvalidArgument, match="ZeroDivisionError"):
        backend("class Model:\n    def __init__(self, directory):\n        1 / 0\n")
    with pytest.raises(InvalidArgument, match="defines no class Model"):
        backend("x = 1\n")


def test_close_stops_the_process(backend: Callable[..., PythonBackend]) -> None:
    python = backend()
    pid = python.pid
    python.close()  # returns at once; the process exits after Model.close
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()
    with pytest.raises(ModelFailed, match="unloaded"):
        python.run(batch(1.0), ["y"])


@pytest.mark.parametrize(
    ("accelerator", "visible", "index", "sees"),
    [
        ("cuda", "3,5", 1, "5"),  # the runner's GPU 1 is the machine's 5: the child's 0 (no NVML here)
        ("cuda", None, 0, "0"),
        ("cpu", "3,5", 1, "3,5"),  # a CPU function's process is left as it was
    ],
)
def test_a_cuda_function_is_given_the_runners_gpu(
    backend: Callable[..., PythonBackend],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    accelerator: str,
    visible: str | None,
    index: int,
    sees: str,
) -> None:
    if isinstance(gpu.find_device(index), gpu.Device):
        pytest.skip("NVML sees a GPU here: the child is given its UUID (tests/runner/test_gpu_memory.py)")
    caplog.set_level(logging.INFO, logger="runner.function")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    python = backend(accel=Acceleration(device_index=index), accelerator=accelerator)
    python.run(batch(-5.0), ["y"])
    view = json.loads(printed_lines(caplog)[-1]["line"])
    assert view["environ"]["CUDA_VISIBLE_DEVICES"] == sees
    assert (python.device, python.device_memory_bytes) == ("python", 0)
    if accelerator == "cuda":  # the steered Model names no device: it runs on the CPU, and that is said
        assert python.fallback_reason == "its Model runs on 'cpu', not on the GPU"
    else:
        assert python.fallback_reason is None


GPU_MLP = ROOT / "functions" / "gpu-mlp"


def test_the_gpu_example_answers_on_the_cpu_without_a_gpu_and_says_so() -> None:
    """functions/gpu-mlp through the runner's backend (its own process) gives what its code gives
    called directly, here on the CPU (numpy) with the reason; a runner that requires the
    accelerator refuses it."""
    manifest = load_manifest(GPU_MLP / "function.yaml")
    assert manifest.model.accelerator == "cuda"
    direct = sandbox.load_model(GPU_MLP / "model.py", GPU_MLP)
    if direct.device == "cuda":
        pytest.skip("CuPy sees a GPU here: tests/runner/test_gpu_python.py covers it")
    python = load_backend(manifest, GPU_MLP, 1, Acceleration())
    try:
        assert isinstance(python, PythonBackend)
        assert python.device == "python"
        assert python.fallback_reason == direct.fallback_reason
        assert python.fallback_reason is not None and python.fallback_reason.startswith(
            ("CuPy is not installed", "CUDA sees no GPU")
        )
        for rows in (1, 3, 64):
            x = {"input": np.random.default_rng(rows).standard_normal((rows, 256), dtype=np.float32)}
            np.testing.assert_array_equal(python.run(x, ["output"])["output"], direct.infer(x)["output"])
    finally:
        python.close()
    refused = r"asks for accelerator cuda and this runner requires it.*(CuPy|CUDA)"
    with pytest.raises(Unavailable, match=refused):
        load_backend(manifest, GPU_MLP, 1, Acceleration(require=True))


ESCAPEE = (ROOT / "tests" / "functions" / "escapee" / "model.py").read_text()
ESCAPEE_TENSORS = (
    {"name": "x", "datatype": "FP32", "shape": [-1, 2]},
    {"name": "y", "datatype": "BYTES", "shape": [-1, 1]},
)
"""tests/functions/escapee: x[0, 0] says what it tries, x[0, 1] how much."""
needs_cgroups = pytest.mark.skipif(
    cgroup.current_layout().kill is None or cgroup.current_layout().pids is None,
    reason=f"no cgroup kill and pids.max here: {cgroup.current_layout().describe()}",
)


def escapee(what: int, size: float = 0, rows: int = 1) -> dict[str, np.ndarray[Any, Any]]:
    return {"x": np.array([[what, size]] * rows, dtype=np.float32)}


def answer(outputs: dict[str, np.ndarray[Any, Any]]) -> Any:
    return json.loads(outputs["y"][0, 0])


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for whoever adopted it to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone(pids: list[int], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(pid) for pid in pids)


def descendants(pid: int) -> list[int]:
    """Live processes below `pid` (children, theirs, ...)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return [child for child in found if alive(child)]


@needs_cgroups
def test_a_daemon_a_function_starts_goes_with_its_unload(backend: Callable[..., PythonBackend]) -> None:
    python = backend(ESCAPEE, tensors=ESCAPEE_TENSORS)
    daemon = int(python.run(escapee(1), ["y"], [1])["y"][0, 0])
    assert alive(daemon) and daemon not in descendants(python.pid or 0)  # out of its process's tree
    python.close()
    assert gone([daemon])


@needs_cgroups
def test_forks_stop_at_pids_limit_and_the_process_starts_again_without_them(
    backend: Callable[..., PythonBackend],
) -> None:
    python = backend(ESCAPEE, tensors=ESCAPEE_TENSORS, pids_limit=16)
    pid = python.pid
    assert pid is not None
    with pytest.raises(ModelFailed) as failed:
        python.run(escapee(2, 10_000), ["y"], [1])
    forked = int(re.search(r"forked (\d+) processes, then", failed.value.message).group(1))  # type: ignore[union-attr]
    assert forked < 16
    assert "its processes reached its pids_limit of 16: they were stopped" in failed.value.message
    assert gone([pid])  # and every process it forked with it
    assert descendants(pid) == []
    assert python.run(escapee(0), ["y"], [1])["y"][0, 0] == b"ok"  # a new process, not held by them
    assert python.pid != pid


def test_the_working_folder_is_capped(backend: Callable[..., PythonBackend]) -> None:
    if workdir.runner_folder()[1]:
        pytest.skip(f"working folders are not tmpfs here: {workdir.runner_folder()[1]}")
    python = backend(ESCAPEE, tensors=ESCAPEE_TENSORS, working_folder_limit_mb=8)
    filled = answer(python.run(escapee(4, 2048), ["y"], [1]))  # tries 2 GiB
    assert filled["written"] <= 8 * 2**20
    assert filled["error"] == "OSError: [Errno 28] No space left on device"


def test_the_process_reaches_no_secret_keyring_namespace_or_host_socket(
    backend: Callable[..., PythonBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever runs the runner: uid 65534 under root (never uid 0), the seccomp filter for all."""
    place = Path(tempfile.mkdtemp(prefix="fngate-host-"))
    place.chmod(0o755)
    host = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    host.bind(str(place / "host.sock"))
    (place / "host.sock").chmod(0o777)  # any user may write to it: only the filter stands between
    monkeypatch.setenv("ESCAPEE_SOCKET", str(place / "host.sock"))
    try:
        python = backend(ESCAPEE, tensors=ESCAPEE_TENSORS)
        report = answer(python.run(escapee(5), ["y"], [1]))
        host.setblocking(False)
        with pytest.raises(BlockingIOError):
            host.recv(64)
    finally:
        host.close()
        shutil.rmtree(place)
    assert report == {
        "read /etc/shadow": "refused: PermissionError: [Errno 13] Permission denied: '/etc/shadow'",
        "join a session keyring": "refused: PermissionError: [Errno 1] Operation not permitted",
        "unshare a user namespace": "refused: PermissionError: [Errno 1] Operation not permitted",
        "send a datagram to the host's socket": "refused: PermissionError: [Errno 1] Operation not permitted",
    }


def test_an_answer_past_max_output_bytes_is_refused_and_the_process_stays(
    backend: Callable[..., PythonBackend],
) -> None:
    python = backend(ESCAPEE, tensors=ESCAPEE_TENSORS, max_output_bytes=1000)
    pid = python.pid
    assert python.run(escapee(3, 990), ["y"], [1])["y"][0, 0] == b"x" * 990  # 994 bytes as sent
    with pytest.raises(ModelFailed) as failed:
        python.run(escapee(3, 2000), ["y"], [1])
    assert failed.value.message == (
        "function 'f': the outputs of this invocation are 2004 bytes, over its max_output_bytes of 1000"
    )
    with pytest.raises(
        ModelFailed, match="the outputs of the batch are 6012 bytes, over the 3000 its 3 invocations"
    ):
        python.run(escapee(3, 2000, rows=3), ["y"], [1, 1, 1])
    assert python.pid == pid


def test_a_process_that_sends_1_gib_past_its_own_check_is_stopped_unread(
    backend: Callable[..., PythonBackend],
) -> None:
    """The runner reads an answer's size first, and never makes room for more than max_output_bytes
    an invocation: its peak memory stays where it was."""
    python = backend(ESCAPEE, tensors=ESCAPEE_TENSORS, execution_timeout_ms=30_000)
    pid = python.pid
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
    before = peak_rss_bytes()
    with pytest.raises(ModelFailed) as failed:
        python.run(escapee(6, 1024), ["y"], [1])
    assert peak_rss_bytes() - before < 64 * 2**20
    assert failed.value.message == (
        "function 'f': its process answered 1073741824 bytes of outputs, over the 67108864 its 1 "
        "invocation(s) may have (max_output_bytes 67108864 each); it was stopped and starts again for "
        "the next batch"
    )
    assert gone([pid]) and restarts("output") >= 1


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")
