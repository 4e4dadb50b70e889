"""Test function: infer never returns."""

import time
from pathlib import Path

import numpy as np


class Model:
    def __init__(self, directory: Path) -> None:
        pass

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        while True:
            time.sleep(1)
