"""Test function: an output of the wrong rank and datatype."""

from pathlib import Path

import numpy as np


class Model:
    def __init__(self, directory: Path) -> None:
        pass

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": np.full((len(inputs["x"]), 7, 3), 0.1)}
