"""A finished batch's share of its function version's statistics (Triton's statistics extension,
summed over every runner in one Redis hash): added by the batch's own finish script, no round trip
of its own."""

from __future__ import annotations

import time
from collections.abc import Sequence

from fngate import keys, queue
from fngate.repository import FunctionVersion
from fngate.statistics import BatchOutcome, increments
from fngate.wire import Reply
from runner.outbox import Entry


def of_batch(
    function: FunctionVersion, version: str, batch: Sequence[Entry], replies: Sequence[Reply], started_ns: int
) -> queue.Statistics:
    ended_ns = time.time_ns()
    outcome = BatchOutcome(
        enqueued_ms=[int(entry.id.split(b"-", 1)[0]) for entry in batch],
        rows=[entry.invocation.rows if function.manifest.batched else 1 for entry in batch],
        failed=[reply.error is not None for reply in replies],
        started_ns=started_ns,
        ended_ns=ended_ns,
    )
    return queue.Statistics(
        keys.statistics(function.name, version), increments(outcome), ended_ns // 1_000_000
    )
