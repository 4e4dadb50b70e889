"""ErrorCode -> HTTP status, headers and JSON body: one table, one handler."""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from fngate.errors import ErrorCode, FunctionError, PayloadTooLarge, RateLimited
from gateway.auth import ANY
from gateway.http.rendering import dumps
from gateway.invocations import IdempotencyKeyReused

STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.MODEL_FAILED: 500,
    ErrorCode.MODEL_TIMEOUT: 504,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.RATE_LIMITED: 429,
}
RETRY = {ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE}
"""Answered with the gateway's Retry-After (a rate limit's own comes with it)."""
CHALLENGE = ("WWW-Authenticate", 'Bearer realm="fngate"')


class BodyTimeout(FunctionError):
    """The body did not arrive within body_timeout_s; answered 408 rather than 400."""

    code = ErrorCode.INVALID_ARGUMENT


def status_of(exc: FunctionError) -> int:
    if isinstance(exc, PayloadTooLarge):
        return 413
    if isinstance(exc, IdempotencyKeyReused):
        return 422
    if isinstance(exc, BodyTimeout):
        return 408
    return STATUS[exc.code]


def headers_of(exc: FunctionError, retry_after_s: int) -> dict[str, str]:
    """The headers that go with an error's status: when to retry, how to authenticate, and that a
    body which may still be arriving ends the connection."""
    if isinstance(exc, RateLimited):
        return {"Retry-After": str(exc.retry_after_s)}
    if exc.code in RETRY:
        return {"Retry-After": str(retry_after_s)}
    if exc.code == ErrorCode.UNAUTHENTICATED:
        return dict([CHALLENGE])
    if isinstance(exc, BodyTimeout):
        return {"Connection": "close"}
    return {}


def error_body(exc: FunctionError) -> bytes:
    return dumps({"error": exc.message, "code": exc.code.value})


def error_response(
    exc: FunctionError, retry_after_s: int = 1, render: Callable[[FunctionError], bytes] = error_body
) -> Response:
    """The error's status, headers and body (fngate's, or another API's shape: `render`)."""
    headers = headers_of(exc, retry_after_s)
    return Response(render(exc), status_of(exc), headers or None, media_type="application/json")


async def handle_function_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, FunctionError)
    return error_response(exc, request.state.services.settings.retry_after_s)


async def handle_unknown_route(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no such route) and 405 (no such method), in the same JSON body, to a
    caller with a valid key (any scope); 401 to the others."""
    assert isinstance(exc, HTTPException)
    found = request.scope.get("state", {}).get("services")
    if found is not None:
        try:
            await found.keys.authorize_async(request.headers.get("authorization"), ANY)
        except FunctionError as refused:
            return error_response(refused, found.settings.retry_after_s)
    if exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path[:128]}"
        code = ErrorCode.INVALID_ARGUMENT
    else:
        message = f"no route {request.method} {request.url.path[:128]}"
        code = ErrorCode.NOT_FOUND
    body = dumps({"error": message, "code": code.value})
    return Response(body, exc.status_code, exc.headers, media_type="application/json")
