"""ErrorCode -> HTTP status and JSON body: one table, one handler."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from fngate.errors import ErrorCode, FunctionError
from gateway.rendering import dumps

STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.MODEL_FAILED: 500,
    ErrorCode.MODEL_TIMEOUT: 504,
    ErrorCode.INTERNAL: 500,
}
RETRY = {ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE}


class PayloadTooLarge(FunctionError):
    """The body is over max_body_bytes; answered 413 rather than 400."""

    code = ErrorCode.INVALID_ARGUMENT


class IdempotencyKeyReused(FunctionError):
    """An Idempotency-Key sent again with another request; answered 422 rather than 400."""

    code = ErrorCode.INVALID_ARGUMENT


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


def error_body(exc: FunctionError) -> bytes:
    return dumps({"error": exc.message, "code": exc.code.value})


def error_response(exc: FunctionError, retry_after_s: int = 1) -> Response:
    status = status_of(exc)
    headers = {"Retry-After": str(retry_after_s)} if exc.code in RETRY else None
    return Response(error_body(exc), status, headers, media_type="application/json")


async def handle_function_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, FunctionError)
    return error_response(exc, request.app.state.retry_after_s)


async def handle_unknown_route(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no such route) and 405 (no such method), in the same JSON body."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
        code = ErrorCode.INVALID_ARGUMENT
    else:
        message = f"no route {request.method} {request.url.path}"
        code = ErrorCode.NOT_FOUND
    body = dumps({"error": message, "code": code.value})
    return Response(body, exc.status_code, exc.headers, media_type="application/json")
