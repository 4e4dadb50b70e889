"""gRPC's status codes, and ErrorCode -> status: one table, as gateway.http.errors is for HTTP
statuses. The messages are the same as over HTTP."""

from __future__ import annotations

import enum

from fngate.errors import ErrorCode


class Status(enum.IntEnum):
    """The protocol's status codes, by their values on the wire."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


CODES: dict[ErrorCode, Status] = {
    ErrorCode.INVALID_ARGUMENT: Status.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: Status.NOT_FOUND,
    # A full queue, as Triton answers it: retry later.
    ErrorCode.OVERLOADED: Status.UNAVAILABLE,
    ErrorCode.UNAVAILABLE: Status.UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: Status.DEADLINE_EXCEEDED,
    ErrorCode.MODEL_FAILED: Status.INTERNAL,
    ErrorCode.MODEL_TIMEOUT: Status.DEADLINE_EXCEEDED,
    ErrorCode.INTERNAL: Status.INTERNAL,
    ErrorCode.UNAUTHENTICATED: Status.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: Status.PERMISSION_DENIED,
    ErrorCode.RATE_LIMITED: Status.RESOURCE_EXHAUSTED,
}
