"""Adds a finished batch to its function version's statistics hash in Redis (Triton's statistics
extension, summed over every runner): one pipelined round trip, after the replies are sent."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys
from fngate.repository import FunctionVersion
from fngate.statistics import LAST_INFERENCE, BatchOutcome, increments
from fngate.wire import Reply
from runner.outbox import Entry

log = logging.getLogger(__name__)


async def record(
    redis: aioredis.Redis,
    function: FunctionVersion,
    version: str,
    batch: Sequence[Entry],
    replies: Sequence[Reply],
    started_ns: int,
) -> None:
    """Never raises for Redis: statistics are lost rather than the batch's bookkeeping disturbed."""
    ended_ns = time.time_ns()
    outcome = BatchOutcome(
        enqueued_ms=[int(entry.id.split(b"-", 1)[0]) for entry in batch],
        rows=[entry.invocation.rows if function.manifest.batched else 1 for entry in batch],
        failed=[reply.error is not None for reply in replies],
        started_ns=started_ns,
        ended_ns=ended_ns,
    )
    key = keys.statistics(function.name, version)
    try:
        async with redis.pipeline(transaction=False) as pipe:
            for field, amount in increments(outcome).items():
                pipe.hincrby(key, field, amount)
            pipe.hset(key, LAST_INFERENCE, ended_ns // 1_000_000)
            await pipe.execute()
    except (RedisError, OSError) as exc:
        log.warning("%s: statistics of a batch not recorded (%s)", function.name, exc)
