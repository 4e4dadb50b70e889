"""The decode allowance: the bytes one gateway process holds at once for invocation bodies being
decoded (compressed bodies, binary tensor data, the tensors a JSON body fills), whatever the front
end. A body that would take it past its limit is refused (Overloaded: 503 with Retry-After over
HTTP, UNAVAILABLE with a retry-after over gRPC) rather than allocated; one body alone is never
refused by it (its own limits bound it)."""

from __future__ import annotations

import threading

from fngate.errors import Overloaded


class DecodeAllowance:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._lock = threading.Lock()  # bodies are decoded on the event loop and in worker threads

    def hold(self) -> Hold:
        """A body's share, empty until it adds to it; release it when the body is decoded."""
        return Hold(self)


class Hold:
    __slots__ = ("_budget", "bytes")

    def __init__(self, budget: DecodeAllowance) -> None:
        self._budget = budget
        self.bytes = 0

    def add(self, count: int) -> None:
        """Hold `count` bytes more, or raise Overloaded when other bodies hold the rest."""
        budget = self._budget
        with budget._lock:
            others = budget.used_bytes - self.bytes
            if others > 0 and budget.used_bytes + count > budget.max_bytes:
                raise Overloaded(
                    f"this gateway process is decoding {others} bytes of other requests already "
                    f"(max_decode_bytes {budget.max_bytes}); retry shortly"
                )
            budget.used_bytes += count
            self.bytes += count

    def release(self) -> None:
        budget = self._budget
        with budget._lock:
            budget.used_bytes -= self.bytes
            self.bytes = 0
