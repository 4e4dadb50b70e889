"""The loading rule's deadline (runner.models.load_deadline_ms): time an invocation spent waiting
for its model's load does not count against its deadline, up to the model's load_timeout_s, when
that wait began before its deadline."""

from __future__ import annotations

import pytest

from runner.models import load_deadline_ms

DEADLINE_MS = 10_000
"""An invocation queued at 9000 ms with a timeout of 1000 ms."""
QUEUED_MS = 9_000
LOAD_TIMEOUT_MS = 5_000


@pytest.mark.parametrize(
    ("began_ms", "ready_ms", "now_ms", "expected_ms", "case"),
    [
        (7_000, 8_000, 20_000, DEADLINE_MS, "queued after the load: its own deadline"),
        (7_000, 9_000, 20_000, DEADLINE_MS, "queued as the load completed: its own deadline"),
        (9_100, 12_000, 12_500, 13_000, "queued during a 3 s wait for the load: the deadline moves 3 s"),
        (9_100, 30_000, 30_500, 15_000, "a wait longer than load_timeout_s: the deadline moves by that"),
        (9_100, None, 11_000, 12_000, "still to load: the wait so far does not count"),
        (9_100, None, 40_000, 15_000, "still to load long past load_timeout_s: expired at the bound"),
        (10_000, 12_000, 12_500, DEADLINE_MS, "the runner or load began at the deadline: no more time"),
        (11_000, None, 11_500, DEADLINE_MS, "began after the deadline (answered 504 already): expired"),
    ],
)
def test_the_wait_for_the_load_does_not_count_up_to_load_timeout(
    began_ms: int, ready_ms: int | None, now_ms: int, expected_ms: int, case: str
) -> None:
    found = load_deadline_ms(DEADLINE_MS, QUEUED_MS, began_ms, ready_ms, now_ms, LOAD_TIMEOUT_MS)
    assert found == expected_ms, case
