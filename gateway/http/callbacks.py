"""Callbacks of asynchronous invocations: every gateway reads the callbacks stream in one group,
POSTs each finished invocation's result to its X-Callback-Url (to the address checked by
gateway.destinations, never an internal one unless allowed), always signed with HMAC-SHA256,
retries with backoff a bounded number of times, and records each attempt's outcome on the
invocation (not the receiver's answer). Every way an attempt can fail (a name that no longer
resolves or is refused, a connection refused or reset, a receiver too slow: one deadline covers
the whole attempt) is a failed attempt, recorded. Attempts are bounded per tenant (the API key
that submitted the invocation; without auth, the receiver's host), so that slow receivers hold
their own tenant's deliveries and no one else's."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import ssl
import time
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from fngate import keys, queue
from fngate.backoff import backoff_s, stop_if_cancelled
from fngate.errors import InvalidArgument
from fngate.fastredis import FastRedis, Script
from gateway.catalog import Catalog
from gateway.destinations import CallbackPolicy, Destination, Unresolved, parse
from gateway.http.results import render
from gateway.invocations import AsyncInvocation

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Fngate-Signature"
MAX_ATTEMPTS = 6
RETRY_BASE_S = 0.5
"""The wait before the second attempt; it doubles after each failure (0.5, 1, 2, 4, 8 s)."""
ATTEMPT_TIMEOUT_S = 10.0
"""One attempt's deadline, all of it: resolving the name, connecting, sending, and the response's
head (its body is not read)."""
MAX_RESPONSE_HEAD_BYTES = 16 * 1024
CLAIM_IDLE_MS = 120_000
"""A callback a gateway took and did not finish in this long (it died) is taken by another. A
gateway keeps what it holds from being taken (HEARTBEAT_S) however long it waits."""
HEARTBEAT_S = CLAIM_IDLE_MS / 4000
CONCURRENCY = 256
"""Attempts one gateway makes at once."""
TENANT_CONCURRENCY = 8
"""Attempts one gateway makes at once for one tenant: its slow receivers hold these, not the others'."""
MAX_HELD = 4096
"""Callbacks one gateway holds at once (sending, waiting for a turn or for a retry); past it, the
stream is not read."""
TENANT_MAX_HELD = 1024
"""Callbacks one gateway holds at once for one tenant; more are left pending, for a later claim
(CLAIM_IDLE_MS), so that one tenant's backlog never keeps the others' from being read."""


