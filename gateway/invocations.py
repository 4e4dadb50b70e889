"""Asynchronous invocations of functions and pipelines: submit (`Prefer: respond-async` on the
invocation routes), then read (GET /v1/invocations/{id}, `?wait=` long-polls) and cancel (DELETE)
it before it starts; gateway.results renders them. The result lives in Redis (fngate.queue,
asynchronous section), so any gateway answers."""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys, queue, telemetry
from fngate.errors import (
    FunctionNotFound,
    InvalidArgument,
    Overloaded,
    Unavailable,
)
from fngate.pipelined import PipelinedRedis, Script
from fngate.plan import PlanStep, StepContext, first_steps, step_entry
from fngate.repository import FunctionVersion
from fngate.wire import Invocation
from gateway import pipelines
from gateway.activation import Activator
from gateway.auth import ADMIN, INVOKE, Principal
from gateway.cache import SeparateCache, request_key
from gateway.catalog import Catalog
from gateway.dispatch import Refused
from gateway.http_errors import IdempotencyKeyReused
from gateway.metrics import CACHE_HITS, CACHE_MISSES
from gateway.protocol import InferRequest

MAX_WAIT_S = 60.0
"""The longest long-poll (`?wait=`) one request may hold."""
BLOCK_S = 5.0
"""One XREAD of a long-poll blocks at most this long (under its connection's socket timeout)."""
MAX_CALLBACK_URL = 2048
MAX_IDEMPOTENCY_KEY = 256
PENDING_MARGIN_S = 5
"""A pending invocation's result outlives its deadline by result_ttl_s and this much: a reply that
comes late (a batch that ran over the deadline) still finds it. Once done, the runner keeps it
result_ttl_s from then (fngate.queue.FINISH)."""
LONG_POLLS = 128
"""Long-polls one gateway holds at once, each on a connection of its own; more wait for one."""


