from __future__ import annotations

import pytest

from fngate.manifest import BatchingSpec
from runner.batching import (
    MIN_GAP_US,
    Arrivals,
    BatchCost,
    Burst,
    Decision,
    Pending,
    Run,
    Wait,
    choose,
    decide,
)

POLICY = BatchingSpec(max_batch_size=8, preferred_batch_sizes=(4,), max_queue_delay_us=1000)


@pytest.mark.parametrize(
    ("rows", "age_us", "contended", "expected"),
    [
        ([1], 0, False, Run(1)),  # an idle system never waits
        ([1, 1], 0, False, Run(2)),
        ([1, 1], 0, True, Wait(1000)),  # concurrent traffic: wait to fill
        ([1, 1], 600, True, Wait(400)),
        ([1, 1], 1000, True, Run(2)),  # the oldest waited max_queue_delay_us
        ([2, 2, 1], 0, True, Run(2)),  # a preferred size (4) can be formed
        ([4, 4, 4], 0, True, Run(2)),  # max_batch_size: 8 rows
        ([4, 4, 4], 0, False, Run(2)),
        ([3, 3, 3], 5000, True, Run(2)),  # never over max_batch_size
        ([8], 0, True, Run(1)),
    ],
)
def test_plan(rows: list[int], age_us: int, contended: bool, expected: Run | Wait) -> None:
    assert choose(rows, age_us, POLICY, contended) == expected


def test_batching_off_runs_one_at_a_time() -> None:
    policy = BatchingSpec(max_batch_size=0)
    assert choose([3, 3], 0, policy, True) == Run(1)


def test_no_delay_never_waits() -> None:
    policy = BatchingSpec(max_batch_size=32, max_queue_delay_us=0)
    assert choose([1, 1, 1], 0, policy, True) == Run(3)


def waiting(
    deadline_ms: int = 10_000, queued_ms: int = 0, group: str = "v1", rows: int = 1, alone: bool = False
) -> Pending:
    return Pending(deadline_ms, queued_ms, group, rows, alone)


@pytest.mark.parametrize(
    ("items", "now_ms", "contended", "expected"),
    [
        ([], 0, False, Decision()),
        ([waiting()], 0, False, Decision(batch=(0,))),  # idle: run at once
        ([waiting(), waiting()], 0, False, Decision(wait_us=1000)),  # two waiting: fill for up to 1 ms
        ([waiting(), waiting()], 1, False, Decision(batch=(0, 1))),  # the oldest waited 1 ms
        ([waiting(deadline_ms=5), waiting()], 5, False, Decision(expired=(0,), batch=(1,))),
        ([waiting(deadline_ms=5), waiting(deadline_ms=4)], 5, True, Decision(expired=(0, 1))),
        ([waiting(group="v1"), waiting(group="v2"), waiting(group="v1")], 1, True, Decision(batch=(0, 2))),
        ([waiting(alone=True), waiting(), waiting()], 0, True, Decision(batch=(0,))),  # redelivered: alone
        ([waiting(), waiting(alone=True), waiting()], 1, True, Decision(batch=(0, 2))),
        ([waiting(rows=4), waiting(rows=4), waiting(rows=4)], 0, True, Decision(batch=(0, 1))),  # max 8 rows
    ],
)
def test_next_step(items: list[Pending], now_ms: int, contended: bool, expected: Decision) -> None:
    assert decide(items, now_ms, POLICY, True, contended) == expected


def test_next_step_counts_invocations_when_batching_is_off() -> None:
    policy = BatchingSpec(max_batch_size=0)
    assert decide([waiting(rows=3), waiting(rows=3)], 0, policy, False, True) == Decision(batch=(0,))


@pytest.mark.parametrize(
    ("rows", "age_us", "burst", "expected"),
    [
        ([1, 1], 0, Burst(quiet_us=50, gap_us=300), Wait(250)),  # the burst is still coming
        ([1, 1], 0, Burst(quiet_us=300, gap_us=300), Run(2)),  # quiet for its gap: the burst is in
        ([1, 1], 900, Burst(quiet_us=0, gap_us=300), Wait(100)),  # never past max_queue_delay_us
        ([1, 1], 0, None, Wait(1000)),  # no burst known: wait up to max_queue_delay_us
    ],
)
def test_plan_stops_waiting_once_the_burst_is_in(
    rows: list[int], age_us: int, burst: Burst | None, expected: Run | Wait
) -> None:
    assert choose(rows, age_us, POLICY, True, burst) == expected


def test_the_burst_gap_is_a_few_median_gaps_and_at_least_a_batchs_cost() -> None:
    arrivals = Arrivals()
    arrivals.arrived(1, 0)
    assert arrivals.burst(0, 0) is None  # nothing known yet
    for index in range(1, 11):  # one invocation every 80 µs
        arrivals.arrived(1, index * 80_000)
    assert arrivals.burst(10 * 80_000 + 50_000, cost_us=0) == Burst(quiet_us=50, gap_us=240)
    assert arrivals.burst(10 * 80_000, cost_us=1200).gap_us == 1200  # type: ignore[union-attr]
    arrivals.arrived(16, 10 * 80_000 + 40_000)  # sixteen in one read: gaps of 2.5 µs, the most now
    assert arrivals.burst(10 * 80_000 + 40_000, cost_us=0).gap_us == MIN_GAP_US  # type: ignore[union-attr]


def test_a_batchs_fixed_cost_is_fitted_from_the_batches_run() -> None:
    cost = BatchCost()
    assert cost.fixed_us == 0
    for rows in (1, 4, 16, 2, 8):  # 1,100 µs a batch plus 200 µs a row, as wide runs
        cost.observe(rows, 1100 + 200 * rows)
    assert cost.fixed_us == pytest.approx(1100, rel=1e-6)
    only_one_size = BatchCost()
    only_one_size.observe(1, 30)
    assert only_one_size.fixed_us == 30
