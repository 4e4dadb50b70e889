"""The invocation routes as a plain ASGI app in front of Starlette: POST /v2/models/{name}/infer,
/v2/models/{name}/versions/{v}/infer and /v1/functions/{name}. They carry the traffic, so they
need no Request and Response objects, no router and no middleware stack: the path is split once,
the headers scanned once, the body read into one buffer, and the answer sent as two ASGI messages.
Everything else goes to the Starlette app behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from fngate.errors import ErrorCode, FunctionError, Internal
from fngate.repository import FunctionVersion
from gateway import pipelines
from gateway.auth import OPEN
from gateway.dispatch import Refused
from gateway.endpoints import Services
from gateway.guard import ADMISSION, ADMITTED, PRINCIPAL, RELEASE
from gateway.http_errors import BodyTimeout, PayloadTooLarge, error_body, status_of
from gateway.limits import refusal
from gateway.metrics import CACHE_HITS, CACHE_MISSES, REQUEST_DURATION, REQUEST_FAILURE, REQUEST_SUCCESS
from gateway.protocol import InferRequest, decode, decode_body, parse_v1, parse_v2, render_v1, render_v2
from gateway.results import accepted_response

log = logging.getLogger(__name__)

JSON = (b"content-type", b"application/json")
CACHE_HEADER = b"x-fngate-cache"


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
class Invocation:
    route: Route
    name: str
    version: str | None
    content_length: int | None = None
    header_length: bytes | None = None
    no_cache: bool = False
    encoding: str | None = None
    respond_async: bool = False
    """`Prefer: respond-async`: answer 202 at once and the result later (gateway.invocations)."""

    def read_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        """What the invoke path reads of the request's headers, in one pass."""
        for key, value in headers:
            if key == b"content-length":
                self.content_length = int(value) if value.isdigit() else None
            elif key == b"inference-header-content-length":
                self.header_length = value
            elif key == b"cache-control":
                self.no_cache = b"no-cache" in value
            elif key == b"content-encoding":
                self.encoding = value.decode("latin-1")
            elif key == b"prefer":
                self.respond_async = self.respond_async or b"respond-async" in value


def match(path: str) -> Invocation | None:
    parts = path.split("/")
    if len(parts) == 5 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "infer" and parts[3]:
        return Invocation(V2, parts[3], None)
    if len(parts) == 4 and parts[1] == "v1" and parts[2] == "functions" and parts[3]:
        return Invocation(V1, parts[3], None)
    if (
        len(parts) == 7
        and parts[1] == "v2"
        and parts[2] == "models"
        and parts[4] == "versions"
        and parts[6] == "infer"
        and parts[3]
        and parts[5]
    ):
        return Invocation(V2_PINNED, parts[3], parts[5])
    return None