@dataclasses.dataclass(frozen=True, slots=True)
class Submission:
    """An asynchronous invocation as the gateway records it: what answering it later needs."""

    id: str
    function: str
    version: str
    route: str
    """'v1' or 'v2': the shape its result is rendered in."""
    key_id: str
    """The API key that submitted it: the only one (besides admins) that may read it."""
    deadline_ms: int
    request_id: str | None = None
    binary_outputs: tuple[str, ...] = ()
    callback_url: str = ""
    outputs: tuple[str, ...] | None = None
    """The outputs asked for, when its reply holds them all (a pipeline's); None: as it comes."""

    def encode(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> Submission:
        doc = orjson.loads(raw)
        doc["binary_outputs"] = tuple(doc.get("binary_outputs", ()))
        if doc.get("outputs") is not None:
            doc["outputs"] = tuple(doc["outputs"])
        return cls(**doc)


@dataclasses.dataclass(frozen=True, slots=True)
class Entries:
    """What a submission queues: its entries (a function's own, or a pipeline's first steps), what
    each is in an error's words, and the runner pools to wake (every step's, for a pipeline)."""

    entries: list[queue.Forward]
    names: list[str]
    pools: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class Accepted:
    invocation_id: str
    again: bool = False
    """A resubmission with the same Idempotency-Key: the first invocation's id."""
    done: bool = False
    """Answered from the response cache: its result is there already."""


class AsyncInvocations:
    """Submits asynchronous invocations and reads, waits on and cancels them."""

    def __init__(
        self,
        scripts: PipelinedRedis,
        redis_url: str,
        redis_timeout_s: float,
        catalog: Catalog,
        activator: Activator | None = None,
    ) -> None:
        self.catalog = catalog
        self._activator = activator
        self._submit = Script(scripts, queue.SUBMIT_ASYNC)
        self._read = Script(scripts, queue.READ_RESULT)
        self._cancel = Script(scripts, queue.CANCEL)
        self.separate_cache: SeparateCache | None = None
        """The response cache when it is a Redis of its own (else the submit script reads it)."""
        self._tracing = telemetry.tracing_active()
        # Long-polls block their connection: a pool of their own, apart from the invocations'.
        self._polls = aioredis.Redis.from_pool(
            aioredis.BlockingConnectionPool.from_url(
                redis_url,
                max_connections=LONG_POLLS,
                timeout=BLOCK_S,  # all taken: a 503 after this long, never an unbounded wait
                socket_connect_timeout=redis_timeout_s,
                socket_timeout=BLOCK_S + redis_timeout_s,
            )
        )

    async def aclose(self) -> None:
        await self._polls.aclose()

    async def submit(
        self,
        function: FunctionVersion,
        parsed: InferRequest,
        route: str,
        principal: Principal,
        headers: dict[bytes, bytes],
        admission: queue.Admission | None = None,
        body: bytes = b"",
        use_cache: bool = True,
    ) -> Accepted:
        """Queue an asynchronous invocation at level keys.ASYNC (a pipeline's first steps, whose
        successors the runners queue at that level too); raises Refused, Overloaded or
        Unavailable as a synchronous one would, IdempotencyKeyReused for an Idempotency-Key sent
        before with another `body` or to another function. A cached answer (`use_cache`, as for a
        synchronous one) is its result at once: nothing is queued."""
        manifest = function.manifest
        batching = manifest.batching
        callback_url = _callback_url(headers.get(b"x-callback-url"))
        idempotency = _idempotency_key(headers.get(b"idempotency-key"))
        timeout_ms = batching.async_timeout_s * 1000
        if parsed.timeout_ms is not None:
            timeout_ms = min(timeout_ms, parsed.timeout_ms)
        invocation_id = uuid.uuid4().hex
        result = keys.result(invocation_id)
        deadline_ms = int(time.time() * 1000) + timeout_ms
        entry = _cache_entry(function, parsed)  # answered from it, stored for others; never waited on
        pipeline = manifest.pipeline is not None
        # A pipeline's answer is cached by its last step, in the queue's Redis (runner.pipeline).
        separate = None if pipeline else self.separate_cache
        cached = None
        if entry and use_cache and separate is not None:
            cached = await separate.get(entry)
        traceparent = telemetry.inject() if self._tracing else None
        record = Submission(
            invocation_id,
            manifest.name,
            function.version,
            route,
            principal.key_id,
            deadline_ms,
            parsed.request_id,
            tuple(sorted(parsed.binary_outputs)),
            callback_url,
            parsed.outputs if pipeline else None,
        )
        if pipeline:
            queued = self._first_steps(function, parsed, record, traceparent, entry)
        else:
            invocation = Invocation(
                id=invocation_id,
                function=manifest.name,
                version=function.version,
                reply_to=result,
                deadline_ms=deadline_ms,
                inputs=parsed.inputs,
                outputs=parsed.outputs,
                traceparent=traceparent,
                digest=function.digest,
                cache_key=entry or None,
                cache_ttl_s=manifest.cache.ttl_s,
                in_flight_key=queue.callback_marker(result) if callback_url else None,
                result_ttl_s=batching.result_ttl_s,
            )
            stream = keys.invocations(manifest.name, keys.ASYNC)
            own = queue.Forward(
                stream, invocation.encode(), b"", batching.max_async_queue_size, batching.max_queue_bytes
            )
            queued = Entries([own], [f"function '{manifest.name}'"], [manifest.scaling.pool])
        if self._activator is not None:
            for pool in queued.pools:
                self._activator.check(pool)
        first, *more = queued.entries
        call = queue.submit_async_call(
            first.stream,
            first.fields,
            result,
            record.encode(),
            timeout_ms + (batching.result_ttl_s + PENDING_MARGIN_S) * 1000,
            invocation_id,
            first.max_queue_size,
            first.max_queue_bytes,
            keys.idempotency(principal.key_id, idempotency) if idempotency else "",
            keys.callbacks() if callback_url else "",
            admission,
            request_digest(manifest.name, route, body) if idempotency else "",
            batching.result_ttl_s * 1000,
            entry if use_cache and separate is None else "",
            cached,
            first.step,
            more,
        )
        try:
            outcome = queue.parse_submit_async(await self._submit(call.keys, call.args))
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        if entry and use_cache:
            _count_lookup(manifest.name, outcome)
        return await self._accepted(outcome, invocation_id, idempotency, queued)

    def _first_steps(
        self,
        function: FunctionVersion,
        parsed: InferRequest,
        record: Submission,
        traceparent: str | None,
        cache_entry: str,
    ) -> Entries:
        """A pipeline's first steps at level keys.ASYNC, replying to its result stream (the last
        step's answer, or the first error naming its step, kept result_ttl_s; its callback told).
        Every step's version is drawn now, as for a synchronous invocation."""
        manifest = function.manifest
        resolved, plan = pipelines.resolve(self.catalog, function)
        result = keys.result(record.id)
        context = StepContext(
            record.id,
            result,
            record.deadline_ms,
            plan,
            0,
            {},
            traceparent,
            cache_entry,
            manifest.cache.ttl_s,
            keys.ASYNC,
            manifest.batching.result_ttl_s,
            queue.callback_marker(result) if record.callback_url else "",
        )
        steps = first_steps(context, parsed.inputs)
        return Entries(
            [step_entry(step_context, inputs) for step_context, inputs in steps],
            [_step_name(step_context.step) for step_context, _ in steps],
            sorted({item.manifest.scaling.pool for item in resolved.values()}),
        )

    async def _accepted(
        self, outcome: queue.SubmitOutcome, invocation_id: str, idempotency: str, queued: Entries
    ) -> Accepted:
        if isinstance(outcome, queue.Done):
            return Accepted(invocation_id, done=True)
        if isinstance(outcome, queue.Again):
            return Accepted(outcome.invocation_id, again=True)
        if isinstance(outcome, queue.Conflict):
            raise IdempotencyKeyReused(
                f"Idempotency-Key '{idempotency}' was used for another request (invocation"
                f" '{outcome.invocation_id}'): a new request needs a new key"
            )
        if isinstance(outcome, queue.Limited):
            raise Refused(outcome)
        if isinstance(outcome, queue.Full):
            limit = "max_queue_bytes" if outcome.limit == "bytes" else "max_async_queue_size"
            raise Overloaded(
                f"{queued.names[outcome.index]} has too many asynchronous invocations queued ({limit})"
            )
        if self._activator is not None:
            for pool in queued.pools:
                self._activator.wake(pool)
        return Accepted(invocation_id)

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
            outcome = queue.cancel_outcome(
                await self._cancel([keys.result(invocation_id)], [keys.RUNNER_GROUP])
            )
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        if outcome == "gone":
            raise _not_found(invocation_id)
        return outcome

    async def _read_once(self, invocation_id: str, principal: Principal) -> queue.Result:
        if not _is_id(invocation_id):
            raise _not_found(invocation_id)
        try:
            raw = await self._read([keys.result(invocation_id)], [keys.RUNNER_GROUP])
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the queue is unavailable: {exc}") from exc
        result = queue.parse_result(raw)
        if result is None or not _may_read(principal, Submission.decode(result.record)):
            raise _not_found(invocation_id)
        return result


def _step_name(step: PlanStep) -> str:
    return f"step '{step.name}' ({step.function} v{step.version}): function '{step.function}'"


def _cache_entry(function: FunctionVersion, parsed: InferRequest) -> str:
    """The response cache entry of this request ('' with the function's cache off)."""
    key_hex = request_key(function, parsed.inputs, parsed.outputs)
    return keys.cache_entry(function.manifest.name, key_hex) if key_hex else ""


def _count_lookup(function: str, outcome: queue.SubmitOutcome) -> None:
    """A cache hit or miss, as a synchronous invocation's; a submission refused before the lookup
    counts neither."""
    if isinstance(outcome, queue.Done):
        CACHE_HITS.labels(function).inc()
    elif not isinstance(outcome, queue.Again | queue.Conflict | queue.Limited):
        CACHE_MISSES.labels(function).inc()


def request_digest(function: str, route: str, body: bytes) -> str:
    """What an Idempotency-Key is bound to: the function, the route (its body's shape) and the body,
    length-prefixed so that no two requests share a preimage."""
    digest = hashlib.blake2b(digest_size=16, person=b"fngate-idem-v1")
    for part in (function.encode(), route.encode(), body):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def is_pending(result: queue.Result) -> bool:
    """Queued or running, before its deadline: a reply may still come."""
    if result.state not in ("queued", "running"):
        return False
    return Submission.decode(result.record).deadline_ms > time.time() * 1000


def _may_read(principal: Principal, submission: Submission) -> bool:
    if ADMIN in principal.scopes:
        return True
    return principal.key_id == submission.key_id and principal.allows(INVOKE, submission.function)


def _is_id(text: str) -> bool:
    return len(text) == 32 and all(char in "0123456789abcdef" for char in text)


def _not_found(invocation_id: str) -> FunctionNotFound:
    return FunctionNotFound(f"no invocation '{invocation_id[:64]}' (unknown, expired, or not this key's)")


def _callback_url(raw: bytes | None) -> str:
    if raw is None:
        return ""
    url = raw.decode("latin-1").strip()
    if len(url) > MAX_CALLBACK_URL or not url.startswith(("https://", "http://")) or " " in url:
        raise InvalidArgument("X-Callback-Url must be an http(s) URL of at most 2048 characters")
    return url


def _idempotency_key(raw: bytes | None) -> str:
    if raw is None:
        return ""
    value = raw.decode("latin-1").strip()
    if not value or len(value) > MAX_IDEMPOTENCY_KEY:
        raise InvalidArgument(f"Idempotency-Key must have 1 to {MAX_IDEMPOTENCY_KEY} characters")
    return value
