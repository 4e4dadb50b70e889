"""Backoff delays (a table of ranges over many draws) and the health record readiness reads
(an injected clock)."""

from __future__ import annotations

import pytest

from fngate.backoff import Backoff, Health, backoff_s


@pytest.mark.parametrize(
    ("failures", "low", "high"),
    [(1, 0.05, 0.1), (2, 0.1, 0.2), (3, 0.2, 0.4), (4, 0.4, 0.8), (5, 0.5, 1.0), (10_000, 0.5, 1.0)],
)
def test_delay_doubles_up_to_the_cap_with_jitter(failures: int, low: float, high: float) -> None:
    draws = [backoff_s(failures, base_s=0.1, cap_s=1.0) for _ in range(200)]
    assert all(low <= draw <= high for draw in draws)
    assert len(set(draws)) > 100  # jittered: clients that failed together do not retry together


def test_backoff_resets_after_a_success() -> None:
    backoff = Backoff(base_s=1.0, cap_s=8.0)
    assert [backoff.failed() >= floor for floor in (0.5, 1.0, 2.0, 4.0)] == [True] * 4
    backoff.succeeded()
    assert backoff.failed() <= 1.0


def test_health_is_down_from_the_first_failure_to_the_next_success() -> None:
    now = [100.0]
    health = Health("redis", clock=lambda: now[0])
    assert health.available
    health.failed("catalog", ConnectionError("refused"))
    now[0] = 102.5
    health.failed("activator", TimeoutError())
    assert not health.available
    assert health.down_for_s() == 2.5
    assert health.last_error == "TimeoutError: "
    health.succeeded()
    assert health.available
    assert health.down_for_s() == 0.0
