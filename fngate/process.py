"""Process lifecycle: how a component runs its main coroutine (on uvloop where it is installed,
flushing buffered telemetry at exit), and how a supervisor stops the processes it started."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from fngate import telemetry


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs one of fngate's components (`python -m gateway`) as installed:
    with -P, so that a `gateway.py` or `fngate/` in the current folder cannot stand in for it."""
    return [sys.executable, "-P", "-m", module, *args]


def run_forever(main: Coroutine[Any, Any, None]) -> None:
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(main)
        else:
            uvloop.run(main)
    finally:
        telemetry.shutdown()


def stop_processes(processes: Sequence[subprocess.Popen[bytes]], timeout_s: float = 30) -> None:
    """SIGTERM each (they drain), wait up to `timeout_s` in all, then kill what is left."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
