"""The pytorch backend for real: TorchScript models saved by torch in the test (weights made here),
in a Triton repository as Triton's pytorch_libtorch backend takes them, served by a real runner
process of the environment with torch (.venv/torch, made by scripts/bootstrap from
requirements/torch.txt) and called with tritonclient over HTTP and gRPC; each answer is the one torch
itself gives for the same rows. A runner without torch says what it needs."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from fngate.process import stop_processes
from tests.conftest import ROOT, child_env, free_port, wait_http
from tests.e2e import deployments
from tests.triton_repository import model

TORCH_PYTHON = ROOT / ".venv" / "torch" / "bin" / "python"

# forward(x, scale) -> (relu(linear(x)) * scale, the sum of x's row), as Triton's INPUT__0,
# INPUT__1 -> OUTPUT__0, OUTPUT__1. The script saves the model, then answers the rows in x.npy and
# scale.npy with torch itself.
MAKE = """
import sys

import numpy as np
import torch


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor):
        return torch.relu(self.linear(x)) * scale, x.sum(dim=1, keepdim=True)


path, folder = sys.argv[1], sys.argv[2]
torch.jit.script(Model()).save(path)
loaded = torch.jit.load(path)
with torch.inference_mode():
    x, scale = np.load(folder + "/x.npy"), np.load(folder + "/scale.npy")
    y, total = loaded(torch.from_numpy(x), torch.from_numpy(scale))
np.save(folder + "/y.npy", y.numpy())
np.save(folder + "/total.npy", total.numpy())
"""

INDEXED = """
name: "torch_model"
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT__1" data_type: TYPE_FP32 dims: [ 1 ] }
]
output [
  { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] },
  { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 1 ] }
]
dynamic_batching { }
"""

# The same model, its inputs named as forward's arguments and listed in the other order.
NAMED = """
name: "torch_named"
backend: "pytorch"
max_batch_size: 8
input [
  { name: "scale" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "x" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 1 ] },
  { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] }
]
"""

# The indexed model again, in a process of its own.
OWN_PROCESS = INDEXED.replace('"torch_model"', '"torch_own"') + (
    'parameters { key: "fngate_own_process" value: { string_value: "true" } }'
)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The TorchScript model, its inputs and what torch answers them, made once for the module (torch
    takes seconds to import)."""
    if not TORCH_PYTHON.exists():
        pytest.skip("no .venv/torch: scripts/bootstrap makes it (requirements/torch.txt)")
    folder = tmp_path_factory.mktemp("torch-made")
    rows = np.random.default_rng(3)
    np.save(folder / "x.npy", rows.normal(size=(16, 4)).astype(np.float32))
    np.save(folder / "scale.npy", rows.uniform(0.5, 2.0, size=(16, 1)).astype(np.float32))
    (folder / "make.py").write_text(MAKE)
    subprocess.run(
        [str(TORCH_PYTHON), str(folder / "make.py"), str(folder / "model.pt"), str(folder)],
        check=True,
        timeout=120,
    )
    return folder


@pytest.fixture
def torch_repository(made: Path, tmp_path: Path) -> Path:
    """A repository of three models of that TorchScript file (as Triton configures them), and its
    inputs and answers in tmp_path."""
    for name in ("x.npy", "scale.npy", "y.npy", "total.npy"):
        shutil.copy(made / name, tmp_path / name)
    root = tmp_path / "models"
    for name, config in (("torch_model", INDEXED), ("torch_named", NAMED), ("torch_own", OWN_PROCESS)):
        folder = model(root, name, config, {"1": {}})
        shutil.copy(made / "model.pt", folder / "1" / "model.pt")
    return root


