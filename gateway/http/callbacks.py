"""Callbacks of asynchronous invocations: every gateway reads the callbacks stream in one group,
POSTs each finished invocation's result to its X-Callback-Url (to the address checked by
gateway.destinations, never an internal one unless allowed), always signed with HMAC-SHA256,
retries with backoff a bounded number of times, and records each attempt's outcome on the
invocation (not the receiver's answer)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import http.client
import logging
import socket
import ssl
import time
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from fngate import keys, queue
from fngate.backoff import backoff_s
from fngate.errors import InvalidArgument
from fngate.fastredis import FastRedis, Script
from gateway.catalog import Catalog
from gateway.destinations import CallbackPolicy, Destination
from gateway.http.results import render
from gateway.invocations import AsyncInvocation

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Fngate-Signature"
MAX_ATTEMPTS = 6
RETRY_BASE_S = 0.5
"""The wait before the second attempt; it doubles after each failure (0.5, 1, 2, 4, 8 s)."""
ATTEMPT_TIMEOUT_S = 10.0
CLAIM_IDLE_MS = 120_000
"""A callback a gateway took and did not finish in this long (it died) is taken by another; longer
than every attempt and wait together."""
CONCURRENCY = 16


def signature(secret: bytes, timestamp_s: int, body: bytes) -> str:
    """`t=<unix s>,v1=<hex HMAC-SHA256 of "<t>." + body>`: what a receiver recomputes with the
    shared secret (and compares in constant time) to know the body came from fngate, unchanged."""
    mac = hmac.new(secret, f"{timestamp_s}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp_s},v1={mac}"


def retry_delay_s(attempt: int) -> float:
    """The wait after failed attempt number `attempt` (from 1)."""
    return float(RETRY_BASE_S * 2 ** (attempt - 1))


class _Pinned(http.client.HTTPConnection):
    """A connection to the address that was checked, whatever the name resolves to by now."""

    def __init__(self, destination: Destination, timeout_s: float) -> None:
        super().__init__(destination.host, destination.port, timeout=timeout_s)
        self._address = destination.address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedTLS(http.client.HTTPSConnection):
    def __init__(self, destination: Destination, timeout_s: float) -> None:
        super().__init__(
            destination.host, destination.port, timeout=timeout_s, context=ssl.create_default_context()
        )
        self._address = destination.address

    def connect(self) -> None:
        raw = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(raw, server_hostname=self.host)  # type: ignore[attr-defined]


def post(
    policy: CallbackPolicy, url: str, body: bytes, headers: dict[str, str], timeout_s: float
) -> tuple[int | None, str]:
    """POST `body` to `url`, resolved once and checked against `policy`, to the address checked,
    following no redirect (a redirect is a failed attempt: a signed body goes only where it was
    addressed); (HTTP status or None, what failed). Blocks: run it in a thread. What failed is an
    exception's class name, never its message, which may hold the URL."""
    try:
        destination = policy.resolve(url)
        pinned = _PinnedTLS if destination.scheme == "https" else _Pinned
        connection = pinned(destination, timeout_s)
        try:
            connection.request("POST", destination.target, body, headers)
            return connection.getresponse().status, ""
        finally:
            connection.close()
    except InvalidArgument:
        return None, "RefusedAddress"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return None, type(exc).__name__


