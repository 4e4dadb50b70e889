"""Retry delays for loops that outlive their dependencies: exponential, capped, with full jitter."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def backoff_s(failures: int, base_s: float = 0.1, cap_s: float = 5.0) -> float:
    """The delay before retry number `failures` (1 for the first): uniform in [d/2, d], d doubling
    from base_s up to cap_s, so that processes that lost Redis together do not return together."""
    delay_s = min(cap_s, base_s * 2 ** max(failures - 1, 0))
    return random.uniform(delay_s / 2, delay_s)


async def until_done(
    attempt: Callable[[], Awaitable[T]],
    errors: tuple[type[BaseException], ...],
    what: str,
    log: logging.Logger,
) -> T:
    """`attempt` again and again, with backoff, until it does not fail with one of `errors`: for
    what a process needs before it can start (Redis at start-up) and must never exit for."""
    failures = 0
    while True:
        try:
            return await attempt()
        except errors as exc:
            failures += 1
            delay_s = backoff_s(failures)
            log.warning("%s failed (%s); retrying in %.1f s", what, exc, delay_s)
            await asyncio.sleep(delay_s)
