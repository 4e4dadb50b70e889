"""Call: one invocation as a front end understood it, whatever the protocol (V2 or /v1 over HTTP,
V2 over gRPC). Everything the core needs to queue it, answer it and account for it; nothing of how
it arrived."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from opentelemetry.trace import Span

from fngate import queue
from fngate.repository import FunctionVersion
from fngate.sequences import Step
from fngate.tensors import Tensors
from fngate.wire import Reply
from gateway.auth import OPEN, Principal


@dataclasses.dataclass(frozen=True, slots=True)
class Later:
    """An asynchronous call: answered at once with an id, its result read (or sent to a callback)
    later."""

    dialect: str
    """How its result is rendered when read: 'v1' or 'v2'."""
    callback_url: str = ""
    idempotency_key: str = ""
    request_digest: str = ""
    """What an idempotency key is bound to (gateway.invocations.request_digest)."""
    binary_outputs: tuple[str, ...] = ()
    """Outputs its V2 result carries in binary."""


@dataclasses.dataclass(slots=True)
class Call:
    function: FunctionVersion
    """The version that answers: pinned by the caller, or drawn by the function's traffic split."""
    inputs: Tensors
    outputs: tuple[str, ...] | None = None
    """The outputs asked for; None: all of them."""
    principal: Principal = OPEN
    timeout_ms: int | None = None
    """How long the caller waits (a request parameter, a gRPC deadline); the function's own timeout
    caps it."""
    use_cache: bool = True
    """False: neither answered from the response cache nor coalesced with identical calls (the
    answer is still stored)."""
    request_id: str | None = None
    traceparent: str | None = None
    """The W3C trace context the invocation's spans continue (the front end's server span)."""
    later: Later | None = None
    """Set for an asynchronous call."""
    started: float = 0.0
    """time.perf_counter() when the front end had the request: its duration is measured from here."""
    admission: queue.Admission | None = None
    """Set by the core while the call holds a place in its key's limits."""
    span: Span | None = None
    """A span of the core's own that ends with the call (a pipeline's)."""
    priority: int = 0
    """Triton's `priority` parameter: its function's priority level (0: the default level)."""
    queue_timeout_us: int | None = None
    """Triton's `timeout` parameter as a queue timeout, where the level's policy lets it shorten its
    own (fngate.queue.place)."""
    sequence: Step | None = None
    """Its step in a sequence (Triton's sequence_id, sequence_start and sequence_end parameters)."""
    on_part: Callable[[Reply], None] | None = None
    """A decoupled model's call (streamed): told each of its responses as it comes, before the
    call's own answer (which carries no outputs) ends them."""
