"""Process lifecycle: how a component runs its main coroutine (on uvloop where it is installed,
flushing buffered telemetry at exit), how a supervisor stops the processes it started, and how they
end with it when it dies without stopping them."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
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


PR_SET_PDEATHSIG = 1


def ends_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that has the child get `signum` when this process dies, however it dies
    (Linux's PR_SET_PDEATHSIG; None elsewhere). The signal goes when the thread that started the
    child ends: start children from a thread that lasts (the main one, or the event loop's pool)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def arm() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:  # it died before the signal was armed
            os._exit(1)

    return arm
