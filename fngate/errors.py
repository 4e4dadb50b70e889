"""The one error vocabulary shared by gateway, runner and CLI.

FunctionError (base; carries an ErrorCode)
├── InvalidArgument    invalid_argument   the request or manifest is wrong
├── FunctionNotFound   not_found          no such function, version or output
├── Overloaded         overloaded         the queue is full; retry later
├── Unavailable        unavailable        a dependency (Redis, repository, runner) is not there
├── DeadlineExceeded   deadline_exceeded  the invocation's deadline passed
├── ModelFailed        model_failed       the backend raised, its process died, or its outputs are wrong
├── ModelTimeout       model_timeout      a batch ran past the function's execution timeout
├── Internal           internal           a bug
├── Unauthenticated    unauthenticated    no API key, or one that is unknown or revoked
├── PermissionDenied   permission_denied  the key lacks the scope the call needs
└── RateLimited        rate_limited       the key is over one of its limits (retry_after_s)

Front ends map codes to their own statuses, each in one table: gateway.http.errors (HTTP),
gateway.grpc.status (gRPC).
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    MODEL_FAILED = "model_failed"
    MODEL_TIMEOUT = "model_timeout"
    INTERNAL = "internal"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    RATE_LIMITED = "rate_limited"


class FunctionError(Exception):
    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @staticmethod
    def from_code(code: str, message: str) -> FunctionError:
        """Rebuild the error named by a wire `{code, message}` pair."""
        cls = _BY_CODE.get(code, Internal)
        return cls(message)


class InvalidArgument(FunctionError):
    code = ErrorCode.INVALID_ARGUMENT


class PayloadTooLarge(FunctionError):
    """A body or message over its size limit, declared or once decompressed, or a deploy past the
    repository's storage limit: HTTP answers it 413, gRPC RESOURCE_EXHAUSTED (both front ends'
    tables otherwise read the code)."""

    code = ErrorCode.INVALID_ARGUMENT


class FunctionNotFound(FunctionError):
    code = ErrorCode.NOT_FOUND


class Overloaded(FunctionError):
    code = ErrorCode.OVERLOADED


class Unavailable(FunctionError):
    code = ErrorCode.UNAVAILABLE


class DeadlineExceeded(FunctionError):
    code = ErrorCode.DEADLINE_EXCEEDED


class ModelFailed(FunctionError):
    code = ErrorCode.MODEL_FAILED


class ModelTimeout(FunctionError):
    code = ErrorCode.MODEL_TIMEOUT


class Internal(FunctionError):
    code = ErrorCode.INTERNAL


class Unauthenticated(FunctionError):
    code = ErrorCode.UNAUTHENTICATED


class PermissionDenied(FunctionError):
    code = ErrorCode.PERMISSION_DENIED


class RateLimited(FunctionError):
    """Refused by the caller's limits; `retry_after_s`: when a retry may succeed."""

    code = ErrorCode.RATE_LIMITED

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


_BY_CODE: dict[str, type[FunctionError]] = {
    cls.code.value: cls
    for cls in (
        InvalidArgument,
        FunctionNotFound,
        Overloaded,
        Unavailable,
        DeadlineExceeded,
        ModelFailed,
        ModelTimeout,
        Internal,
        Unauthenticated,
        PermissionDenied,
        RateLimited,
    )
}
