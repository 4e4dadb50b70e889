"""Asynchronous invocations after their submission (gateway.dispatch submits them): the gateway's
record of one, reading its result (waiting for it, for a long-poll) and cancelling it before it
starts. The result lives in Redis (fngate.queue, asynchronous section), so any gateway answers;
front ends render it."""

from __future__ import annotations

import dataclasses
import hashlib
import time

import orjson
from redis.exceptions import RedisError

from fngate import clients, keys, queue
from fngate.errors import FunctionNotFound, InvalidArgument, Unavailable
from fngate.fastredis import FastRedis, Script
from fngate.queue import slots
from gateway.auth import ADMIN, INVOKE, Principal
from gateway.catalog import Catalog
from gateway.slots import SlotSteps

MAX_WAIT_S = 60.0
"""The longest long-poll (`?wait=`) one request may hold."""
BLOCK_S = 5.0
"""One XREAD of a long-poll blocks at most this long (under its connection's socket timeout)."""
MAX_CALLBACK_URL = 2048
MAX_IDEMPOTENCY_KEY = 256
LONG_POLLS = 128
"""Long-polls one gateway holds at once, each on a connection of its own; more wait for one."""


@dataclasses.dataclass(frozen=True, slots=True)
class AsyncInvocation:
    """An asynchronous invocation as the gateway records it: what answering it later needs."""

    id: str
    function: str
    version: str
    dialect: str
    """'v1' or 'v2': how its result is rendered."""
    key_id: str
    """The API key that submitted it: the only one (besides admins) that may read it."""
    deadline_ms: int
    request_id: str | None = None
    binary_outputs: tuple[str, ...] = ()
    callback_url: str = ""
    outputs: tuple[str, ...] | None = None
    """The outputs asked for, when its reply holds them all (a pipeline's); None: as it comes."""

    def encode(self) -> bytes:
        """Without the fields left at their defaults: a result keeps this record as long as its reply."""
        defaults = {field.name: field.default for field in dataclasses.fields(self)}
        doc = {name: value for name, value in dataclasses.asdict(self).items() if value != defaults[name]}
        return orjson.dumps(doc)

    @classmethod
    def decode(cls, raw: bytes) -> AsyncInvocation:
        doc = orjson.loads(raw)
        doc["binary_outputs"] = tuple(doc.get("binary_outputs", ()))
        if doc.get("outputs") is not None:
            doc["outputs"] = tuple(doc["outputs"])
        if "route" in doc:  # a record written before the field was named `dialect`
            doc["dialect"] = doc.pop("route")
        return cls(**doc)


@dataclasses.dataclass(frozen=True, slots=True)
class Accepted:
    invocation_id: str
    again: bool = False
    """A resubmission with the same Idempotency-Key: the first invocation's id."""
    done: bool = False
    """Answered from the response cache: its result is there already."""


class IdempotencyKeyReused(InvalidArgument):
    """An Idempotency-Key sent again with another request (HTTP answers 422 rather than 400)."""