class InvokeRoutes:
    def __init__(self, app: ASGIApp, retry_after_s: int, body_timeout_s: float | None = None) -> None:
        self.app = app
        self._retry_after = str(retry_after_s).encode()
        self._body_timeout_s = body_timeout_s
        self._durations: dict[str, Any] = {}
        self._successes: dict[tuple[str, str], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if call is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = call.route
        services: Services = scope["state"]["services"]
        started = time.perf_counter()
        try:
            call.read_headers(scope["headers"])
            body = await read_body(
                receive, services.max_body_bytes, call.content_length, self._body_timeout_s
            )
            body = decode_body(body, call.encoding, services.max_body_bytes)
            status, headers, content = await self._invoke(services, call, body, scope)
        except ClientDisconnected:
            return
        except Refused as exc:  # the caller's key is over one of its limits: 429
            scope[ADMITTED] = False
            self._failed(services, call.name, "rate_limited")
            limited = refusal(scope[PRINCIPAL], call.name, exc.outcome.limit, exc.outcome.retry_after_ms)
            status, content = limited.status, limited.body()
            headers = [
                JSON,
                *((name.lower().encode(), value.encode()) for name, value in limited.headers.items()),
            ]
        except FunctionError as exc:
            self._failed(services, call.name, exc.code.value)
            status = status_of(exc)
            headers = [JSON]
            if status == 503:
                headers.append((b"retry-after", self._retry_after))
            elif status == 408:  # the rest of the body may still come: the connection is done
                headers.append((b"connection", b"close"))
            content = error_body(exc)
        except Exception:
            request_id = uuid.uuid4().hex
            log.exception("invocation of %s failed unexpectedly (request %s)", call.name, request_id)
            self._failed(services, call.name, ErrorCode.INTERNAL.value)
            status, headers = 500, [JSON]
            content = error_body(Internal(f"internal error (request id {request_id})"))
        finally:
            self._duration(services, call.name).observe(time.perf_counter() - started)
        if scope.get(ADMITTED):  # out of the key's limits before the client has its answer
            scope[ADMITTED] = False
            await asyncio.shield(scope[RELEASE]())
        headers.append((b"content-length", str(len(content)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    async def _invoke(
        self, services: Services, call: Invocation, body: bytes, scope: Scope
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        function = services.catalog.get(call.name, call.version)
        manifest = function.manifest
        if call.route is V1:
            parsed = await decode(parse_v1, body, manifest)
        else:
            header_length = call.header_length.decode("latin-1") if call.header_length is not None else None
            parsed = await decode(parse_v2, body, header_length, manifest)
        admission = scope.get(ADMISSION)
        if admission is not None:
            scope[ADMITTED] = True  # from here it may hold a place in its key's limits
        if call.respond_async:  # functions and pipelines alike
            accepted = await scope["state"]["invocations"].submit(
                function,
                parsed,
                "v1" if call.route is V1 else "v2",
                scope.get(PRINCIPAL, OPEN),
                dict(scope["headers"]),
                admission,
                body,
                _use_cache(parsed, call),
            )
            return accepted_response(accepted)
        args = (
            function,
            parsed.inputs,
            parsed.outputs,
            parsed.timeout_ms,
            _use_cache(parsed, call),
            admission,
        )
        if manifest.pipeline is not None:  # steps on other functions' streams (gateway.pipelines)
            reply = await pipelines.submit(services.catalog, services.dispatcher, *args)
        else:
            reply = await services.dispatcher.submit(*args)
        labels = (call.name, reply.version)
        success = self._successes.get(labels)
        if success is None:
            success = self._successes[labels] = REQUEST_SUCCESS.labels(*labels)
        success.inc()
        cache_state = _cache_state(function, reply.cached)
        if call.route is V1:
            return 200, [JSON, (CACHE_HEADER, cache_state)], render_v1(reply)
        content, extra = render_v2(parsed, reply, manifest)
        headers = [(name.encode(), value.encode()) for name, value in extra.items()]
        headers.append((CACHE_HEADER, cache_state))
        return 200, headers, content

    def _duration(self, services: Services, name: str) -> Any:
        """The duration histogram of a function, looked up once; a name that is no function's is
        counted as "" (a client cannot add series by inventing names)."""
        child = self._durations.get(name)
        if child is None:
            if name not in services.catalog.functions:
                return REQUEST_DURATION.labels("")
            child = self._durations[name] = REQUEST_DURATION.labels(name)
        return child

    def _failed(self, services: Services, name: str, code: str) -> None:
        known = name in services.catalog.functions
        REQUEST_FAILURE.labels(name if known else "", code).inc()


def _use_cache(parsed: InferRequest, call: Invocation) -> bool:
    return parsed.use_cache and not call.no_cache


def _cache_state(function: FunctionVersion, cached: bool) -> bytes:
    if not function.manifest.cache.enabled:
        return b"off"
    (CACHE_HITS if cached else CACHE_MISSES).labels(function.name).inc()
    return b"hit" if cached else b"miss"


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
