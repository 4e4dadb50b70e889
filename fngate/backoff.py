"""Retry delays for loops that outlive their dependencies (exponential, capped, with jitter), and
the health record that loops update and readiness reads: an outage is logged once as it starts and
once as it ends, not on every retry."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("fngate.backoff")
STOP_WAIT_S = 0.5
"""How long an attempt cancelled by `stopping` is given to finish its cancellation."""


def stop_if_cancelled(exc: BaseException) -> None:
    """For a loop's handler of a failed call: raise CancelledError where the loop's task is being
    cancelled. A client call can take the cancellation for a failure of its own (a timeout, a lost
    connection), and the loop would back off and go on past its server's shutdown, on clients
    closed by then."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError(f"cancelled during a call that failed with {exc!r}") from exc


def backoff_s(failures: int, base_s: float = 0.1, cap_s: float = 5.0) -> float:
    """The delay before retry number `failures` (1 for the first): uniform in [d/2, d], d doubling
    from base_s up to cap_s, so that processes that lost Redis together do not return together."""
    delay_s = min(cap_s, base_s * 2 ** min(max(failures - 1, 0), 32))
    return random.uniform(delay_s / 2, delay_s)


async def until_done(
    attempt: Callable[[], Awaitable[object]],
    errors: tuple[type[BaseException], ...],
    what: str,
    stopping: asyncio.Event | None = None,
    backoff: Backoff | None = None,
) -> bool:
    """`attempt` again and again, with backoff (at most 1 s apart), until it does not fail with one
    of `errors`: for what a process needs before it can start (Redis at start-up) and must never
    exit for. The outage is logged once as it starts and once as it ends. True once it succeeded;
    False as soon as `stopping` is set, mid-attempt or mid-wait: a signal ends the process at once."""
    backoff = backoff or Backoff()
    health = Health(what)
    while stopping is None or not stopping.is_set():
        try:
            if await _unless_stopped(attempt(), stopping):
                health.succeeded()
                return True
            return False
        except errors as exc:
            health.failed("start-up", exc)
        if not await _wait_unless_stopped(backoff.failed(), stopping):
            return False
    return False


async def _unless_stopped(work: Awaitable[object], stopping: asyncio.Event | None) -> bool:
    """Await `work`; False (and `work` cancelled) if `stopping` is set first."""
    if stopping is None:
        await work
        return True
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    # A client call may swallow its cancellation (redis-py's can): do not wait on it for long.
    await asyncio.wait({task}, timeout=STOP_WAIT_S)
    return False


async def _wait_unless_stopped(delay_s: float, stopping: asyncio.Event | None) -> bool:
    """Sleep `delay_s`; False at once if `stopping` is set meanwhile."""
    if stopping is None:
        await asyncio.sleep(delay_s)
        return True
    try:
        async with asyncio.timeout(delay_s):
            await stopping.wait()
    except TimeoutError:
        return True
    return False


class Backoff:
    """The retry state of one loop: `failed()` answers how long to wait, `succeeded()` resets."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 1.0) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.failures = 0

    def failed(self) -> float:
        self.failures += 1
        return backoff_s(self.failures, self.base_s, self.cap_s)

    def succeeded(self) -> None:
        self.failures = 0


class Health:
    """Whether a dependency answers, as the loops that use it last saw it. Pure state: readiness
    reads `available` without a round trip of its own."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self._clock = clock
        self._down_since: float | None = None
        self.last_error = ""

    @property
    def available(self) -> bool:
        return self._down_since is None

    def down_for_s(self) -> float:
        return 0.0 if self._down_since is None else self._clock() - self._down_since

    def failed(self, where: str, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        if self._down_since is None:
            self._down_since = self._clock()
            log.warning("%s unavailable (%s: %s); retrying with backoff", self.name, where, self.last_error)

    def succeeded(self) -> None:
        if self._down_since is not None:
            log.info("%s available again after %.1f s", self.name, self._clock() - self._down_since)
            self._down_since = None
            self.last_error = ""
