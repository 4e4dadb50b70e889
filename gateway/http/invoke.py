"""The invocation routes, POST /v2/models/{name}/infer, /v2/models/{name}/versions/{v}/infer and
/v1/functions/{name}: what an exchange (gateway.http.lean, on either server) decides with, written
once: the route matched from the path, the head read in one pass (InvokeHead), the key checked,
the body decoded, the call made and handed to the core, the answer rendered, and the refusals
counted. They carry the traffic, so they need no router, Request or Response objects."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Callable
from typing import Any

from fngate import telemetry
from fngate.errors import ErrorCode, FunctionError, Internal, InvalidArgument
from fngate.repository import FunctionVersion
from fngate.wire import Reply
from gateway import metrics
from gateway.allowance import Hold
from gateway.auth import INVOKE, Principal
from gateway.call import Call, Later
from gateway.http.bodies import STREAM_FROM_BYTES, StreamedBody, decode_streamed
from gateway.http.codec import InferRequest, parse_v1, parse_v2, render_v1, render_v2
from gateway.http.errors import error_body, headers_of, status_of
from gateway.http.results import accepted_response
from gateway.invocations import RequestDigest, check_callback_url, check_idempotency_key
from gateway.state import Services
from gateway.validation import parse_now

log = logging.getLogger(__name__)

JSON = (b"content-type", b"application/json")
CACHE_HEADER = b"x-fngate-cache"
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """What TracingMiddleware reads as `scope["route"]` to name the server span."""

    path: str
    dialect: str
    """'v1' (the serverless body) or 'v2' (the Open Inference Protocol): how bodies and results
    of the route are written."""


V2 = Route("/v2/models/{name}/infer", "v2")
V2_PINNED = Route("/v2/models/{name}/versions/{version}/infer", "v2")
V1 = Route("/v1/functions/{name}", "v1")
ROUTES = (V2, V2_PINNED, V1)
"""The invocation routes (POST): each needs the `invoke` scope of the function it names."""


@dataclasses.dataclass(slots=True)
class InvokeHead:
    """What the invoke path reads of an invocation's request line and headers, in one pass."""

    route: Route
    name: str
    version: str | None
    authorization: str | None = None
    content_length: int | None = None
    header_length: bytes | None = None
    no_cache: bool = False
    encoding: str | None = None
    respond_async: bool = False
    """`Prefer: respond-async`: answer 202 at once and the result later (gateway.invocations)."""
    callback_url: str | None = None
    idempotency_key: str | None = None

    def read_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        for key, value in headers:
            if key == b"authorization":
                self.authorization = value.decode("latin-1")
            elif key == b"content-length":
                self.content_length = int(value) if value.isdigit() else None
            elif key == b"inference-header-content-length":
                self.header_length = value
            elif key == b"cache-control":
                self.no_cache = b"no-cache" in value
            elif key == b"content-encoding":
                self.encoding = value.decode("latin-1")
            elif key == b"prefer":
                self.respond_async = self.respond_async or b"respond-async" in value
            elif key == b"x-callback-url":
                self.callback_url = value.decode("latin-1")
            elif key == b"idempotency-key":
                self.idempotency_key = value.decode("latin-1")


def match(method: str, path: str) -> InvokeHead | None:
    if method != "POST":
        return None
    parts = path.split("/")
    if len(parts) == 5 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "infer" and parts[3]:
        return InvokeHead(V2, parts[3], None)
    if len(parts) == 4 and parts[1] == "v1" and parts[2] == "functions" and parts[3]:
        return InvokeHead(V1, parts[3], None)
    if (
        len(parts) == 7
        and parts[1] == "v2"
        and parts[2] == "models"
        and parts[4] == "versions"
        and parts[6] == "infer"
        and parts[3]
        and parts[5]
    ):
        return InvokeHead(V2_PINNED, parts[3], parts[5])
    return None


def streamed_body(
    services: Services,
    request: InvokeHead,
    function: FunctionVersion,
    hold: Hold,
    digest: RequestDigest | None,
) -> StreamedBody:
    """The decoder of an uncompressed body that is large, or of unknown length."""
    settings = services.settings
    header_length = request.header_length.decode("latin-1") if request.header_length is not None else None
    most = request.content_length if request.content_length is not None else settings.max_body_bytes
    return StreamedBody(request.route.dialect, function.manifest, header_length, hold, most, digest)


