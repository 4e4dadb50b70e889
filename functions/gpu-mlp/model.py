"""A python-backend example on the GPU: relu(x @ w0 + b0) @ w1 + b1 with fixed seeded weights, run
by CuPy on CUDA's device 0 (the GPU the runner gave this process), or by numpy on the CPU when
there is no CuPy or no GPU: `device` and `fallback_reason` tell the runner which."""

from pathlib import Path

import numpy as np

FEATURES = 256
HIDDEN = 1024


def weights(seed: int = 256) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES)).astype(np.float32),
        (rng.standard_normal(HIDDEN) * 0.1).astype(np.float32),
        (rng.standard_normal((HIDDEN, FEATURES)) / np.sqrt(HIDDEN)).astype(np.float32),
        (rng.standard_normal(FEATURES) * 0.1).astype(np.float32),
    ]


def cuda_arrays():
    """CuPy with a device to run on, or (None, why not)."""
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy's CUDARuntimeError: no driver, no device
        return None, f"CUDA sees no GPU ({type(exc).__name__}: {exc})"
    if count < 1:
        return None, "CUDA sees no GPU"
    return cupy, None


class Model:
    def __init__(self, directory: Path) -> None:
        cupy, self.fallback_reason = cuda_arrays()
        self.xp = cupy if cupy is not None else np
        self.device = "cuda" if cupy is not None else "cpu"
        self.w0, self.b0, self.w1, self.b1 = (self.xp.asarray(array) for array in weights())
        if cupy is None:
            print(f"gpu-mlp runs on the CPU (numpy): {self.fallback_reason}", flush=True)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        xp = self.xp
        x = xp.asarray(inputs["input"], dtype=xp.float32)
        hidden = xp.maximum(x @ self.w0 + self.b0, 0)
        y = hidden @ self.w1 + self.b1
        return {"output": y.get() if xp is not np else y}

    def close(self) -> None:
        if self.xp is not np:
            del self.w0, self.b0, self.w1, self.b1
            self.xp.get_default_memory_pool().free_all_blocks()