def signature(secret: bytes, timestamp_s: int, body: bytes) -> str:
    """`t=<unix s>,v1=<hex HMAC-SHA256 of "<t>." + body>`: what a receiver recomputes with the
    shared secret (and compares in constant time) to know the body came from fngate, unchanged."""
    mac = hmac.new(secret, f"{timestamp_s}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp_s},v1={mac}"


def retry_delay_s(attempt: int) -> float:
    """The wait after failed attempt number `attempt` (from 1)."""
    return float(RETRY_BASE_S * 2 ** (attempt - 1))


class BadResponse(Exception):
    """What came back is no HTTP/1.x response head."""


async def post(
    policy: CallbackPolicy, url: str, body: bytes, headers: dict[str, str], timeout_s: float
) -> tuple[int | None, str]:
    """POST `body` to `url`, resolved once and checked against `policy`, to the address checked,
    following no redirect (a redirect is a failed attempt: a signed body goes only where it was
    addressed), all within `timeout_s`; (HTTP status or None, what failed). Never raises but
    cancellation: what failed is an exception's class name, never its message, which may hold the
    URL."""
    try:
        async with asyncio.timeout(timeout_s):
            destination = await policy.resolve_async(url)
            return await _exchange(destination, body, headers), ""
    except Unresolved:
        return None, "Unresolved"
    except InvalidArgument:
        return None, "RefusedAddress"
    except TimeoutError:
        return None, "Timeout"
    except Exception as exc:  # every other failure of an attempt is a failed attempt
        return None, type(exc).__name__


async def _exchange(destination: Destination, body: bytes, headers: dict[str, str]) -> int:
    """One request on a connection of its own to the checked address; the response's status."""
    tls = ssl.create_default_context() if destination.scheme == "https" else None
    reader, writer = await asyncio.open_connection(
        destination.address,
        destination.port,
        ssl=tls,
        server_hostname=destination.host if tls else None,
        limit=MAX_RESPONSE_HEAD_BYTES,
    )
    try:
        writer.write(request_head(destination, len(body), headers) + body)
        await writer.drain()
        while True:
            status = response_status(await reader.readuntil(b"\r\n\r\n"))
            if status >= 200 or status == 101:  # an interim answer (100, 103): the final one follows
                return status
    finally:
        writer.transport.abort()  # its body unread, nothing to wait for


def request_head(destination: Destination, length: int, headers: dict[str, str]) -> bytes:
    host = f"[{destination.host}]" if ":" in destination.host else destination.host.encode("idna").decode()
    if destination.port != (443 if destination.scheme == "https" else 80):
        host += f":{destination.port}"
    lines = [f"POST {destination.target} HTTP/1.1", f"Host: {host}", f"Content-Length: {length}"]
    lines += ["Connection: close", *(f"{name}: {value}" for name, value in headers.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1")


def response_status(head: bytes) -> int:
    """The status code of a response head (`HTTP/1.1 204 No Content\r\n...`)."""
    version, _, rest = head.partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit() or rest[3:4] not in b" \r":
        raise BadResponse("not an HTTP/1.x response")
    return int(code)


@dataclasses.dataclass
class _Tenant:
    """What one gateway holds for one tenant."""

    slots: asyncio.Semaphore = dataclasses.field(
        default_factory=lambda: asyncio.Semaphore(TENANT_CONCURRENCY)
    )
    held: int = 0


def tenant_of(submission: AsyncInvocation) -> str:
    """Whose turn an attempt takes: the API key that submitted it; without auth (no key), the host
    of the receiver."""
    if submission.key_id:
        return f"key {submission.key_id}"
    try:
        return f"host {parse(submission.callback_url).host.lower()}"
    except InvalidArgument:
        return "host ?"


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
        self._tenants: dict[str, _Tenant] = {}
        self._held: set[bytes] = set()
        """The entries this gateway took and has not finished."""
        self._freed = asyncio.Event()

    async def run(self) -> None:
        """Deliver callbacks until cancelled; a Redis outage is waited out with backoff. What this
        gateway took and did not finish is left pending, for another to claim. Needs a connection
        of its own: XREADGROUP blocks it."""
        failures = 0
        last_claim = 0.0
        last_heartbeat = time.monotonic()
        async with asyncio.TaskGroup() as deliveries:
            while True:
                try:
                    if failures or not last_claim:
                        await self._ensure_group()
                    if self._held and time.monotonic() - last_heartbeat > HEARTBEAT_S:
                        last_heartbeat = time.monotonic()
                        await self._keep_held()
                    if len(self._held) >= MAX_HELD:
                        await self._wait_for_room()
                        continue
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
                    read: Any = await self._redis.xreadgroup(
                        keys.CALLBACK_GROUP,
                        self._consumer,
                        {keys.callbacks(): ">"},
                        count=min(TENANT_CONCURRENCY * 8, MAX_HELD - len(self._held)),
                        block=self._block_ms,
                    )
                    failures = 0
                except (RedisError, OSError) as exc:
                    stop_if_cancelled(exc)
                    failures += 1
                    delay_s = backoff_s(failures, cap_s=5.0)
                    log.warning("callback loop: redis unavailable (%s); retrying in %.1f s", exc, delay_s)
                    await asyncio.sleep(delay_s)
                    continue
                for _stream, entries in read or ():
                    taken += entries
                for entry_id, fields in taken:
                    if fields and entry_id not in self._held:
                        self._held.add(entry_id)
                        deliveries.create_task(self._deliver(entry_id, fields))

    async def _ensure_group(self) -> None:
        """The stream and its group; FINISH writes only to a callbacks stream that exists."""
        try:
            await self._redis.xgroup_create(keys.callbacks(), keys.CALLBACK_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _keep_held(self) -> None:
        """Reset the idle time of what this gateway holds (JUSTID: no delivery counted), so that
        no gateway claims a callback that only waits its turn or its retry here."""
        ids: list[bytes | str | int | memoryview] = list(self._held)
        await self._redis.xclaim(keys.callbacks(), keys.CALLBACK_GROUP, self._consumer, 0, ids, justid=True)

    async def _wait_for_room(self) -> None:
        self._freed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await self._freed.wait()

    async def _deliver(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        try:
            finished = await self._attempts(fields[queue.FOR].decode())
        except (RedisError, OSError) as exc:  # left pending: claimed again later
            log.warning("callback delivery interrupted: redis unavailable (%s)", exc)
            finished = False
        except Exception:
            log.exception("callback delivery failed unexpectedly; dropped")
            finished = True
        finally:
            self._held.discard(entry_id)
            self._freed.set()
        if not finished:
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xack(keys.callbacks(), keys.CALLBACK_GROUP, entry_id)
                pipe.xdel(keys.callbacks(), entry_id)
                await pipe.execute()
        except (RedisError, OSError) as exc:  # delivered, not acknowledged: it may go again
            log.warning("callback not acknowledged: redis unavailable (%s)", exc)

    async def _attempts(self, invocation_id: str) -> bool:
        """Every attempt the callback has left; False when it is left pending (its tenant holds
        as many here as it may)."""
        result_key = keys.result(invocation_id)
        result = queue.parse_result(await self._read([result_key], [keys.RUNNER_GROUP]))
        if result is None or result.reply is None:
            return True  # expired or dropped meanwhile; nothing to send
        submission = AsyncInvocation.decode(result.record)
        name = tenant_of(submission)
        tenant = self._tenants.setdefault(name, _Tenant())
        if tenant.held >= TENANT_MAX_HELD:
            return False
        tenant.held += 1
        try:
            await self._send(result_key, result, submission, tenant)
        finally:
            tenant.held -= 1
            if not tenant.held:
                del self._tenants[name]
        return True

    async def _send(
        self, result_key: str, result: queue.Result, submission: AsyncInvocation, tenant: _Tenant
    ) -> None:
        first = len(result.callbacks) + 1
        try:
            status, headers, body = render(result, self._catalog)
        except Exception:  # nothing to send: the attempt fails, recorded
            log.exception("callback of %s: its result cannot be rendered", submission.id)
            await self._record_attempt(result_key, first, "gave_up")
            return
        headers = {
            "Content-Type": headers.get("content-type", "application/json"),
            "User-Agent": "fngate",
            "X-Fngate-Invocation": submission.id,
            "X-Fngate-State": headers["x-fngate-state"],
            "X-Fngate-Status": str(status),
        }
        for attempt in range(first, MAX_ATTEMPTS + 1):
            async with tenant.slots, self._slots:
                headers[SIGNATURE_HEADER] = signature(self._secret, int(time.time()), body)
                answered, failure = await post(
                    self._policy, submission.callback_url, body, headers, ATTEMPT_TIMEOUT_S
                )
            delivered = answered is not None and 200 <= answered < 300
            outcome = "delivered" if delivered else "retrying" if attempt < MAX_ATTEMPTS else "gave_up"
            await self._record_attempt(result_key, attempt, outcome)
            if delivered:
                return
            log.info("callback of %s: attempt %d failed (%s)", submission.id, attempt, answered or failure)
            if attempt < MAX_ATTEMPTS:
                await asyncio.sleep(retry_delay_s(attempt))

    async def _record_attempt(self, result_key: str, attempt: int, outcome: str) -> None:
        # What the caller reads of it: never the receiver's answer (its status, or why it failed).
        record = {"attempt": attempt, "at_ms": int(time.time() * 1000), "outcome": outcome}
        await self._record([result_key], [orjson.dumps(record)])
