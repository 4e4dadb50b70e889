"""Retry delays for loops that outlive their dependencies: exponential, capped, with full jitter."""

from __future__ import annotations

import random


def backoff_s(failures: int, base_s: float = 0.1, cap_s: float = 5.0) -> float:
    """The delay before retry number `failures` (1 for the first): uniform in [d/2, d], d doubling
    from base_s up to cap_s, so that processes that lost Redis together do not return together."""
    delay_s = min(cap_s, base_s * 2 ** max(failures - 1, 0))
    return random.uniform(delay_s / 2, delay_s)
