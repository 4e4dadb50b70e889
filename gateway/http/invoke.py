"""The invocation routes as a plain ASGI app in front of Starlette: POST /v2/models/{name}/infer,
/v2/models/{name}/versions/{v}/infer and /v1/functions/{name}. They carry the traffic, so they
need no Request and Response objects, no router and no middleware stack: the path is split once,
the headers scanned once (the key checked from here), the body read into one buffer, the call
handed to the core, and the answer sent as two ASGI messages. Everything else goes to the
Starlette app behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from fngate import telemetry
from fngate.errors import ErrorCode, FunctionError, Internal
from fngate.repository import FunctionVersion
from fngate.wire import Reply
from gateway import metrics
from gateway.auth import INVOKE, Principal
from gateway.call import Call, Later
from gateway.http.errors import BodyTimeout, PayloadTooLarge, error_body, headers_of, status_of
from gateway.http.protocol import InferRequest, decode_body, parse_v1, parse_v2, render_v1, render_v2
from gateway.http.results import accepted_response
from gateway.invocations import check_callback_url, check_idempotency_key, request_digest
from gateway.state import Services
from gateway.validation import parse, parse_now

log = logging.getLogger(__name__)

JSON = (b"content-type", b"application/json")
CACHE_HEADER = b"x-fngate-cache"
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """What TracingMiddleware reads as `scope["route"]` to name the server span."""

    path: str


V2 = Route("/v2/models/{name}/infer")
V2_PINNED = Route("/v2/models/{name}/versions/{version}/infer")
V1 = Route("/v1/functions/{name}")


class ClientDisconnected(Exception):
    """The client went away before its body arrived: nothing to answer."""


@dataclasses.dataclass(slots=True)
class Request:
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


def match(method: str, path: str) -> Request | None:
    if method != "POST":
        return None
    parts = path.split("/")
    if len(parts) == 5 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "infer" and parts[3]:
        return Request(V2, parts[3], None)
    if len(parts) == 4 and parts[1] == "v1" and parts[2] == "functions" and parts[3]:
        return Request(V1, parts[3], None)
    if (
        len(parts) == 7
        and parts[1] == "v2"
        and parts[2] == "models"
        and parts[4] == "versions"
        and parts[6] == "infer"
        and parts[3]
        and parts[5]
    ):
        return Request(V2_PINNED, parts[3], parts[5])
    return None


class InvokeRoutes:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = match(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if request is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = request.route
        services: Services = scope["state"]["services"]
        request.read_headers(scope["headers"])
        try:
            status, headers, content = await answer(services, request, _Body(receive, services, request))
        except ClientDisconnected:
            return
        headers.append((b"content-length", str(len(content)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})


class _Body:
    """The request body, read once it is asked for (after the key was checked)."""

    __slots__ = ("_receive", "_request", "_services")

    def __init__(self, receive: Receive, services: Services, request: Request) -> None:
        self._receive, self._services, self._request = receive, services, request

    async def read(self) -> bytes:
        settings = self._services.settings
        return await read_body(
            self._receive, settings.max_body_bytes, self._request.content_length, settings.body_timeout_s
        )


def authorize(services: Services, request: Request) -> Principal:
    """The caller, if its key may invoke the function (checked before the body is read)."""
    return services.keys.authorize(request.authorization, INVOKE, request.name)


async def answer(
    services: Services,
    request: Request,
    body: _Body | bytes,
    started: float | None = None,
    principal: Principal | None = None,
) -> Answer:
    """The whole answer of one invocation request: status, headers and body. What fails before the
    core has the call is counted here; the core counts the rest."""
    started = time.perf_counter() if started is None else started
    try:
        principal = principal or authorize(services, request)
        raw = body if isinstance(body, bytes) else await body.read()
        raw = decode_body(raw, request.encoding, services.settings.max_body_bytes)
        function = services.catalog.get(request.name, request.version)
        parser, args = _parser(request, function)
        parsed = await parse(parser, raw, len(raw), *args)
        call = _call(request, function, parsed, principal, raw, started)
    except ClientDisconnected:
        raise
    except FunctionError as exc:
        count_refusal(services, request, exc, started)
        return error_answer(services, exc)
    except Exception:
        return internal_answer(request)
    try:
        if call.later is not None:
            return accepted_response(await services.dispatcher.submit(call))
        reply = await services.dispatcher.invoke(call)
        return rendered(request, call, parsed, reply)
    except FunctionError as exc:
        return error_answer(services, exc)
    except Exception:
        return internal_answer(request)


def call_now(
    services: Services, request: Request, principal: Principal, raw: bytes, started: float
) -> tuple[Call, InferRequest]:
    """`answer`'s call of a small, uncompressed, synchronous request, parsed on the event loop."""
    function = services.catalog.get(request.name, request.version)
    parser, args = _parser(request, function)
    parsed = parse_now(parser, raw, *args)
    return _call(request, function, parsed, principal, raw, started), parsed


