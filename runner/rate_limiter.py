"""Execution slots (Triton's rate limiter): named resources of the runner's device with a count
each (settings.rate_limiter_resources, e.g. GPU_EXEC_SLOTS: 8), and what a function's batch needs
of them (model.rate_limiter.resources). A batch holds what it needs while it runs; one that finds
too little free waits, first come first served, so that heavy models take their turn instead of
overrunning the device and a light one cannot starve a heavy one."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Mapping


class RateLimiter:
    def __init__(self, counts: Mapping[str, int] | None = None) -> None:
        self._counts = dict(counts or {})
        self._free = dict(self._counts)
        self._waiting: collections.deque[tuple[dict[str, int], asyncio.Future[None]]] = collections.deque()

    @contextlib.asynccontextmanager
    async def hold(self, needs: Mapping[str, int]) -> AsyncIterator[None]:
        """Hold `needs` while inside; waits until all of it is free and every earlier waiter is served."""
        wanted = {name: count for name, count in needs.items() if count > 0}
        if not wanted:
            yield
            return
        for name, count in wanted.items():
            # A resource the runner does not name has as much as the most any function needs
            # (Triton's rule): it limits nothing alone, only together with others' needs.
            grown = max(count - self._counts.get(name, 0), 0)
            self._counts[name] = self._counts.get(name, 0) + grown
            self._free[name] = self._free.get(name, 0) + grown
        if self._waiting or not self._fits(wanted):
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append((wanted, turn))
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._give_back(wanted)  # granted as it was cancelled
                else:
                    with contextlib.suppress(ValueError):  # _serve may have dropped it already
                        self._waiting.remove((wanted, turn))
                    self._serve()
                raise
        else:
            self._take(wanted)
        try:
            yield
        finally:
            self._give_back(wanted)

    def free(self, name: str) -> int:
        return self._free.get(name, 0)

    def _fits(self, wanted: Mapping[str, int]) -> bool:
        return all(self._free.get(name, 0) >= count for name, count in wanted.items())

    def _take(self, wanted: Mapping[str, int]) -> None:
        for name, count in wanted.items():
            self._free[name] -= count

    def _give_back(self, wanted: Mapping[str, int]) -> None:
        for name, count in wanted.items():
            self._free[name] += count
        self._serve()

    def _serve(self) -> None:
        """Grant the waiters in order while the first one's needs are free."""
        while self._waiting:
            wanted, turn = self._waiting[0]
            if turn.done():  # its waiter was cancelled
                self._waiting.popleft()
            elif self._fits(wanted):
                self._waiting.popleft()
                self._take(wanted)
                turn.set_result(None)
            else:
                return
