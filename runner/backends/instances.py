"""Instances of one model (the manifest's model.instances): several backends of the same model,
each running one batch at a time, so that as many batches of the function run at once."""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
from collections.abc import Sequence
from typing import Any

from fngate.tensors import Tensors
from runner.backends import Backend


class Instances:
    """A backend that runs each batch on a free instance. The batches of a python function (whose
    instances are processes of their own) wait on this backend's own threads, one per instance."""

    stoppable = False
    """Several batches at once never run on the event loop."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        self.backends = tuple(backends)
        self._free: queue.SimpleQueue[Backend] = queue.SimpleQueue()
        for backend in self.backends:
            self._free.put(backend)
        first = self.backends[0]
        self.isolated = bool(getattr(first, "isolated", False))
        self.takes_rows = bool(getattr(first, "takes_rows", False))
        self.device = str(getattr(first, "device", "python"))
        self.fallback_reason = getattr(first, "fallback_reason", None)
        self.device_memory_bytes = sum(int(getattr(b, "device_memory_bytes", 0)) for b in self.backends)
        if self.isolated:
            self.executor = concurrent.futures.ThreadPoolExecutor(
                len(self.backends), thread_name_prefix="instances"
            )

    def run(self, inputs: Tensors, outputs: list[str], rows: list[int] | None = None) -> Tensors:
        backend = self._free.get()
        try:
            if self.takes_rows:
                return backend.run(inputs, outputs, rows)  # type: ignore[call-arg]
            return backend.run(inputs, outputs)
        finally:
            self._free.put(backend)

    def take_metric_updates(self) -> list[Any]:
        """The custom metrics the instances' processes reported since the last take."""
        return [
            update for backend in self.backends for update in getattr(backend, "take_metric_updates", list)()
        ]

    def rss_bytes(self) -> int:
        """The resident memory of the instances' own processes, where they have any."""
        return sum(int(getattr(backend, "rss_bytes", lambda: 0)()) for backend in self.backends)

    def close(self) -> None:
        close_all(self.backends)
        if self.isolated:
            self.executor.shutdown(wait=False)


def close_all(backends: Sequence[Backend]) -> None:
    """Close each backend; one that fails to close does not keep the others open."""
    for backend in backends:
        with contextlib.suppress(Exception):
            backend.close()
