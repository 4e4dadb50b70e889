"""Process lifecycle: how a component runs its main coroutine (on uvloop where it is installed,
flushing buffered telemetry at exit), how a supervisor stops the processes it started, and how they
end with it when it dies without stopping them."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from fngate import telemetry


def module_command(module: str, *args: str, python: str = "") -> list[str]:
    """The command line that runs one of fngate's components (`python -m gateway`) as installed:
    with -P, so that a `gateway.py` or `fngate/` in the current folder cannot stand in for it.
    `python`: another environment's interpreter (default: this one's)."""
    return [python or sys.executable, "-P", "-m", module, *args]


def batch_scheduling(pid: int = 0) -> str:
    """Put every thread of a process (this one by default) under Linux's SCHED_BATCH, at the nice
    value it has; threads and children it starts afterwards inherit it. Answers why not, or ''.

    A SCHED_BATCH thread that wakes does not preempt the thread that woke it. An invocation passes
    from process to process (client, gateway, Redis, runner and back), each waking the next by a
    write: under the default policy the woken one preempts the writer on its CPU, and each hop
    costs two context switches and leaves the writer's work of that loop turn waiting. Measured
    with `fngate up`'s processes on two cores (tiny, Poisson arrivals, five runs each way,
    interleaved): p99 at 1,000 req/s 3.8-4.2 ms instead of 4.1-6.1, at 2,000 7.3-10.1 instead of
    9.0-11.2; closed-loop throughput at 16 clients the same within the noise. The price: such a
    process waits for its turn rather than preempting a busy neighbour, so this is for machines
    that run fngate's processes together (`fngate up`), not a default where they share CPUs with
    others."""
    if not hasattr(os, "SCHED_BATCH"):
        return "this system has no SCHED_BATCH"
    try:
        threads = os.listdir(f"/proc/{pid or 'self'}/task")
    except OSError as exc:
        return f"the process's threads cannot be listed ({exc.strerror})"
    for thread in threads:
        try:
            _batch(int(thread))
        except ProcessLookupError:
            continue  # it ended meanwhile
        except OSError as exc:  # a policy this user may not leave (a real-time one, say)
            return f"SCHED_BATCH was refused ({exc.strerror})"
    return ""


def batch_at_exec(also: Callable[[], None] | None = None) -> Callable[[], None]:
    """A `preexec_fn` that puts the child under SCHED_BATCH before it runs anything (so before any
    thread of its own starts), after `also` (another preexec_fn, or None). Where refused, the
    child runs as it would have (`os.sched_getscheduler(pid)` tells)."""

    def prepare() -> None:
        if also is not None:
            also()
        if hasattr(os, "SCHED_BATCH"):
            with contextlib.suppress(OSError):
                _batch(0)

    return prepare


def _batch(thread: int) -> None:
    os.sched_setscheduler(thread, os.SCHED_BATCH, os.sched_param(0))


def schedule(batch: bool) -> None:
    """A component's start: SCHED_BATCH when its settings ask for it (a warning where refused)."""
    if batch:
        why = batch_scheduling()
        if why:
            logging.getLogger("fngate.process").warning("not under SCHED_BATCH: %s", why)


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
