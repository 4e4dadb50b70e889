"""One RPC as gateway.grpc.transport serves it and the servicer sees it: its method, its
metadata and deadline, its status when it fails, and the limits its connection holds it to. The
gRPC-specific encodings of its headers (`grpc-timeout`, `grpc-message`) are here."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from gateway.allowance import DecodeAllowance, Hold
from gateway.grpc.status import Status

if TYPE_CHECKING:
    from gateway.grpc.transport import GrpcConnection


class RpcError(Exception):
    """Ends an RPC with this status (raised by a handler, or here for what the transport refuses)."""

    def __init__(self, status: Status, message: str, trailers: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.trailers = tuple(trailers)


Buffer = bytes | bytearray | memoryview
Unary = Callable[[Any, "Rpc"], Awaitable[Any]]
"""(request message, rpc) -> its answer: a future (answered from its callback) or a coroutine (run
as a task)."""
Streaming = Callable[[AsyncIterator[Any], "Rpc"], AsyncIterator[Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class Method:
    parse: Callable[[Buffer], Any]
    """The request message from its bytes (protobuf's FromString)."""
    unary: Unary | None = None
    streaming: Streaming | None = None
    open: bool = False
    """Served without a key (health); its request message may be at most OPEN_MESSAGE_BYTES."""
    nested: dict[int, Any] | None = None
    """The request message's field numbers that hold messages, each with its own such table
    (gateway.grpc.messages.count_fields walks a large message with it before protobuf builds it)."""


OPEN_MESSAGE_BYTES = 4096
Authenticate = Callable[[str | None], "asyncio.Future[Any] | None"]
"""The `authorization` metadata -> None for a key the table holds, a future for one to look up
(its exception the refusal); raises the refusal itself for no key or a wrong one."""


@dataclasses.dataclass(frozen=True, slots=True)
class RpcLimits:
    max_message_bytes: int
    max_headers: int
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    """Open connections of the process, and RPCs in flight over all of them (as HTTP's requests in
    flight)."""
    budget: DecodeAllowance
    failure: Callable[[BaseException, Rpc], RpcError]
    """A handler's exception as the status it ends its RPC with (logged there when unexpected)."""
    authenticate: Authenticate | None = None
    """The key check made on an RPC's headers, before any of its messages is read (None: auth off)."""
    idle_timeout_s: float = 120.0
    """A connection with no RPC for this long is sent away (GOAWAY); clients reconnect."""
    drain_timeout_s: float = 30.0
    """An answer the client takes none of for this long is cancelled (RST_STREAM) and let go."""
    max_parked_bytes: int = 128 << 20
    """Answer bytes waiting for clients' flow-control windows, on one connection; four times it over
    the process's. An answer past either fails its RPC (RESOURCE_EXHAUSTED)."""


class Rpc:
    """One stream: its call's metadata and deadline for the handler, and what it has received."""

    __slots__ = (
        "answering",
        "buffer",
        "compressed",
        "connection",
        "counted",
        "deadline",
        "drain_timer",
        "early",
        "encoding",
        "ended",
        "gate",
        "hold",
        "messages",
        "metadata",
        "method",
        "name",
        "progress_at",
        "refusal",
        "responded",
        "size",
        "stream_id",
        "timer",
        "timing",
        "trailers",
    )

    def __init__(self, connection: GrpcConnection, stream_id: int, name: str, method: Method) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.name = name
        self.method = method
        self.metadata: dict[str, str] = {}
        self.deadline: float | None = None
        """time.monotonic() by which the client stops waiting (its `grpc-timeout`)."""
        self.encoding = b"identity"
        self.buffer = bytearray()
        """The message being received (or its 5-byte prefix, while `size` is None)."""
        self.size: int | None = None
        """The size its prefix declared."""
        self.compressed = False
        self.hold: Hold = connection.limits.budget.hold()
        self.messages: asyncio.Queue[Any] | None = None
        """A streaming RPC's requests, parsed, for its handler (None at their end)."""
        self.answering: asyncio.Future[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.responded = False
        """Response headers sent."""
        self.ended = False
        self.trailers: list[tuple[bytes, bytes]] | None = None
        """Trailers that wait for the answer's bytes to leave (the client's window)."""
        self.timing: bytes = b""
        """The answer's Server-Timing (a cold start's phases), sent as trailing metadata."""
        self.counted = True
        """It holds one of the process's RPC places (given back once it is answered)."""
        self.gate: asyncio.Future[Any] | None = None
        """The key's look-up, while it lasts: nothing received is read before it ends."""
        self.early: list[bytes | None] | None = None
        """What arrived during the look-up, as it came (None: the end of the stream)."""
        self.refusal: RpcError | None = None
        """The key was refused: the RPC ends with this once the client's request is in."""
        self.drain_timer: asyncio.TimerHandle | None = None
        self.progress_at = 0.0
        """time.monotonic() when the client last took bytes of a parked answer."""

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def send(self, message: Any) -> None:
        """One answer of a streaming RPC."""
        self.connection.send_message(self, message.SerializeToString())


_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def timeout_s(value: bytes) -> float:
    """`grpc-timeout`: up to 8 digits and a unit."""
    unit = _UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        raise RpcError(Status.INTERNAL, f"malformed grpc-timeout {value.decode('latin-1')[:20]!r}")
    return int(digits) * unit


def percent_encoded(message: str) -> bytes:
    """grpc-message: UTF-8, percent-encoded outside printable ASCII (and '%' itself)."""
    return quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode("ascii")


class Open:
    """What one server's connections have open together."""

    def __init__(self) -> None:
        self.connections: set[GrpcConnection] = set()
        self.rpcs = 0
        self.parked_bytes = 0
        """Answer bytes of every connection waiting for their clients' windows."""
