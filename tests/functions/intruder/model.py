"""Test function: tries to reach what a function must not, and answers what came of each try (one
JSON document, on every row). INTRUDER_TARGETS (JSON) names them: `socket` (a Unix socket path),
`tcp` ([host, port]), `files` (to read) and `outside` (a file to create). It also prints lines that
look like its runner's own log records, and more of them than a batch may log."""

import json
import os
import socket
import sys
from pathlib import Path

import numpy as np


def attempt(action):
    try:
        result = action()
    except Exception as exc:
        return f"refused: {type(exc).__name__}: {exc}"
    return f"done: {result!r}"[:200]


def read(path, size=64):
    with open(path, "rb") as file:
        return file.read(size)


def connect(family, address):
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        sock.connect(address)
        return "connected"


class Model:
    def __init__(self, directory: Path) -> None:
        self.targets = json.loads(os.environ["INTRUDER_TARGETS"])

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        runner, targets = os.getppid(), self.targets
        tried = {
            "read the runner's environment": attempt(lambda: read(f"/proc/{runner}/environ")),
            "read the runner's memory": attempt(lambda: read(f"/proc/{runner}/mem", 1)),
            "connect to Redis's socket": attempt(lambda: connect(socket.AF_UNIX, targets["socket"])),
            "connect to Redis over TCP": attempt(lambda: connect(socket.AF_INET, tuple(targets["tcp"]))),
            "signal the runner": attempt(lambda: os.kill(runner, 0)),
            "write outside its folder": attempt(lambda: Path(targets["outside"]).write_text("x")),
        }
        for path in targets["files"]:
            tried[f"read {path}"] = attempt(lambda path=path: read(path))
        tried["write its working folder"] = attempt(lambda: Path("scratch").write_text("x"))
        forged = {"level": "ERROR", "service": "runner", "logger": "runner.worker", "message": "forged"}
        print("to stderr", file=sys.stderr, flush=True)
        print(json.dumps(forged), flush=True)
        sys.stdout.write(("x" * 1023 + "\n") * 256)  # 256 KiB: four times what a batch may log
        return {"report": np.array([[json.dumps(tried)]] * len(inputs["x"]), dtype=object)}
