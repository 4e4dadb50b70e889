"""Test function: y = 2x. Steered by x[:, 0]: -1 raises, -2 kills the runner (the parent of the
process a Python function runs in) and then that process. PROBE_SLEEP_S sleeps
per batch; PROBE_LOG names a file that gets one line per executed row (its x[0])."""

import os
import signal
import time
from pathlib import Path

import numpy as np


class Model:
    def __init__(self, directory: Path) -> None:
        self.sleep_s = float(os.environ.get("PROBE_SLEEP_S", "0"))
        self.log = os.environ.get("PROBE_LOG")

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        if self.log:
            with open(self.log, "a") as out:
                out.writelines(f"{row[0]:g}\n" for row in x)
        if (x[:, 0] == -2).any():
            os.kill(os.getppid(), signal.SIGKILL)
            os._exit(17)
        if (x[:, 0] == -1).any():
            raise ValueError("probe was asked to fail")
        time.sleep(self.sleep_s)
        return {"y": x * 2}
