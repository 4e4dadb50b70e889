"""Test function: y = 2x. Steered by x[:, 0]: -1 raises, -2 prints "poison" and never returns (a
stand-in for an input that kills its runner: the test kills the runner when it says so).
PROBE_SLEEP_S sleeps per batch, and PROBE_SPIN_S spins until the process has taken that much CPU
time per batch; with PROBE_LOG set, each executed row's x[0] is printed
("executed 5"), and its runner logs the line (tests/e2e/function_output.py reads it back)."""

import os
import time
from pathlib import Path

import numpy as np


class Model:
    def __init__(self, directory: Path) -> None:
        self.sleep_s = float(os.environ.get("PROBE_SLEEP_S", "0"))
        self.spin_s = float(os.environ.get("PROBE_SPIN_S", "0"))
        self.log = bool(os.environ.get("PROBE_LOG"))

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        if self.log:
            for row in x:
                print(f"executed {row[0]:g}")
        if (x[:, 0] == -2).any():
            print("poison")
            while True:
                time.sleep(1)
        if (x[:, 0] == -1).any():
            raise ValueError("probe was asked to fail")
        spun = time.process_time() + self.spin_s
        while time.process_time() < spun:
            pass
        time.sleep(self.sleep_s)
        return {"y": x * 2}
