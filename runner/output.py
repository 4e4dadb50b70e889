"""What a function's process prints: its stdout and stderr, read by a thread of their own (the
process never blocks on a full pipe), each line logged as a field of a record that names the
function and version (so that no line passes for one of the runner's own records), within a budget
of bytes per batch and per minute. What is over the budget is counted, dropped, and said once."""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Mapping

BUDGET_BYTES = 64 * 2**10
"""What one batch, and one minute, may put in the runner's log."""
WINDOW_S = 60.0
MAX_LINE_BYTES = 4096
"""A longer line is cut here (the cut is counted as dropped)."""
READ_BYTES = 64 * 2**10
_CONTROL = {code: f"\\x{code:02x}" for code in (*range(32), 127) if code != 9}
"""Control characters are written out: a line cannot move a terminal's cursor or fake a new line."""

log = logging.getLogger("runner.function")


class Output:
    """The reader of one process's output pipes. `batch_started` and `batch_ended` bracket a batch:
    what is read between them counts against that batch's budget."""

    def __init__(
        self,
        function: str,
        version: str,
        pipes: Mapping[str, int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fields = {"function": function, "version": version}
        self._pipes = dict(pipes)
        self._clock = clock
        self._lock = threading.Lock()
        self._batch_bytes = 0
        self._window_start = clock()
        self._window_bytes = 0
        self._dropped_lines = 0
        self._dropped_bytes = 0
        self._thread = threading.Thread(target=self._read, name=f"output-{function}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Wait until the pipes are closed and everything in them logged (or `timeout_s`)."""
        self._thread.join(timeout_s)

    def batch_started(self) -> None:
        with self._lock:
            self._report_dropped("the previous batch")
            self._batch_bytes = 0

    def batch_ended(self) -> None:
        with self._lock:
            self._report_dropped("its batch")

    def emit(self, stream: str, raw: bytes) -> None:
        """One line (without its newline), logged if the budgets allow, else counted."""
        kept = raw[:MAX_LINE_BYTES]
        with self._lock:
            now = self._clock()
            if now - self._window_start >= WINDOW_S:
                self._report_dropped("the last minute")
                self._window_start, self._window_bytes = now, 0
            size = len(kept) + 1
            if self._batch_bytes + size > BUDGET_BYTES or self._window_bytes + size > BUDGET_BYTES:
                self._dropped_lines += 1
                self._dropped_bytes += len(raw) + 1
                return
            self._batch_bytes += size
            self._window_bytes += size
            self._dropped_bytes += len(raw) - len(kept)
        line = kept.decode("utf-8", "replace").rstrip("\r").translate(_CONTROL)
        level = logging.WARNING if stream == "stderr" else logging.INFO
        log.log(level, "function output", extra={"fields": {**self._fields, "stream": stream, "line": line}})

    def _report_dropped(self, where: str) -> None:
        if not self._dropped_lines and not self._dropped_bytes:
            return
        fields = {**self._fields, "dropped_lines": self._dropped_lines, "dropped_bytes": self._dropped_bytes}
        log.warning(
            "function output over %d KiB a batch or a minute: the rest of %s dropped",
            BUDGET_BYTES // 1024,
            where,
            extra={"fields": fields},
        )
        self._dropped_lines = self._dropped_bytes = 0

    def _read(self) -> None:
        poller = select.poll()
        names = {fd: name for name, fd in self._pipes.items()}
        pending = {fd: b"" for fd in names}
        for fd in names:
            poller.register(fd, select.POLLIN)
        while names:
            for fd, _events in poller.poll():
                try:
                    chunk = os.read(fd, READ_BYTES)
                except OSError:
                    chunk = b""
                if not chunk:
                    if pending[fd]:
                        self.emit(names[fd], pending[fd])
                    poller.unregister(fd)
                    os.close(fd)
                    del names[fd], pending[fd]
                    continue
                *lines, rest = (pending[fd] + chunk).split(b"\n")
                for line in lines:
                    self.emit(names[fd], line)
                while len(rest) >= MAX_LINE_BYTES:  # a line without end: logged in pieces
                    self.emit(names[fd], rest[:MAX_LINE_BYTES])
                    rest = rest[MAX_LINE_BYTES:]
                pending[fd] = rest
        with self._lock:
            self._report_dropped("its output")
