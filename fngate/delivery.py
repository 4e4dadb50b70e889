"""A batch's FINISH and a pipeline's FORWARD on a Redis Cluster, where one script cannot reach the
reply streams of other gateways or the streams of other functions (fngate.queue.slots).

FINISH: the replies of other slots (and, ahead of them, their cache entries) are delivered first,
then FINISH runs on the function's slot; identical invocations that waited on these get the answer
before the entries are acknowledged: FINISH names the ones that joined since the last look, they
are answered, and it runs again. A runner that dies before FINISH leaves its entries pending:
another runs them again and delivers again, and each gateway answers an invocation once (the first
reply; the rest find nobody waiting). Nothing answered is lost, and no caller hears twice. A
callback (sent from the stored result) is queued after FINISH: a runner that dies between the
two leaves the result stored and its callback unsent. An asynchronous result's bytes are charged
to its key's quota (on the key's slot, CHARGE) after FINISH, by the call that stored it (DELIVER or
FINISH; a result stored before is not stored again, nor charged): never twice, and not at all when
the runner dies between the two or the quota's slot cannot be reached.

FORWARD: each slot's entries all or none; a pipeline's later steps on several slots are queued one
slot after another, so a full queue can refuse the pipeline after another slot's steps were queued
(they run, and their result finds the pipeline answered)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys, queue
from fngate.fastredis import FastRedis, Script
from fngate.queue import slots
from fngate.queue.steps import forwarded_ids
from fngate.queue.stored import Charge, parse_charges

log = logging.getLogger(__name__)

Run = Callable[[str, list[str], list[Any]], Awaitable[Any]]
"""Runs a script (its source) with KEYS and ARGV, loading it where Redis has not yet."""


def scripts(redis: FastRedis) -> Run:
    """Run with the hot path's client (one fngate.fastredis.Script per source)."""
    loaded: dict[str, Script] = {}

    async def run(source: str, keys: list[str], args: list[Any]) -> Any:
        script = loaded.get(source)
        if script is None:
            script = loaded[source] = Script(redis, source)
        return await script(keys, args)

    return run


def registered(redis: aioredis.Redis) -> Run:
    """Run with redis-py's client (its registered scripts)."""

    async def run(source: str, keys: list[str], args: list[Any]) -> Any:
        return await redis.register_script(source)(keys=keys, args=args)

    return run


async def finish(
    run: Run,
    stream: str,
    group: str,
    replies: Sequence[queue.Outgoing],
    entry_ids: Sequence[bytes],
    entry_bytes: int,
    reply_maxlen: int,
    statistics: queue.Statistics | None = None,
    extra: int = 0,
) -> None:
    """queue.FINISH's work (see queue.finish_call) across the slots of a Redis Cluster."""
    split = slots.split_replies(stream, replies)
    outgoing, deliveries = split.kept, split.deliveries
    for marker, reply in split.markers:  # waiters in another slot: answered before, forgotten after
        waiting = map(queue.Waiter.decode, await run(slots.WAITERS, [queue.waiters(marker)], []))
        deliveries += [slots.Delivery(waiter.stream, reply, answers=waiter.id) for waiter in waiting]
    answered: dict[int, int] = {}
    callbacks: list[slots.Delivery] = []
    owed: list[Charge] = []
    while True:
        # A callback is sent from the stored result: it is queued once FINISH has stored it.
        callbacks += [item for item in deliveries if item.key == keys.callbacks()]
        answers = [item for item in deliveries if item.key != keys.callbacks()]
        owed += await deliver(run, answers, reply_maxlen)
        call = queue.finish_call(
            stream, group, outgoing, entry_ids, entry_bytes, reply_maxlen, statistics, answered, extra
        )
        finished = await run(queue.FINISH, call.keys, call.args)
        owed += slots.parse_owed(finished)
        joined = slots.parse_finish(finished)
        if not joined:
            break
        deliveries = []
        for index, waiters in joined:
            answered[index] = answered.get(index, 0) + len(waiters)
            reply = outgoing[index].reply
            deliveries += [slots.Delivery(waiter.stream, reply, answers=waiter.id) for waiter in waiters]
    await charge(run, owed)
    await deliver(run, callbacks, reply_maxlen)
    for marker, _ in split.markers:
        await run(slots.FORGET, [marker, queue.waiters(marker)], [])


async def deliver(run: Run, deliveries: Sequence[slots.Delivery], reply_maxlen: int) -> list[Charge]:
    """DELIVER, one call per slot, all at once: the cache entries first, then the replies (a
    caller that repeats its request as soon as it is answered finds the answer cached). Answers
    what the results it stored owe quotas in other slots."""
    cached = [item for item in deliveries if item.is_cached]
    if cached:
        await _deliver(run, cached, reply_maxlen)
    return await _deliver(run, [item for item in deliveries if not item.is_cached], reply_maxlen)


async def _deliver(run: Run, deliveries: Sequence[slots.Delivery], reply_maxlen: int) -> list[Charge]:
    calls = slots.deliver_calls(deliveries, reply_maxlen)
    done = await all_answered(run(slots.DELIVER, call.keys, list(call.args)) for call in calls)
    return [charge for outcome in done for charge in parse_charges(outcome)]


async def all_answered(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Each call's answer, all sent at once; the first error raised once every call answered (so
    that none is still running when the caller undoes what the others did)."""
    done = await asyncio.gather(*calls, return_exceptions=True)
    for outcome in done:
        if isinstance(outcome, BaseException):
            raise outcome
    return list(done)


async def charge(run: Run, charges: Sequence[Charge]) -> None:
    """CHARGE, one call per quota, all at once. One that fails leaves its results uncounted (they
    are stored and kept all the same): logged, never raised, so that the batch is acknowledged."""
    calls = slots.charge_calls(charges)
    done = await asyncio.gather(
        *(run(slots.CHARGE, call.keys, list(call.args)) for call in calls), return_exceptions=True
    )
    for call, outcome in zip(calls, done, strict=True):
        if isinstance(outcome, RedisError | OSError):
            log.warning("results' bytes not charged to %s: %s", call.keys[0], outcome)
        elif isinstance(outcome, BaseException):
            raise outcome


async def forward(
    run: Run, entries: Sequence[queue.Forward], queued: list[tuple[int, bytes]] | None = None
) -> tuple[int, str] | None:
    """queue.FORWARD slot by slot: None when all are queued, else (index of an entry refused,
    'count' or 'bytes'); the slots before it stay queued. `queued` gets (index, entry id) of each
    entry queued."""
    for indexes, call in slots.forward_calls(entries):
        raw = await run(queue.FORWARD, call.keys, list(call.args))
        refused = queue.parse_forward(raw)
        if refused is not None:
            return indexes[refused[0]], refused[1]
        if queued is not None:
            queued += zip(indexes, forwarded_ids(raw), strict=True)
    return None