def _parser(
    request: Request, function: FunctionVersion
) -> tuple[Callable[..., InferRequest], tuple[Any, ...]]:
    manifest = function.manifest
    if request.route is V1:
        return parse_v1, (manifest,)
    header_length = request.header_length.decode("latin-1") if request.header_length is not None else None
    return parse_v2, (header_length, manifest)


def _call(
    request: Request,
    function: FunctionVersion,
    parsed: InferRequest,
    principal: Principal,
    raw: bytes,
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
        _later(request, function, parsed, raw) if request.respond_async else None,
        started,
        priority=parsed.priority,
        queue_timeout_us=parsed.queue_timeout_us,
    )


def _later(request: Request, function: FunctionVersion, parsed: InferRequest, raw: bytes) -> Later:
    shape = "v1" if request.route is V1 else "v2"
    idempotency = check_idempotency_key(request.idempotency_key)
    return Later(
        shape,
        check_callback_url(request.callback_url),
        idempotency,
        request_digest(function.manifest.name, shape, raw) if idempotency else "",
        tuple(sorted(parsed.binary_outputs)),
    )


def rendered(request: Request, call: Call, parsed: InferRequest, reply: Reply) -> Answer:
    function = call.function
    cache_state = _cache_state(function, reply.cached)
    if request.route is V1:
        return 200, [JSON, (CACHE_HEADER, cache_state)], render_v1(reply)
    content, extra = render_v2(parsed, reply, function.manifest)
    headers = [(name.encode(), value.encode()) for name, value in extra.items()]
    headers.append((CACHE_HEADER, cache_state))
    return 200, headers, content


def _cache_state(function: FunctionVersion, cached: bool) -> bytes:
    if not function.manifest.cache.enabled:
        return b"off"
    return b"hit" if cached else b"miss"


def count_refusal(services: Services, request: Request, exc: FunctionError, started: float) -> None:
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


def internal_answer(request: Request, logged: bool = False) -> Answer:
    """A 500 with a request id, for a bug; logged with its traceback (from an except block) unless
    `logged`."""
    request_id = uuid.uuid4().hex
    if not logged:
        log.exception("invocation of %s failed unexpectedly (request %s)", request.name[:128], request_id)
    metrics.failed("", ErrorCode.INTERNAL.value)
    return 500, [JSON], error_body(Internal(f"internal error (request id {request_id})"))


async def read_body(
    receive: Receive, limit: int, declared: int | None, timeout_s: float | None = None
) -> bytes:
    """The whole body, refused past `limit` bytes before it is read (when declared) or as soon as
    it is (when streamed), and cut (408) when it has not all arrived within `timeout_s`."""
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"the body of {declared} bytes is over the limit of {limit} bytes")
    try:
        async with asyncio.timeout(timeout_s):
            return await _receive_body(receive, limit)
    except TimeoutError:
        raise BodyTimeout(f"the body did not arrive within {timeout_s:g} s") from None


async def _receive_body(receive: Receive, limit: int) -> bytes:
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientDisconnected
    first: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return first
    chunks = bytearray(first)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunks += message.get("body", b"")
        if len(chunks) > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes")
        if not message.get("more_body", False):
            return bytes(chunks)