class CallbackSender:
    def __init__(
        self,
        reader: aioredis.Redis,
        scripts: FastRedis,
        gateway_id: str,
        catalog: Catalog,
        secret: bytes,
        block_ms: int,
        policy: CallbackPolicy,
    ) -> None:
        self._redis = reader
        self._block_ms = block_ms
        self._read = Script(scripts, queue.READ_RESULT)
        self._record = Script(scripts, queue.RECORD_CALLBACK)
        self._consumer = gateway_id
        self._catalog = catalog
        self._secret = secret
        self._policy = policy
        self._slots = asyncio.Semaphore(CONCURRENCY)

    async def run(self) -> None:
        """Deliver callbacks until cancelled; a Redis outage is waited out with backoff. What this
        gateway took and did not finish is left pending, for another to claim. Needs a connection
        of its own: XREADGROUP blocks it."""
        failures = 0
        last_claim = 0.0
        async with asyncio.TaskGroup() as deliveries:
            while True:
                try:
                    if failures or not last_claim:
                        await self._ensure_group()
                    taken: list[Any] = []
                    if time.monotonic() - last_claim > CLAIM_IDLE_MS / 2000:
                        last_claim = time.monotonic()
                        claimed: Any = await self._redis.xautoclaim(
                            keys.callbacks(),
                            keys.CALLBACK_GROUP,
                            self._consumer,
                            CLAIM_IDLE_MS,
                            "0-0",
                            count=100,
                        )
                        taken += claimed[1]
                    await self._slots.acquire()  # a free slot before taking more
                    self._slots.release()
                    read: Any = await self._redis.xreadgroup(
                        keys.CALLBACK_GROUP,
                        self._consumer,
                        {keys.callbacks(): ">"},
                        count=CONCURRENCY,
                        block=self._block_ms,
                    )
                    failures = 0
                except (RedisError, OSError) as exc:
                    failures += 1
                    delay_s = backoff_s(failures, cap_s=5.0)
                    log.warning("callback loop: redis unavailable (%s); retrying in %.1f s", exc, delay_s)
                    await asyncio.sleep(delay_s)
                    continue
                for _stream, entries in read or ():
                    taken += entries
                for entry_id, fields in taken:
                    if fields:
                        deliveries.create_task(self._deliver(entry_id, fields))

    async def _ensure_group(self) -> None:
        """The stream and its group; FINISH writes only to a callbacks stream that exists."""
        try:
            await self._redis.xgroup_create(keys.callbacks(), keys.CALLBACK_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _deliver(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        async with self._slots:
            try:
                await self._attempts(fields[queue.FOR].decode())
            except (RedisError, OSError) as exc:  # left pending: claimed again later
                log.warning("callback delivery interrupted: redis unavailable (%s)", exc)
                return
            except Exception:
                log.exception("callback delivery failed unexpectedly; dropped")
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.xack(keys.callbacks(), keys.CALLBACK_GROUP, entry_id)
                    pipe.xdel(keys.callbacks(), entry_id)
                    await pipe.execute()
            except (RedisError, OSError) as exc:  # delivered, not acknowledged: it may go again
                log.warning("callback not acknowledged: redis unavailable (%s)", exc)

    async def _attempts(self, invocation_id: str) -> None:
        result_key = keys.result(invocation_id)
        result = queue.parse_result(await self._read([result_key], [keys.RUNNER_GROUP]))
        if result is None or result.reply is None:
            return  # expired meanwhile; nothing to send
        submission = AsyncInvocation.decode(result.record)
        status, headers, body = render(result, self._catalog)
        headers = {
            "Content-Type": headers.get("content-type", "application/json"),
            "User-Agent": "fngate",
            "X-Fngate-Invocation": invocation_id,
            "X-Fngate-State": headers["x-fngate-state"],
            "X-Fngate-Status": str(status),
        }
        for attempt in range(len(result.callbacks) + 1, MAX_ATTEMPTS + 1):
            headers[SIGNATURE_HEADER] = signature(self._secret, int(time.time()), body)
            answered, failure = await asyncio.to_thread(
                post, self._policy, submission.callback_url, body, headers, ATTEMPT_TIMEOUT_S
            )
            delivered = answered is not None and 200 <= answered < 300
            outcome = "delivered" if delivered else "retrying" if attempt < MAX_ATTEMPTS else "gave_up"
            # What the caller reads of it: never the receiver's answer (its status, or why it failed).
            record = {"attempt": attempt, "at_ms": int(time.time() * 1000), "outcome": outcome}
            await self._record([result_key], [orjson.dumps(record)])
            if delivered:
                return
            log.info("callback of %s: attempt %d failed (%s)", invocation_id, attempt, answered or failure)
            if attempt < MAX_ATTEMPTS:
                await asyncio.sleep(retry_delay_s(attempt))
