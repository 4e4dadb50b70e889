"""Pure batching policy: from the rows waiting, the manifest's policy and the clock, run n now or wait.

An idle system never waits: with no sign of concurrent traffic the batch runs at once with what is
there, and the invocations that queue while it runs form the next batch. Only when invocations
arrive together (the last batch or the queue held more than one) does the batcher wait, at most
max_queue_delay_us from the oldest invocation, to fill a preferred size or max_batch_size; and it
stops waiting once the burst is in: when no invocation has arrived for a few times the burst's own
gap between arrivals, or for as long as another batch would cost to run (Arrivals, BatchCost).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Hashable, Sequence

from fngate.manifest import BatchingSpec

GAP_FACTOR = 3
"""A pause of this many median inter-arrival gaps means the burst is in."""
MIN_GAP_US = 100
ARRIVALS_KEPT = 32
MIN_ARRIVALS = 4
"""Fewer gaps than this say nothing of a burst: the batcher waits up to max_queue_delay_us."""


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    count: int
    """How many of the waiting invocations, oldest first, form the batch."""


@dataclasses.dataclass(frozen=True, slots=True)
class Wait:
    us: int


@dataclasses.dataclass(frozen=True, slots=True)
class Burst:
    """What the batcher knows of the invocations arriving now."""

    quiet_us: int
    """Since the last one arrived."""
    gap_us: int
    """A pause this long means the burst is in (Arrivals.gap_us)."""


def choose(
    rows: Sequence[int],
    oldest_age_us: int,
    policy: BatchingSpec,
    contended: bool,
    burst: Burst | None = None,
) -> Run | Wait:
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
    if burst is not None and burst.quiet_us >= burst.gap_us:
        return Run(prefix)
    wait_us = policy.max_queue_delay_us - oldest_age_us
    if burst is not None:
        wait_us = min(wait_us, burst.gap_us - burst.quiet_us)
    return Wait(wait_us)


class Arrivals:
    """When invocations arrive: the recent gaps between them and the time of the last (clock
    readings in ns, passed in). A read that brings n entries counts n gaps of its interval over n."""

    def __init__(self) -> None:
        self._gaps: deque[float] = deque(maxlen=ARRIVALS_KEPT)
        self._last_ns: int | None = None

    def arrived(self, count: int, now_ns: int) -> None:
        if count <= 0:
            return
        if self._last_ns is not None:
            gap_us = (now_ns - self._last_ns) / 1000 / count
            self._gaps.extend([gap_us] * min(count, ARRIVALS_KEPT))
        self._last_ns = now_ns

    def burst(self, now_ns: int, cost_us: float) -> Burst | None:
        """The burst now, or None while too few arrivals were seen. Its gap is a few times its
        median inter-arrival gap, and at least what another batch would cost (`cost_us`): waiting
        that long is paid back by the batch it saves."""
        if len(self._gaps) < MIN_ARRIVALS or self._last_ns is None:
            return None
        median = sorted(self._gaps)[len(self._gaps) // 2]
        gap_us = max(GAP_FACTOR * median, MIN_GAP_US, cost_us)
        return Burst(int((now_ns - self._last_ns) / 1000), int(gap_us))


class BatchCost:
    """A batch's fixed cost in µs (what running one more batch costs beside its rows), fitted by
    least squares to the batches run, recent ones weighing most."""

    def __init__(self, weight: float = 0.05) -> None:
        self._weight = weight
        self._n = 0
        self._rows = self._us = self._rows2 = self._rows_us = 0.0

    def observe(self, rows: int, duration_us: float) -> None:
        self._n += 1
        w = max(self._weight, 1 / self._n)  # plain means until the window is full
        self._rows += w * (rows - self._rows)
        self._us += w * (duration_us - self._us)
        self._rows2 += w * (rows * rows - self._rows2)
        self._rows_us += w * (rows * duration_us - self._rows_us)

    @property
    def fixed_us(self) -> float:
        return self.fit()[0]

    def fit(self) -> tuple[float, float]:
        """(fixed µs a batch, µs a row): with batches of one size so far, their whole cost is the
        fixed part."""
        spread = self._rows2 - self._rows * self._rows
        if self._n == 0:
            return 0.0, 0.0
        if spread <= 1e-9:
            return self._us, 0.0
        per_row = max(0.0, (self._rows_us - self._rows * self._us) / spread)
        return max(0.0, self._us - per_row * self._rows), per_row

    @property
    def observed(self) -> bool:
        return self._n > 0


def _prefix_within(rows: Sequence[int], limit: int) -> int:
    """The number of leading invocations whose rows fit in `limit` (at least one)."""
    total = 0
    for index, count in enumerate(rows):
        total += count
        if total > limit:
            return max(index, 1)
    return len(rows)


@dataclasses.dataclass(slots=True)  # not frozen: made for every waiting invocation at every step
class Pending:
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
class Decision:
    expired: tuple[int, ...] = ()
    """Indices past their deadline: answered deadline_exceeded, never run."""
    batch: tuple[int, ...] = ()
    """Indices to run now as one batch (empty: none)."""
    wait_us: int | None = None
    """With no batch: wait this long for more invocations (None: nothing is waiting)."""


def decide(
    waiting: Sequence[Pending],
    now_ms: int,
    policy: BatchingSpec,
    batched: bool,
    contended: bool,
    burst: Burst | None = None,
) -> Decision:
    """The batcher's one decision. `waiting` is oldest first; `contended` says the last batch or
    the queue held more than one invocation (see choose)."""
    expired = tuple(index for index, item in enumerate(waiting) if item.deadline_ms <= now_ms)
    live = [index for index, item in enumerate(waiting) if item.deadline_ms > now_ms]
    if not live:
        return Decision(expired)
    first = waiting[live[0]]
    if first.alone:
        return Decision(expired, (live[0],))
    candidates = [index for index in live if waiting[index].group == first.group and not waiting[index].alone]
    rows = [waiting[index].rows if batched else 1 for index in candidates]
    oldest_age_us = max(0, now_ms - first.queued_ms) * 1000
    decision = choose(rows, oldest_age_us, policy, contended or len(live) > 1, burst)
    if isinstance(decision, Run):
        return Decision(expired, tuple(candidates[: decision.count]))
    return Decision(expired, (), decision.us)
