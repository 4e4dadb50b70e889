from __future__ import annotations

import pytest

from fngate.up.scaler import PoolSpec, to_start

SPEC = PoolSpec("default", ("f",), min_replicas=0, max_replicas=3, rows_per_runner=64)
WARM = PoolSpec("warm", ("f",), min_replicas=2, max_replicas=3, rows_per_runner=64)


@pytest.mark.parametrize(
    ("spec", "live", "starting", "backlog", "since_s", "expected"),
    [
        (SPEC, 0, False, 0, 99, 0),  # nothing to do: stay at zero
        (SPEC, 0, False, 1, 99, 1),  # work at zero: one runner
        (SPEC, 1, True, 50, 0, 0),  # a runner still starting counts: 50 cold invocations start one
        (SPEC, 1, False, 64, 99, 0),  # the backlog fits one runner
        (SPEC, 1, False, 65, 99, 1),  # it grows past it: one more
        (SPEC, 1, True, 500, 99, 0),  # one start at a time
        (SPEC, 1, False, 500, 0.2, 0),  # cooldown between starts
        (SPEC, 3, False, 5000, 99, 0),  # never past max_replicas
        (WARM, 0, False, 0, 99, 2),  # min_replicas kept warm
        (WARM, 2, False, 0, 99, 0),
    ],
)
def test_to_start(
    spec: PoolSpec, live: int, starting: bool, backlog: int, since_s: float, expected: int
) -> None:
    assert to_start(spec, live, starting, backlog, since_s, cooldown_s=1.0) == expected
