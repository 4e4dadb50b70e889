"""ErrorCode -> gRPC status code: one table, as gateway.http.errors is for HTTP statuses. The
messages are the same as over HTTP."""

from __future__ import annotations

import grpc

from fngate.errors import ErrorCode

CODES: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    # A full queue, as Triton answers it: retry later.
    ErrorCode.OVERLOADED: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.MODEL_FAILED: grpc.StatusCode.INTERNAL,
    ErrorCode.MODEL_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
