"""A batch's FINISH and a pipeline's FORWARD on a Redis Cluster, where one script cannot reach the
reply streams of other gateways or the streams of other functions (fngate.queue.slots).

FINISH: the replies of other slots (and, ahead of them, their cache entries) are delivered first,
then FINISH runs on the function's slot; identical invocations that waited on these get the answer
before the entries are acknowledged: FINISH names the ones that joined since the last look, they
are answered, and it runs again. A runner that dies before FINISH leaves its entries pending:
another runs them again and delivers again, and each gateway answers an invocation once (the first
reply; the rest find nobody waiting). Nothing answered is lost, and no caller hears twice. A
callback (sent from the stored result) is queued after FINISH: a runner that dies between the
two leaves the result stored and its callback unsent.

FORWARD: each slot's entries all or none; a pipeline's later steps on several slots are queued one
slot after another, so a full queue can refuse the pipeline after another slot's steps were queued
(they run, and their result finds the pipeline answered)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.asyncio as aioredis

from fngate import keys, queue
from fngate.pipelined import PipelinedRedis, Script
from fngate.queue import slots

Run = Callable[[str, list[str], list[Any]], Awaitable[Any]]
"""Runs a script (its source) with KEYS and ARGV, loading it where Redis has not yet."""


def scripts(redis: PipelinedRedis) -> Run:
    """Run with the hot path's client (one fngate.pipelined.Script per source)."""
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
) -> None:
    """queue.FINISH's work (see queue.finish_call) across the slots of a Redis Cluster."""
    split = slots.split_replies(stream, replies)
    outgoing, deliveries = split.kept, split.deliveries
    for marker, reply in split.markers:  # waiters in another slot: answered before, forgotten after
        waiting = map(queue.Waiter.decode, await run(slots.WAITERS, [queue.waiters(marker)], []))
        deliveries += [slots.Delivery(waiter.stream, reply, answers=waiter.id) for waiter in waiting]
    answered: dict[int, int] = {}
    callbacks: list[slots.Delivery] = []
    while True:
        # A callback is sent from the stored result: it is queued once FINISH has stored it.
        callbacks += [item for item in deliveries if item.key == keys.callbacks()]
        await deliver(run, [item for item in deliveries if item.key != keys.callbacks()], reply_maxlen)
        call = queue.finish_call(
            stream, group, outgoing, entry_ids, entry_bytes, reply_maxlen, statistics, answered
        )
        joined = slots.parse_finish(await run(queue.FINISH, call.keys, call.args))
        if not joined:
            break
        deliveries = []
        for index, waiters in joined:
            answered[index] = answered.get(index, 0) + len(waiters)
            reply = outgoing[index].reply
            deliveries += [slots.Delivery(waiter.stream, reply, answers=waiter.id) for waiter in waiters]
    await deliver(run, callbacks, reply_maxlen)
    for marker, _ in split.markers:
        await run(slots.FORGET, [marker, queue.waiters(marker)], [])


async def deliver(run: Run, deliveries: Sequence[slots.Delivery], reply_maxlen: int) -> None:
    """DELIVER, one call per slot, all at once: the cache entries first, then the replies (a
    caller that repeats its request as soon as it is answered finds the answer cached)."""
    cached = [item for item in deliveries if item.is_cached]
    if cached:
        await _deliver(run, cached, reply_maxlen)
    await _deliver(run, [item for item in deliveries if not item.is_cached], reply_maxlen)


async def _deliver(run: Run, deliveries: Sequence[slots.Delivery], reply_maxlen: int) -> None:
    calls = slots.deliver_calls(deliveries, reply_maxlen)
    done = await asyncio.gather(
        *(run(slots.DELIVER, call.keys, list(call.args)) for call in calls), return_exceptions=True
    )
    for outcome in done:
        if isinstance(outcome, BaseException):
            raise outcome


async def forward(run: Run, entries: Sequence[queue.Forward]) -> tuple[int, str] | None:
    """queue.FORWARD slot by slot: None when all are queued, else (index of an entry refused,
    'count' or 'bytes'); the slots before it stay queued."""
    for indexes, call in slots.forward_calls(entries):
        refused = queue.parse_forward(await run(queue.FORWARD, call.keys, list(call.args)))
        if refused is not None:
            return indexes[refused[0]], refused[1]
    return None
