"""Test function: loading takes LOAD_S seconds (a large model's download and load); infer doubles."""

import time
from pathlib import Path

import numpy as np

LOAD_S = 3.0


class Model:
    def __init__(self, directory: Path) -> None:
        time.sleep(LOAD_S)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": inputs["x"] * 2}