@pytest.fixture
def torch_runner(redis_url: str, tmp_path: Path) -> Iterator[Callable[[Path], None]]:
    """Start `python -m runner` from the environment with torch."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(repo: Path) -> None:
        env = child_env(redis_url, repo, FNGATE_ARTIFACT_DIR=str(tmp_path / "artifacts"))
        with open(tmp_path / "torch-runner.log", "wb") as log:
            processes.append(
                subprocess.Popen(
                    [str(TORCH_PYTHON), "-m", "runner"],
                    env=env,
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )

    yield start
    stop_processes(processes)


def inputs_of(x: np.ndarray, scale: np.ndarray, order: tuple[str, str]) -> list[Any]:
    inputs = [triton_http.InferInput(order[0], list(x.shape), "FP32")]
    inputs.append(triton_http.InferInput(order[1], list(scale.shape), "FP32"))
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(scale)
    return inputs


def call_http(
    url: str,
    name: str,
    x: np.ndarray,
    scale: np.ndarray,
    order: tuple[str, str],
    spans: list[tuple[int, int]],
) -> list[dict[str, Any]]:
    """The model's answers to the rows of each span, all sent at once (tritonclient's async_infer)."""
    with triton_http.InferenceServerClient(url.removeprefix("http://"), concurrency=len(spans)) as client:
        sent = [client.async_infer(name, inputs_of(x[a:b], scale[a:b], order)) for a, b in spans]
        answers = [request.get_result() for request in sent]
    return [{"y": answer.as_numpy("OUTPUT__0"), "total": answer.as_numpy("OUTPUT__1")} for answer in answers]


async def test_a_torchscript_model_answers_as_torch_does(
    serve_gateway: Callable[..., Any],
    torch_runner: Callable[[Path], None],
    torch_repository: Path,
    tmp_path: Path,
) -> None:
    """Sixteen calls of one or two rows at once (batched together), over HTTP, then over gRPC, to
    both models: each answer is torch's own for its rows."""
    x, scale = np.load(tmp_path / "x.npy"), np.load(tmp_path / "scale.npy")
    y, total = np.load(tmp_path / "y.npy"), np.load(tmp_path / "total.npy")
    port = free_port()
    base = await serve_gateway(repo=str(torch_repository), grpc_port=port)
    torch_runner(torch_repository)
    # The first call waits for the runner to start and load the model (torch's import: seconds).
    indexed = ("INPUT__0", "INPUT__1")
    first = await asyncio.to_thread(call_http, base, "torch_model", x, scale, indexed, [(0, 1)])
    np.testing.assert_allclose(first[0]["y"], y[:1], rtol=1e-5, atol=1e-6)

    spans = [(at, at + 1 + at % 2) for at in range(0, 15)]
    for name, order in (("torch_model", indexed), ("torch_named", ("x", "scale"))):
        answers = await asyncio.to_thread(call_http, base, name, x, scale, order, spans)
        for (start, end), answer in zip(spans, answers, strict=True):
            np.testing.assert_allclose(answer["y"], y[start:end], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(answer["total"], total[start:end], rtol=1e-5, atol=1e-6)

    def over_grpc() -> Any:
        with triton_grpc.InferenceServerClient(f"127.0.0.1:{port}") as client:
            inputs = [
                triton_grpc.InferInput("INPUT__0", [4, 4], "FP32"),
                triton_grpc.InferInput("INPUT__1", [4, 1], "FP32"),
            ]
            inputs[0].set_data_from_numpy(x[4:8])
            inputs[1].set_data_from_numpy(scale[4:8])
            return client.infer("torch_model", inputs).as_numpy("OUTPUT__0")

    np.testing.assert_allclose(await asyncio.to_thread(over_grpc), y[4:8], rtol=1e-5, atol=1e-6)

    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        config = (await client.get("/v2/models/torch_model/config")).json()
        assert config["platform"] == "pytorch_libtorch" and config["default_model_filename"] == "model.pt"


async def test_a_runner_without_torch_says_what_it_needs(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], torch_repository: Path
) -> None:
    """This process's runner has no torch (the suite's environment): the model's call fails with
    what to install, and the runner serves on."""
    pytest.importorskip("onnxruntime")
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is importable here: this runner could serve the model")
    base = await serve_gateway(repo=str(torch_repository))
    await inprocess_runner(repo=str(torch_repository))
    x = np.zeros((1, 4), dtype=np.float32)
    scale = np.ones((1, 1), dtype=np.float32)
    with pytest.raises(InferenceServerException, match=r"needs torch .*fngate\[torch\]"):
        await asyncio.to_thread(call_http, base, "torch_model", x, scale, ("INPUT__0", "INPUT__1"), [(0, 1)])


