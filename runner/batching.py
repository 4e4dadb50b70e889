"""Pure batching policy: from the rows waiting, the manifest's policy and the clock, run n now or wait.

An idle system never waits: with no sign of concurrent traffic the batch runs at once with what is
there, and the invocations that queue while it runs form the next batch. Only when invocations
arrive together (the last batch or the queue held more than one) does the batcher wait, at most
max_queue_delay_us from the oldest invocation, to fill a preferred size or max_batch_size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

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


@dataclasses.dataclass(frozen=True, slots=True)
class Waiting:
    """What the batcher knows of one invocation read from the stream."""

    deadline_ms: int
    queued_ms: int
    group: Hashable
    """Version and shapes: only invocations of one group run in one batch."""
    rows: int
    alone: bool = False
    """Redelivered after a runner died holding it, or out of a batch that failed as a whole: it
    runs in a batch of its own, so that an invocation that kills its process or its runner fails
    alone and never takes its batch mates with it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    expired: tuple[int, ...] = ()
    """Indices past their deadline: answered deadline_exceeded, never run."""
    batch: tuple[int, ...] = ()
    """Indices to run now as one batch (empty: none)."""
    wait_us: int | None = None
    """With no batch: wait this long for more invocations (None: nothing is waiting)."""


def next_step(
    waiting: Sequence[Waiting], now_ms: int, policy: BatchingSpec, batched: bool, contended: bool
) -> Step:
    """The batcher's one decision. `waiting` is oldest first; `contended` says the last batch or
    the queue held more than one invocation (see plan)."""
    expired = tuple(index for index, item in enumerate(waiting) if item.deadline_ms <= now_ms)
    live = [index for index, item in enumerate(waiting) if item.deadline_ms > now_ms]
    if not live:
        return Step(expired)
    first = waiting[live[0]]
    if first.alone:
        return Step(expired, (live[0],))
    candidates = [index for index in live if waiting[index].group == first.group and not waiting[index].alone]
    rows = [waiting[index].rows if batched else 1 for index in candidates]
    oldest_age_us = max(0, now_ms - first.queued_ms) * 1000
    decision = plan(rows, oldest_age_us, policy, contended or len(live) > 1)
    if isinstance(decision, Run):
        return Step(expired, tuple(candidates[: decision.count]))
    return Step(expired, (), decision.us)