class AsyncInvocations:
    """Reads, waits on and cancels asynchronous invocations."""

    def __init__(
        self,
        scripts: FastRedis,
        redis_url: str,
        redis_timeout_s: float,
        catalog: Catalog,
        quotas: bool = False,
    ) -> None:
        """`quotas`: results are charged to their keys' quotas (result_quota_bytes or
        result_memory_share), and a dropped one is freed from its key's."""
        self.catalog = catalog
        self._read = Script(scripts, queue.READ_RESULT)
        self._cancel = Script(scripts, queue.CANCEL)
        self._drop = Script(scripts, queue.DROP_RESULT)
        self._uncharge = Script(scripts, slots.UNCHARGE)
        self._quotas = quotas
        self._slots = SlotSteps(scripts) if scripts.cluster else None
        """A Redis Cluster's: a pipeline's first steps cancelled slot by slot (gateway.slots)."""
        # Long-polls block their connection: a pool of their own, apart from the invocations'.
        self._polls = clients.connect_pool(
            redis_url,
            LONG_POLLS,
            BLOCK_S,  # all taken: a 503 after this long, never an unbounded wait
            socket_connect_timeout=redis_timeout_s,
            socket_timeout=BLOCK_S + redis_timeout_s,
        )

    async def aclose(self) -> None:
        await self._polls.aclose()

    async def read(self, invocation_id: str, principal: Principal, wait_s: float = 0) -> queue.Result:
        """The invocation's result or state; waits up to `wait_s` for it to finish. Raises
        FunctionNotFound for an id that is unknown, expired or not the caller's."""
        result = await self._read_once(invocation_id, principal)
        deadline = time.monotonic() + min(wait_s, MAX_WAIT_S)
        while is_pending(result) and (left_s := deadline - time.monotonic()) > 0:
            try:
                await self._polls.xread(
                    {keys.result(invocation_id): result.last_id},
                    count=1,
                    block=int(min(left_s, BLOCK_S) * 1000),
                )
            except (RedisError, OSError) as exc:
                raise Unavailable(f"the queue is unavailable: {exc}") from exc
            result = await self._read_once(invocation_id, principal)
        return result

    async def cancel(self, invocation_id: str, principal: Principal) -> str:
        """Cancel an invocation no runner has taken: 'cancelled', or 'running' / 'done' (too late)."""
        await self._read_once(invocation_id, principal)  # the caller's own, or not found
        try:
            if self._slots is not None:
                outcome = await self._slots.cancel(invocation_id)
            else:
                outcome = queue.cancel_outcome(
                    await self._cancel([keys.result(invocation_id)], [keys.RUNNER_GROUP])
                )
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        if outcome == "gone":
            raise _not_found(invocation_id)
        return outcome

    async def drop(self, invocation_id: str, result: queue.Result) -> None:
        """Drop a result its caller has read (no longer pending), before its TTL: its bytes are
        freed from its key's quota; a callback not yet sent is not sent; its Idempotency-Key is
        free again."""
        result_key = keys.result(invocation_id)
        key_id = AsyncInvocation.decode(result.record).key_id
        quota = keys.result_quota(key_id) if self._quotas else ""
        try:
            if self._slots is None:
                await self._drop([result_key, quota], [])
                return
            owed = await self._drop([result_key, ""], [])  # the quota is in the key's slot
            if owed and quota:
                await self._uncharge([quota], [int(owed[0]), int(owed[1])])
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc

    async def _read_once(self, invocation_id: str, principal: Principal) -> queue.Result:
        if not _is_id(invocation_id):
            raise _not_found(invocation_id)
        try:
            raw = await self._read([keys.result(invocation_id)], [keys.RUNNER_GROUP])
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        result = queue.parse_result(raw)
        if result is None or not _may_read(principal, AsyncInvocation.decode(result.record)):
            raise _not_found(invocation_id)
        return result


class RequestDigest:
    """What an Idempotency-Key is bound to: the function, the dialect (v1 or v2) and the body,
    fed a chunk at a time as it arrives; the first two length-prefixed and the body's length after
    it, so that no two requests share a preimage."""

    __slots__ = ("_hash", "_size")

    def __init__(self, function: str, dialect: str) -> None:
        self._hash = hashlib.blake2b(digest_size=16, person=b"fngate-idem-v2")
        self._size = 0
        for part in (function.encode(), dialect.encode()):
            self._hash.update(len(part).to_bytes(8, "little"))
            self._hash.update(part)

    def update(self, chunk: bytes) -> None:
        self._hash.update(chunk)
        self._size += len(chunk)

    def hexdigest(self) -> str:
        final = self._hash.copy()
        final.update(self._size.to_bytes(8, "little"))
        return final.hexdigest()


def request_digest(function: str, dialect: str, body: bytes) -> str:
    """RequestDigest of a body received whole."""
    digest = RequestDigest(function, dialect)
    digest.update(body)
    return digest.hexdigest()


def is_pending(result: queue.Result) -> bool:
    """Queued or running, before its deadline: a reply may still come."""
    if result.state not in ("queued", "running"):
        return False
    return AsyncInvocation.decode(result.record).deadline_ms > time.time() * 1000


def _may_read(principal: Principal, submission: AsyncInvocation) -> bool:
    if ADMIN in principal.scopes:
        return True
    return principal.key_id == submission.key_id and principal.allows(INVOKE, submission.function)


def _is_id(text: str) -> bool:
    return len(text) == 32 and all(char in "0123456789abcdef" for char in text)


def _not_found(invocation_id: str) -> FunctionNotFound:
    return FunctionNotFound(f"no invocation '{invocation_id[:64]}' (unknown, expired, or not this key's)")


def check_callback_url(raw: str | None) -> str:
    """A callback URL as sent ('' for none); refused unless an http(s) URL of at most
    MAX_CALLBACK_URL characters."""
    if raw is None:
        return ""
    url = raw.strip()
    if len(url) > MAX_CALLBACK_URL or not url.startswith(("https://", "http://")) or " " in url:
        raise InvalidArgument("X-Callback-Url must be an http(s) URL of at most 2048 characters")
    return url


def check_idempotency_key(raw: str | None) -> str:
    if raw is None:
        return ""
    value = raw.strip()
    if not value or len(value) > MAX_IDEMPOTENCY_KEY:
        raise InvalidArgument(f"Idempotency-Key must have 1 to {MAX_IDEMPOTENCY_KEY} characters")
    return value
