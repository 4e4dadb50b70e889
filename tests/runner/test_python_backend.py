"""The python backend with real child processes: round trips, crashes, timeouts, memory limits and
the environment a function sees."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from fngate.errors import InvalidArgument, ModelFailed, ModelTimeout, Unavailable
from fngate.manifest import load_manifest, parse_manifest
from runner import gpu, sandbox
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


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[Callable[..., PythonBackend]]:
    """Factory: a PythonBackend of the steered model (or `source`), closed at the end."""
    started: list[PythonBackend] = []
    folders = iter(range(100))

    def start(source: str = STEERED, accel: Acceleration | None = None, **model: Any) -> PythonBackend:
        folder = tmp_path / f"f{next(folders)}"
        folder.mkdir()
        (folder / "model.py").write_text(source)
        manifest = parse_manifest(
            {
                "name": "f",
                "model": {"backend": "python", "path": "model.py", **model},
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
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
