"""Invocation and Reply records and their Redis stream-entry encoding.

An entry has two fields: `h`, a JSON header, and `b`, the tensors' raw bytes back to back in the
V2 binary layout. The header lists each tensor as [name, datatype, shape, byte length].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from fngate.errors import FunctionError, InvalidArgument
from fngate.queue import AS, BODIES, BODY, BY, HEADER, HEADERS, SEQUENCE_STATE, TO, entry_bytes
from fngate.sequences import Step
from fngate.tensors import Tensors, datatype_of, from_bytes, to_bytes

WIRE_VERSION = 1
Fields = dict[Any, Any]
"""Stream-entry fields: bytes keys on the way in, and what redis-py's xadd accepts on the way out."""


@dataclasses.dataclass(frozen=True, slots=True)
class Invocation:
    id: str
    function: str
    version: str
    reply_to: str
    deadline_ms: int
    inputs: Tensors
    outputs: tuple[str, ...] | None = None
    traceparent: str | None = None
    digest: str = ""
    """The digest of the version the gateway resolved; answers from other files are not cached."""
    cache_key: str | None = None
    """The cache entry the runner stores the answer under (None: not cached), for cache_ttl_s."""
    cache_ttl_s: int = 0
    in_flight_key: str | None = None
    """Set when identical invocations may be waiting on this one (see fngate.keys.waiters)."""
    result_ttl_s: int = 0
    """An asynchronous invocation's: its result stream is kept this long after the reply (0: a
    synchronous one, whose reply stream is the gateway's)."""
    queue_deadline_ms: int = 0
    """Its priority level's queue timeout, as a time (0: none): past it, it is answered
    deadline_exceeded, or with `delay` served after the level's others (fngate.queue.place)."""
    delay: bool = False
    key_id: str = ""
    """The API key it was made with ('' without auth): its batch's time is charged to it."""
    sequence: Step | None = None
    """Its step in its sequence, for a function that takes sequences (fngate.sequences)."""
    state: bytes = b""
    """Its sequence's implicit state as the last step left it (fngate.sequences); b"" at its start."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise InvalidArgument("an invocation needs at least one input")

    @property
    def rows(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])

    def encode(self) -> Fields:
        header = {
            "v": WIRE_VERSION,
            "id": self.id,
            "fn": self.function,
            "ver": self.version,
            "reply": self.reply_to,
            "deadline_ms": self.deadline_ms,
            "out": self.outputs,
            "tp": self.traceparent,
            "dg": self.digest,
            "ck": self.cache_key,
            "cttl": self.cache_ttl_s,
            "fk": self.in_flight_key,
        }
        if self.result_ttl_s:  # asynchronous only: a synchronous header stays as it was
            header["rttl"] = self.result_ttl_s
        if self.queue_deadline_ms:  # a queue policy's timeout only
            header["qd"] = self.queue_deadline_ms
            header["qdelay"] = self.delay
        if self.key_id:
            header["kid"] = self.key_id
        if self.sequence is not None:
            header["sq"] = self.sequence.encode()
        return _encode(header, self.inputs)

    @classmethod
    def decode(cls, fields: Mapping[Any, bytes]) -> Invocation:
        header, tensors = _decode(fields)
        return cls.from_header(header, tensors, fields)

    @classmethod
    def from_header(cls, header: dict[str, Any], tensors: Tensors, fields: Mapping[Any, bytes]) -> Invocation:
        outputs = header.get("out")
        promoted = fields.get(AS)  # a waiter running in place of an identical invocation (fngate.queue)
        return cls(
            id=promoted.decode() if promoted else header["id"],
            function=header["fn"],
            version=header["ver"],
            reply_to=fields[TO].decode() if promoted else header["reply"],
            deadline_ms=int(fields[BY]) if promoted else header["deadline_ms"],
            inputs=tensors,
            outputs=tuple(outputs) if outputs is not None else None,
            traceparent=header.get("tp"),
            digest=header.get("dg", ""),
            cache_key=header.get("ck"),
            cache_ttl_s=header.get("cttl", 0),
            in_flight_key=header.get("fk"),
            result_ttl_s=header.get("rttl", 0),
            queue_deadline_ms=header.get("qd", 0),
            delay=header.get("qdelay", False),
            key_id=str(header.get("kid", "")),
            sequence=Step.decode(header["sq"]) if "sq" in header else None,
            state=fields.get(SEQUENCE_STATE, b""),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    id: str
    version: str
    outputs: Tensors = dataclasses.field(default_factory=dict)
    error: FunctionError | None = None
    batch_id: str = ""
    batch_size: int = 0
    cached: bool = False
    """Answered from the response cache (set by the gateway; not part of the encoding)."""
    timing: Mapping[str, float] | None = None
    """For an invocation that paid a cold start: what it waited for, phase -> milliseconds, in
    order (COLD_PHASES); None for the others."""
    part: bool = False
    """One of a decoupled model's responses, sent as it was made; the invocation's own reply (not
    a part) ends them."""
    state: bytes = b""
    """A step of a stateful model's sequence: the implicit state it leaves for the next step
    (fngate.sequences), which its gateway keeps in Redis."""

    def encode(self) -> Fields:
        header: dict[str, Any] = {
            "v": WIRE_VERSION,
            "id": self.id,
            "ver": self.version,
            "batch": self.batch_id,
            "bsize": self.batch_size,
        }
        if self.timing:
            header["tm"] = dict(self.timing)
        if self.part:
            header["p"] = 1
        if self.error is not None:
            header["code"] = self.error.code.value
            header["msg"] = self.error.message
        if self.state:
            return _encode(header, {**self.outputs, STATE_TENSOR: np.frombuffer(self.state, np.uint8)})
        return _encode(header, self.outputs)

    @classmethod
    def decode(cls, fields: Mapping[Any, bytes]) -> Reply:
        header, tensors = _decode(fields)
        return cls.from_header(header, tensors)

    @classmethod
    def from_header(cls, header: dict[str, Any], tensors: Tensors) -> Reply:
        code = header.get("code")
        state = tensors.pop(STATE_TENSOR, None)
        return cls(
            id=header["id"],
            version=header["ver"],
            outputs=tensors,
            error=FunctionError.from_code(code, header.get("msg", "")) if code else None,
            batch_id=header.get("batch", ""),
            batch_size=header.get("bsize", 0),
            timing=_timing(header.get("tm")),
            part=bool(header.get("p")),
            state=state.tobytes() if state is not None else b"",
        )


STATE_TENSOR = "$state"
"""A reply's implicit state travels as this tensor (UINT8), a name no model's tensor can have."""

COLD_PHASES = ("start", "queue", "fetch", "load", "exec")
"""What an invocation that paid a cold start waited for, in order: a runner to start (from its
enqueue until a runner of its function read its stream), the queue (then until its batch began),
the model's files (download and digest check), their load (its warm-up included) and the batch."""


