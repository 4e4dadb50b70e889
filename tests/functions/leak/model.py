"""Test function: y = 2x, and 20 MiB kept (and touched) on every batch, never freed."""

from pathlib import Path

import numpy as np


class Model:
    def __init__(self, directory: Path) -> None:
        self.kept: list[np.ndarray] = []

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.kept.append(np.ones(5 * 2**20, dtype=np.float32))
        return {"y": inputs["x"] * 2}