def sandbox_of(function: str) -> int | None:
    """The pid of the process a runner started for `function` (runner.sandbox), if any."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"runner.sandbox" in arguments and function.encode() in arguments:
            return int(entry.name)
    return None


async def test_a_torchscript_model_in_its_own_process_answers_and_its_crash_spares_the_runner(
    serve_gateway: Callable[..., Any],
    torch_runner: Callable[[Path], None],
    torch_repository: Path,
    tmp_path: Path,
) -> None:
    """With fngate_own_process the model runs in a process of the runner's (runner.sandbox),
    answering as torch does; killed, it takes no one else with it: the model in the runner's own
    process answers on, and the next call starts it again."""
    x, scale = np.load(tmp_path / "x.npy"), np.load(tmp_path / "scale.npy")
    y = np.load(tmp_path / "y.npy")
    base = await serve_gateway(repo=str(torch_repository))
    torch_runner(torch_repository)
    indexed = ("INPUT__0", "INPUT__1")
    spans = [(at, at + 1 + at % 2) for at in range(0, 15)]
    answers = await asyncio.to_thread(call_http, base, "torch_own", x, scale, indexed, spans)
    for (start, end), answer in zip(spans, answers, strict=True):
        np.testing.assert_allclose(answer["y"], y[start:end], rtol=1e-5, atol=1e-6)
    pid = sandbox_of("torch-own")
    assert pid is not None, "no process of its own"
    os.kill(pid, signal.SIGKILL)
    beside = await asyncio.to_thread(call_http, base, "torch_model", x, scale, indexed, [(0, 2)])
    np.testing.assert_allclose(beside[0]["y"], y[0:2], rtol=1e-5, atol=1e-6)
    # A batch that meets the killed process fails, saying so; the next one starts it again.
    try:
        await asyncio.to_thread(call_http, base, "torch_own", x, scale, indexed, [(3, 5)])
    except InferenceServerException as exc:
        assert re.search(r"its process was killed by signal 9 .*starts again", str(exc)), str(exc)
    again = await asyncio.to_thread(call_http, base, "torch_own", x, scale, indexed, [(3, 5)])
    np.testing.assert_allclose(again[0]["y"], y[3:5], rtol=1e-5, atol=1e-6)
    assert sandbox_of("torch-own") not in (None, pid)


async def test_fngate_up_runs_its_runners_with_the_python_given(
    torch_repository: Path, tmp_path: Path
) -> None:
    """`fngate up --runner-python .venv/torch/bin/python`: the suite's environment has no torch, the
    one given has; fngate up's runners start in it and answer as torch does."""
    x, scale = np.load(tmp_path / "x.npy"), np.load(tmp_path / "scale.npy")
    y = np.load(tmp_path / "y.npy")
    port = free_port()
    up = deployments.start_up(torch_repository, port, tmp_path, "--runner-python", str(TORCH_PYTHON))
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_http(base, timeout_s=60)
        spans = [(0, 1), (1, 4), (4, 6)]
        answers = await asyncio.to_thread(
            call_http, base, "torch_model", x, scale, ("INPUT__0", "INPUT__1"), spans
        )
        for (start, end), answer in zip(spans, answers, strict=True):
            np.testing.assert_allclose(answer["y"], y[start:end], rtol=1e-5, atol=1e-6)
    finally:
        stop_processes([up])
    log = (tmp_path / "up.log").read_text()
    assert "needs torch" not in log, log[-3000:]