def _timing(raw: Any) -> dict[str, float] | None:
    if not isinstance(raw, dict):
        return None
    return {phase: float(raw[phase]) for phase in COLD_PHASES if isinstance(raw.get(phase), int | float)}


def replies_of(fields: Mapping[Any, bytes]) -> list[Reply]:
    """The replies of a reply entry: the one it holds, or, packed (fngate.queue.HEADERS), each of
    a batch's replies to one gateway in order."""
    if HEADERS not in fields:
        return [Reply.decode(fields)]
    body = memoryview(fields.get(BODIES, b""))
    replies = []
    offset = 0
    for header in orjson.loads(fields[HEADERS]):
        tensors, offset = _tensors(header, body, offset)
        replies.append(Reply.from_header(header, tensors))
    return replies


def invocations_of(fields: Mapping[Any, bytes]) -> list[tuple[Invocation, int]]:
    """The invocations of an invocation entry, each with its share of the entry's bytes (what it
    counts against max_queue_bytes): the one it holds, or, grouped (fngate.queue.HEADERS), each of
    the invocations a gateway queued together, in order, the bytes shared evenly."""
    if HEADERS not in fields:
        return [(Invocation.decode(fields), entry_bytes(fields))]
    body = memoryview(fields.get(BODIES, b""))
    headers = orjson.loads(fields[HEADERS])
    if not isinstance(headers, list) or not headers:
        raise InvalidArgument("a grouped entry holds no invocation")
    total = len(fields[HEADERS]) + len(body)
    share, rest = divmod(total, len(headers))
    members, offset = [], 0
    for at, header in enumerate(headers):
        tensors, offset = _tensors(header, body, offset)
        members.append((Invocation.from_header(header, tensors, {}), share + (rest if at == 0 else 0)))
    return members


def _encode(header: dict[str, Any], tensors: Tensors) -> Fields:
    specs = []
    buffers = []
    for name, array in tensors.items():
        raw = to_bytes(array)
        specs.append([name, datatype_of(array), list(array.shape), len(raw)])
        buffers.append(raw)
    header["t"] = specs
    return {HEADER: orjson.dumps(header), BODY: b"".join(buffers)}


def _decode(fields: Mapping[Any, bytes]) -> tuple[dict[str, Any], Tensors]:
    header = orjson.loads(fields[HEADER])
    tensors, _ = _tensors(header, memoryview(fields.get(BODY, b"")), 0)
    return header, tensors


def _tensors(header: dict[str, Any], body: memoryview, offset: int) -> tuple[Tensors, int]:
    """The tensors a header lists, from `body` at `offset`; and the offset after them."""
    if header.get("v") != WIRE_VERSION:
        raise InvalidArgument(f"wire version {header.get('v')} is not {WIRE_VERSION}")
    tensors: Tensors = {}
    for name, datatype, shape, size in header["t"]:
        tensors[name] = from_bytes(datatype, shape, body[offset : offset + size], name)
        offset += size
    return tensors, offset