async def decode_whole(
    services: Services,
    request: InvokeHead,
    function: FunctionVersion,
    raw: bytes,
    hold: Hold,
    digest: RequestDigest | None,
) -> InferRequest:
    """A body received whole: parsed on the event loop when small and uncompressed, else
    decompressed and decoded a step at a time in a worker thread."""
    if not request.encoding and len(raw) < STREAM_FROM_BYTES:
        if digest is not None:
            digest.update(raw)
        parser, args = _parser(request, function)
        return parse_now(parser, raw, *args)
    settings = services.settings
    request.content_length = None  # decompressed, it may be as large as the body limit
    body = streamed_body(services, request, function, hold, digest)
    return await asyncio.to_thread(
        parse_now, decode_streamed, body, raw, request.encoding, settings.max_body_bytes, hold
    )


def authorize(services: Services, request: InvokeHead) -> Principal:
    """The caller, if its key may invoke the function (checked before the body is read)."""
    return services.keys.authorize(request.authorization, INVOKE, request.name)


async def answer(
    services: Services, request: InvokeHead, raw: bytes, started: float, principal: Principal
) -> Answer:
    """The whole answer of one invocation request whose body came whole and needs work that awaits
    (decompression, a parse in a thread, a submission): status, headers and body. What fails before
    the core has the call is counted here; the core counts the rest."""
    hold = services.budget.hold()
    try:
        digest = idempotency_digest(request)
        function = services.catalog.get(request.name, request.version)
        parsed = await decode_whole(services, request, function, raw, hold, digest)
    except FunctionError as exc:
        count_refusal(services, request, exc, started)
        # The server reads and drops what is left of the body, then takes the next request.
        return error_answer(services, exc)
    except Exception:
        return internal_answer(request)
    finally:
        hold.release()
    return await submit(services, request, function, parsed, principal, digest, started)


async def submit(
    services: Services,
    request: InvokeHead,
    function: FunctionVersion,
    parsed: InferRequest,
    principal: Principal,
    digest: RequestDigest | None,
    started: float,
) -> Answer:
    """The answer of a parsed invocation: the core's reply, rendered, or the 202 of an
    asynchronous one."""
    try:
        if request.respond_async:
            await check_callback(services, request)
        if parsed.shares_memory:
            parsed = await placed(services, request, function, parsed, principal)
        call = call_of(request, function, parsed, principal, digest, started)
    except FunctionError as exc:
        count_refusal(services, request, exc, started)
        return error_answer(services, exc)
    try:
        if call.later is not None:
            return accepted_response(await services.dispatcher.submit(call))
        reply = await services.dispatcher.invoke(call)
        return rendered(request, call, parsed, reply)
    except FunctionError as exc:
        return error_answer(services, exc)
    except Exception:
        return internal_answer(request)


async def placed(
    services: Services,
    request: InvokeHead,
    function: FunctionVersion,
    parsed: InferRequest,
    principal: Principal,
) -> InferRequest:
    """A request that names shared memory regions, with its inputs read from them and its outputs'
    places found."""
    if parsed.shared_outputs and request.respond_async:
        raise InvalidArgument(
            "an asynchronous invocation's outputs cannot go to shared memory: its result is read later"
        )
    assert services.shared_memory is not None
    inputs, where = await services.shared_memory.place(
        principal.key_id, function.manifest, parsed.inputs, parsed.shared_inputs, parsed.shared_outputs
    )
    return dataclasses.replace(parsed, inputs=inputs, placed=where)


async def check_callback(services: Services, request: InvokeHead) -> None:
    """An X-Callback-Url the gateway may call (its host resolved and checked now, as it is again
    for each attempt), and a secret to sign with."""
    url = check_callback_url(request.callback_url)
    if not url:
        return
    if not services.settings.callback_secret.get_secret_value():
        raise InvalidArgument("this gateway has no callback_secret to sign callbacks with: they are off")
    await services.destinations.resolve_async(url)


