from __future__ import annotations

import pytest

from fngate.manifest import BatchingSpec
from runner.batching import Run, Wait, plan

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
    assert plan(rows, age_us, POLICY, contended) == expected


def test_batching_off_runs_one_at_a_time() -> None:
    policy = BatchingSpec(max_batch_size=0)
    assert plan([3, 3], 0, policy, True) == Run(1)


def test_no_delay_never_waits() -> None:
    policy = BatchingSpec(max_batch_size=32, max_queue_delay_us=0)
    assert plan([1, 1, 1], 0, policy, True) == Run(3)
