"""What the GPU tests share: the GPU or a skip that says why (a failure where REQUIRE_GPU=1, as
scripts/gpu_check.py sets it), TensorRT or a skip ("needs tensorrt": a GPU machine may well lack
it), and function folders made from the example classifier."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fngate.manifest import FunctionManifest, load_manifest
from runner import gpu

ROOT = Path(__file__).resolve().parents[2]
CLASSIFIER = ROOT / "functions" / "classifier"


def require_gpu() -> gpu.Device:
    device = gpu.find_device(0)
    if isinstance(device, gpu.NoDevice):
        if os.environ.get("REQUIRE_GPU") == "1":
            pytest.fail(f"REQUIRE_GPU=1 but there is no GPU: {device.reason}")
        pytest.skip(f"no NVIDIA GPU: {device.reason}")
    return device


def require_tensorrt() -> gpu.Device:
    """The GPU, and TensorRT's Python package beside it, or a skip that says "needs tensorrt"."""
    device = require_gpu()
    if importlib.util.find_spec("tensorrt") is None:
        pytest.skip("needs tensorrt (fngate[gpu,tensorrt]; docs/gpu.md)")
    return device


def classifier(folder: Path, **model: Any) -> tuple[FunctionManifest, Path]:
    """A copy of the classifier in `folder` with these `model` fields changed."""
    target = folder / "classifier"
    shutil.copytree(CLASSIFIER, target, dirs_exist_ok=True)
    data = yaml.safe_load((target / "function.yaml").read_text())
    data["model"].update(model)
    (target / "function.yaml").write_text(yaml.safe_dump(data))
    return load_manifest(target / "function.yaml"), target


def rows(count: int, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    return {"input": np.random.default_rng(seed).standard_normal((count, 16), dtype=np.float32)}