def idempotency_digest(request: InvokeHead) -> RequestDigest | None:
    """What the body of an asynchronous call with an Idempotency-Key is bound to, fed as it is read."""
    if not request.respond_async or not request.idempotency_key:
        return None
    return RequestDigest(request.name, request.route.dialect)


def call_now(
    services: Services,
    request: InvokeHead,
    function: FunctionVersion,
    principal: Principal,
    raw: bytes,
    started: float,
) -> tuple[Call | None, InferRequest]:
    """`answer`'s call of a small, uncompressed, synchronous request, parsed on the event loop; None
    for one that names shared memory regions (`submit` reads them first)."""
    parser, args = _parser(request, function)
    parsed = parse_now(parser, raw, *args)
    if parsed.shares_memory:
        return None, parsed
    return call_of(request, function, parsed, principal, None, started), parsed


def _parser(
    request: InvokeHead, function: FunctionVersion
) -> tuple[Callable[..., InferRequest], tuple[Any, ...]]:
    manifest = function.manifest
    if request.route is V1:
        return parse_v1, (manifest,)
    header_length = request.header_length.decode("latin-1") if request.header_length is not None else None
    return parse_v2, (header_length, manifest)


def call_of(
    request: InvokeHead,
    function: FunctionVersion,
    parsed: InferRequest,
    principal: Principal,
    digest: RequestDigest | None,
    started: float,
) -> Call:
    return Call(
        function,
        parsed.inputs,
        parsed.outputs,
        principal,
        parsed.timeout_ms,
        parsed.use_cache and not request.no_cache,
        parsed.request_id,
        telemetry.inject() if telemetry.tracing_active() else None,
        _later(request, parsed, digest) if request.respond_async else None,
        started,
        priority=parsed.priority,
        queue_timeout_us=parsed.queue_timeout_us,
        sequence=parsed.sequence,
    )


def _later(request: InvokeHead, parsed: InferRequest, digest: RequestDigest | None) -> Later:
    idempotency = check_idempotency_key(request.idempotency_key)
    return Later(
        request.route.dialect,
        check_callback_url(request.callback_url),
        idempotency,
        digest.hexdigest() if digest is not None and idempotency else "",
        tuple(sorted(parsed.binary_outputs)),
    )


def rendered(request: InvokeHead, call: Call, parsed: InferRequest, reply: Reply) -> Answer:
    function = call.function
    cache_state = _cache_state(function, reply.cached)
    timing = [(b"server-timing", metrics.server_timing(function.name, reply.timing))] if reply.timing else []
    if request.route is V1:
        return 200, [JSON, (CACHE_HEADER, cache_state), *timing], render_v1(reply)
    content, extra = render_v2(parsed, reply, function.manifest)
    headers = [(name.encode(), value.encode()) for name, value in extra.items()]
    headers.append((CACHE_HEADER, cache_state))
    return 200, [*headers, *timing], content


def _cache_state(function: FunctionVersion, cached: bool) -> bytes:
    if not function.manifest.cache.enabled:
        return b"off"
    return b"hit" if cached else b"miss"


def count_refusal(services: Services, request: InvokeHead, exc: FunctionError, started: float) -> None:
    """A failure before the core had the call (the core counts the rest); a name that is no
    function's is counted as ''."""
    label = request.name if request.name in services.catalog.functions else ""
    metrics.failed(label, exc.code.value)
    metrics.took(label, started)


def error_answer(services: Services, exc: FunctionError) -> Answer:
    headers = [JSON]
    for name, value in headers_of(exc, services.settings.retry_after_s).items():
        headers.append((name.lower().encode(), value.encode()))
    return status_of(exc), headers, error_body(exc)


def internal_answer(request: InvokeHead, logged: bool = False) -> Answer:
    """A 500 with a request id, for a bug; logged with its traceback (from an except block) unless
    `logged`."""
    request_id = uuid.uuid4().hex
    if not logged:
        log.exception("invocation of %s failed unexpectedly (request %s)", request.name[:128], request_id)
    metrics.failed("", ErrorCode.INTERNAL.value)
    return 500, [JSON], error_body(Internal(f"internal error (request id {request_id})"))
