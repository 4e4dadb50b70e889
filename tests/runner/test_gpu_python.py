"""A Python function on the GPU (functions/gpu-mlp, CuPy), marked `gpu`: its process is given the
runner's GPU by UUID, answers as the same code called directly, holds GPU memory that NVML counts
for its process, and gives it back when the runner unloads it (its process ends)."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest

from fngate.manifest import load_manifest
from runner import gpu, sandbox
from runner.backends import load_backend
from runner.backends.providers import Acceleration
from runner.backends.python import PythonBackend
from tests.runner.gpu_support import require_gpu

ROOT = Path(__file__).resolve().parents[2]
GPU_MLP = ROOT / "functions" / "gpu-mlp"
SEES = """
import json, os
from pathlib import Path


class Model:
    device = "cuda"

    def __init__(self, directory):
        (directory / "sees.json").write_text(json.dumps(os.environ.get("CUDA_VISIBLE_DEVICES")))

    def infer(self, inputs):
        return {"y": inputs["x"]}
"""


def require_cupy() -> gpu.Device:
    device = require_gpu()
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("needs cupy (the GPU machine's image has it)")
    return device


@pytest.mark.gpu
def test_the_gpu_example_runs_on_the_runners_gpu_and_gives_its_memory_back() -> None:
    require_cupy()
    manifest = load_manifest(GPU_MLP / "function.yaml")
    direct = sandbox.load_model(GPU_MLP / "model.py", GPU_MLP)
    assert direct.device == "cuda", direct.fallback_reason
    python = load_backend(manifest, GPU_MLP, 1, Acceleration(require=True))
    assert isinstance(python, PythonBackend)
    pid = python.pid
    assert pid is not None
    try:
        assert (python.device, python.fallback_reason) == ("python:cuda", None)
        assert python.device_memory_bytes > 0
        reading = gpu.read_memory(0, pid)
        assert reading is not None
        for rows in (1, 5, 1024):
            x = {"input": np.random.default_rng(rows).standard_normal((rows, 256), dtype=np.float32)}
            np.testing.assert_allclose(
                python.run(x, ["output"])["output"], direct.infer(x)["output"], rtol=1e-5, atol=1e-5
            )
    finally:
        python.close()
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()
    after = gpu.read_memory(0, pid)
    assert after is not None and after.process_bytes is None  # NVML counts nothing for it any more


@pytest.mark.gpu
def test_the_functions_process_sees_the_runners_gpu_by_uuid(tmp_path: Path) -> None:
    device = require_gpu()
    folder = tmp_path / "sees"
    folder.mkdir()
    (folder / "model.py").write_text(SEES)
    (folder / "function.yaml").write_text(
        json.dumps(
            {
                "name": "sees",
                "model": {"backend": "python", "path": "model.py", "accelerator": "cuda"},
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}],
            }
        )
    )
    python = load_backend(load_manifest(folder / "function.yaml"), folder, 1, Acceleration())
    try:
        assert json.loads((folder / "sees.json").read_text()) == device.uuid
    finally:
        python.close()
