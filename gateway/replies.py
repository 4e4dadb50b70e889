"""The one loop that reads this gateway's reply stream and resolves waiting invocations by id."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis

from fngate.wire import Fields, Reply

log = logging.getLogger(__name__)


class ReplyRouter:
    def __init__(self, redis: aioredis.Redis, stream: str, block_ms: int) -> None:
        self._redis = redis
        self.stream = stream
        self._block_ms = block_ms
        self._waiting: dict[str, asyncio.Future[Reply]] = {}

    def expect(self, invocation_id: str) -> asyncio.Future[Reply]:
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[invocation_id] = future
        return future

    def forget(self, invocation_id: str) -> None:
        self._waiting.pop(invocation_id, None)

    async def run(self) -> None:
        """Read replies until cancelled. Needs a connection of its own: XREAD blocks it."""
        last_id = b"0-0"  # the stream is this process's own: nothing in it predates us
        while True:
            response: Any = await self._redis.xread({self.stream: last_id}, count=1000, block=self._block_ms)
            if not response:
                continue
            _, entries = response[0]
            last_id = entries[-1][0]
            for _entry_id, fields in entries:
                self._resolve(fields)

    def _resolve(self, fields: Fields) -> None:
        try:
            reply = Reply.decode(fields)
        except Exception:
            log.exception("dropping a reply that does not decode")
            return
        # A reply delivered to an invocation that waited on an identical one names it in `for`.
        target = fields.get(b"for")
        future = self._waiting.pop(target.decode() if target else reply.id, None)
        if future is not None and not future.done():
            future.set_result(reply)
