"""The one loop that reads this gateway's reply stream and resolves waiting invocations by id.

Replies leave Redis soon after they are read (XTRIM up to the last one read, sent with a next read
in one round trip, at most TRIM_EVERY_S or TRIM_EVERY_ENTRIES after it). The stream lives as long
as its gateway: it is created at start and again after Redis lost it, runners write only to
streams that exist, and a gateway that stops heart-beating has its stream removed by the others
(sweep).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys, queue
from fngate.backoff import backoff_s, stop_if_cancelled
from fngate.fastredis import FastRedis, stream_entries
from fngate.wire import Fields, Reply, replies_of

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
"""How often a gateway says it is alive (and recreates its stream if Redis lost it)."""
GONE_AFTER_S = 15.0
"""A gateway silent this long is gone: its reply stream is removed."""
SWEEP_S = 30.0
TRIM_EVERY_S = 0.05
TRIM_EVERY_ENTRIES = 256
"""Replies read are trimmed from the stream with the next read once this long has passed or this
many were read since the last trim, whichever comes first, and with the first read after an idle
one: not with every read, since Redis answers an XTRIM at once and that answer wakes this process
a second time for each reply it reads."""


class ReplyRouter:
    def __init__(
        self, redis: aioredis.Redis, reads: FastRedis, gateway_id: str, block_ms: int, timeout_s: float
    ) -> None:
        self._redis = redis
        self._reads = reads
        self._timeout_s = timeout_s
        self.gateway_id = gateway_id
        self.stream = keys.replies(gateway_id)
        self._block_ms = block_ms
        self._waiting: dict[str, Callable[[Reply], None]] = {}
        """What each invocation waiting for its reply is told, by invocation id."""
        self.healthy = True
        """False while Redis cannot be read: invocations are refused at once meanwhile."""

    def expect(self, invocation_id: str, receive: Callable[[Reply], None]) -> None:
        """`receive(reply)` once the reply of `invocation_id` comes (and not after `forget`)."""
        self._waiting[invocation_id] = receive

    def forget(self, invocation_id: str) -> None:
        self._waiting.pop(invocation_id, None)

    async def start(self) -> None:
        """Create the stream (runners write only to reply streams that exist) and say we are alive.
        On the reply loop's own connection, which gives up at once when the loop is cancelled."""
        outcomes: tuple[Any, ...] = await asyncio.gather(
            self._reads.execute("XGROUP", "CREATE", self.stream, "alive", "$", "MKSTREAM"),
            self._reads.execute("ZADD", keys.gateways(), time.time() + GONE_AFTER_S, self.gateway_id),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and "BUSYGROUP" not in str(outcome):
                raise outcome

    async def run(self) -> None:
        """Read replies until cancelled; a Redis outage is waited out with backoff. Needs a
        connection of its own: XREAD blocks it."""
        last_id = b"0-0"  # the stream is this process's own: nothing in it predates us
        trimmed_id = last_id
        untrimmed = 0
        trim_at = 0.0
        failures = 0
        next_beat = 0.0
        while True:
            try:
                if time.monotonic() >= next_beat or failures:
                    await self.start()
                    next_beat = time.monotonic() + HEARTBEAT_S
                read = self._reads.execute(
                    *("XREAD", "COUNT", 1000, "BLOCK", self._block_ms, "STREAMS", self.stream, last_id),
                    timeout_s=self._block_ms / 1000 + self._timeout_s,
                )
                now = time.monotonic()
                if last_id == trimmed_id or (untrimmed < TRIM_EVERY_ENTRIES and now < trim_at):
                    response = await read
                else:  # what was read leaves Redis, in the same write as the next read
                    trim = self._reads.execute("XTRIM", self.stream, "MINID", _after(last_id))
                    _, response = await asyncio.gather(trim, read)
                    trimmed_id, untrimmed, trim_at = last_id, 0, now + TRIM_EVERY_S
                failures = 0
                self.healthy = True
            except (RedisError, OSError) as exc:
                stop_if_cancelled(exc)
                failures += 1
                self.healthy = False
                delay_s = backoff_s(failures, cap_s=1.0)  # back within a second of Redis
                log.warning("reply loop: redis unavailable (%s); retrying in %.1f s", exc, delay_s)
                await asyncio.sleep(delay_s)
                continue
            entries = stream_entries(response)
            if not entries:
                trim_at = 0.0  # idle: the next read trims what is left
                continue
            last_id = entries[-1][0]
            untrimmed += len(entries)
            for _entry_id, fields in entries:
                if fields is not None:
                    self._resolve(fields)

    async def sweep(self) -> None:
        """Every SWEEP_S, remove the reply streams of gateways that stopped heart-beating."""
        while True:
            await asyncio.sleep(SWEEP_S)
            with contextlib.suppress(RedisError, OSError):
                gone: Any = await self._redis.zrangebyscore(keys.gateways(), "-inf", time.time())
                for gateway in gone:
                    name = gateway.decode()
                    # One after the other (on a Redis Cluster they are in different slots): the
                    # gateway stays listed until its stream is gone, and a next sweep finishes.
                    await self._redis.delete(keys.replies(name))
                    await self._redis.zrem(keys.gateways(), name)
                    log.info("removed the reply stream of gateway %s, silent for %.0f s", name, GONE_AFTER_S)

    async def stop(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.delete(self.stream)
                pipe.zrem(keys.gateways(), self.gateway_id)
                await pipe.execute()

    def _resolve(self, fields: Fields) -> None:
        """An entry's reply, or a batch's replies to this gateway (packed: fngate.queue.HEADERS)."""
        try:
            replies = replies_of(fields)
        except Exception:
            log.exception("dropping a reply entry that does not decode")
            return
        for reply in replies:
            waiting = queue.answered_id(fields, reply.id)
            # A streamed response keeps the invocation waiting: its own reply ends it.
            receive = self._waiting.get(waiting) if reply.part else self._waiting.pop(waiting, None)
            if receive is not None:
                receive(reply)


def _after(entry_id: bytes) -> str:
    """The smallest stream id after `entry_id`."""
    ms, _, seq = entry_id.decode().partition("-")
    return f"{ms}-{int(seq) + 1}"
