"""When a queued invocation must have started (REJECT), and when it goes behind its level (DELAY)."""

from __future__ import annotations

import numpy as np

from fngate.wire import Invocation
from runner.consumer import is_delayed, start_deadline_ms


def invocation(queue_deadline_ms: int, delay: bool) -> Invocation:
    inputs = {"x": np.zeros((1, 1), dtype=np.float32)}
    return Invocation("id", "f", "1", "r", 5000, inputs, queue_deadline_ms=queue_deadline_ms, delay=delay)


def test_queue_timeouts() -> None:
    table = [
        # queue deadline, delay, now: must start by, delayed
        ((0, False, 4000), (5000, False)),  # no queue timeout: the deadline
        ((3000, False, 4000), (3000, False)),  # REJECT: expires at its queue timeout
        ((9000, False, 4000), (5000, False)),  # a queue timeout past the deadline changes nothing
        ((3000, True, 2000), (5000, False)),  # DELAY, not yet
        ((3000, True, 4000), (5000, True)),  # DELAY, past it: served after its level's others
    ]
    for (queued, delay, now_ms), expected in table:
        item = invocation(queued, delay)
        assert (start_deadline_ms(item), is_delayed(item, now_ms)) == expected
    decoded = Invocation.decode(invocation(3000, True).encode())
    assert (decoded.queue_deadline_ms, decoded.delay) == (3000, True)
    assert "qd" not in invocation(0, False).encode()[b"h"].decode()  # an entry without one is as before
