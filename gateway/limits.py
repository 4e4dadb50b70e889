"""Per-key limits counted in Redis, so that they hold in total across every gateway: a rate with a
burst, a cap on invocations in flight, and a share of each function's queue. The Lua is one function
that the enqueue script can include; here it also runs as a script of its own."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from fngate import keys, queue
from fngate.errors import RateLimited
from fngate.fastredis import FastRedis
from fngate.queue import ADMIT_LUA
from gateway.auth import Principal

log = logging.getLogger(__name__)

ADMIT_SCRIPT = (
    ADMIT_LUA + "return admit(KEYS[1], KEYS[2], KEYS[3], tonumber(ARGV[1]), tonumber(ARGV[2]), "
    "tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]))\n"
)


def admission(principal: Principal, function: str, member: str, ttl_ms: int) -> queue.Admission:
    """The admission of one invocation of `function` by `principal` (ADMIT_SCRIPT's KEYS and ARGV,
    or the enqueue script's, which runs it first); `member` names it in the key's sets until
    released or `ttl_ms` passes."""
    ident = principal.key_id
    return queue.Admission(
        (keys.key_rate(ident), keys.key_in_flight(ident), keys.key_share(ident, function)),
        (principal.rps, principal.burst, principal.max_in_flight, principal.max_queued, member, ttl_ms),
    )


def admitted(principal: Principal, function: str, outcome: list[Any]) -> None:
    """Raise RateLimited for a refusal from ADMIT_SCRIPT."""
    verdict = outcome[0].decode() if isinstance(outcome[0], bytes) else outcome[0]
    if verdict != "ok":
        raise refusal(principal, function, verdict, int(outcome[1]))


def refusal(principal: Principal, function: str, verdict: str, retry_after_ms: int) -> RateLimited:
    """The 429 for an invocation the key's limits refused ('rate', 'share', 'busy', or 'quota': its
    asynchronous results hold their quota)."""
    retry_after_s = max(1, -(-retry_after_ms // 1000))
    who = f"the API key {principal.key_id}"
    if verdict == "rate":
        message = (
            f"{who} is over its rate of {principal.rps:g} invocations per second "
            f"(burst {principal.burst}); retry in {retry_after_s} s"
        )
    elif verdict == "quota":
        message = (
            f"{who} holds as many bytes of asynchronous results as it may (result_quota_bytes, "
            "or its result_memory_share of what Redis may hold); they free as they expire or are "
            f"fetched with ?delete=true: retry in {retry_after_s} s"
        )
    elif verdict == "budget":
        message = (
            f"{who} has used its compute budget of {principal.compute_s_per_min:g} s of batch time this "
            f"minute (compute_s_per_min); retry in {retry_after_s} s"
        )
    elif verdict == "share":
        message = (
            f"{who} has {principal.max_queued} invocations of '{function}' queued or running "
            "(max_queued); retry later"
        )
    else:
        message = f"{who} has {principal.max_in_flight} invocations in flight (max_in_flight); retry later"
    return RateLimited(message, retry_after_s)


class Limiter:
    """Makes each limited invocation's admission (which the enqueue script checks first, in the same
    round trip) and takes the invocation out of the key's sets when it is over."""

    def __init__(self, in_flight_ttl_s: float, redis: FastRedis) -> None:
        self._redis = redis
        """The enqueue's connection: a release goes to Redis ahead of the caller's next enqueue."""
        self._ttl_ms = int(in_flight_ttl_s * 1000)

    @property
    def ttl_ms(self) -> int:
        """How long an admitted invocation holds its place if nobody releases it (a dead gateway)."""
        return self._ttl_ms

    def admission(self, principal: Principal, function: str) -> queue.Admission:
        """A new invocation's admission, checked by the enqueue script in its own round trip."""
        return admission(principal, function, uuid.uuid4().hex, self._ttl_ms)

    def release(
        self, principal: Principal, function: str, admit: queue.Admission
    ) -> asyncio.Future[Any] | None:
        """Take the invocation out of the key's sets; the future of Redis's answer (None when the
        key's limits hold no place: a rate alone). A failure is logged, and the place lapses at
        its expiry."""
        if not (principal.max_in_flight or principal.max_queued):
            return None
        ident, member = principal.key_id, admit.args[4]
        self._redis.send("ZREM", keys.key_in_flight(ident), member).add_done_callback(_released)
        done = self._redis.send("ZREM", keys.key_share(ident, function), member)
        done.add_done_callback(_released)
        return done  # replies come in order: once this one is in, both are


def _released(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("could not release an invocation from its key's limits: %s", future.exception())
