"""Pure batching policy: from the rows waiting, the manifest's policy and the clock, run n now or wait.

An idle system never waits: with no sign of concurrent traffic the batch runs at once with what is
there, and the invocations that queue while it runs form the next batch. Only when invocations
arrive together (the last batch or the queue held more than one) does the batcher wait, at most
max_queue_delay_us from the oldest invocation, to fill a preferred size or max_batch_size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fngate.manifest import BatchingSpec


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    count: int
    """How many of the waiting invocations, oldest first, form the batch."""


@dataclasses.dataclass(frozen=True, slots=True)
class Wait:
    us: int


def plan(rows: Sequence[int], oldest_age_us: int, policy: BatchingSpec, contended: bool) -> Run | Wait:
    """`rows`: rows of each waiting invocation, oldest first (not empty)."""
    limit = max(policy.max_batch_size, 1)
    prefix = _prefix_within(rows, limit)
    total = sum(rows)
    if total >= limit or policy.max_batch_size == 0:
        return Run(prefix)
    if not contended or oldest_age_us >= policy.max_queue_delay_us:
        return Run(prefix)
    preferred = [size for size in policy.preferred_batch_sizes if size <= total]
    if preferred:
        return Run(_prefix_within(rows, max(preferred)))
    return Wait(policy.max_queue_delay_us - oldest_age_us)


def _prefix_within(rows: Sequence[int], limit: int) -> int:
    """The number of leading invocations whose rows fit in `limit` (at least one)."""
    total = 0
    for index, count in enumerate(rows):
        total += count
        if total > limit:
            return max(index, 1)
    return len(rows)
