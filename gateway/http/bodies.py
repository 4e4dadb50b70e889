"""An invocation body decoded with bounded memory and time: fed to a decoder a part at a time as
it arrives (StreamedBody), or, received whole, decompressed in steps of
INFLATE_STEP_BYTES (never more than the body limit in all); its JSON fed to gateway.http.decoding
as it comes (the JSON header alone, for the binary tensor data extension, whose binary part is kept
as it is); the bytes it holds counted against the process's decode allowance; and the digest an
Idempotency-Key is bound to computed on the way. And a control route's JSON body, read whole
within its own limit and the body timeout."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.types import Receive

from fngate.errors import InvalidArgument, PayloadTooLarge
from fngate.manifest import FunctionManifest
from gateway.allowance import Hold
from gateway.decompression import INFLATE_STEP_BYTES, Inflater
from gateway.http.codec import InferRequest, header_size, load_json, v1_request, v2_request
from gateway.http.decoding import JsonBodyDecoder
from gateway.http.errors import BodyTimeout
from gateway.invocations import RequestDigest
from gateway.validation import OFF_LOOP_BYTES

STREAM_FROM_BYTES = OFF_LOOP_BYTES
CONTROL_BODY_BYTES = 64 * 1024
"""The most a control route's JSON body (repository index, traffic) may hold."""
"""Uncompressed bodies this large, or of unknown length, are decoded as they arrive; smaller ones
are parsed whole (they cost at most a few MiB)."""


class StreamedBody:
    """A JSON body (V2, with or without binary tensor data, or /v1) fed as it arrives; `finish()`
    is the request. What it holds is added to `hold`."""

    def __init__(
        self,
        dialect: str,
        manifest: FunctionManifest,
        header_length: str | None,
        hold: Hold,
        most_bytes: int,
        digest: RequestDigest | None = None,
    ) -> None:
        self._dialect = dialect
        self._manifest = manifest
        self._hold = hold
        self._json_bytes = header_size(header_length) if dialect == "v2" else None
        # A number takes at least one character and a comma: the most elements `most_bytes` hold.
        self._decoder = JsonBodyDecoder(manifest, dialect, hold.add, most_bytes // 2 + 1)
        self._binary = bytearray()
        self._seen = 0
        self.digest = digest

    def feed(self, chunk: bytes) -> None:
        if self.digest is not None:
            self.digest.update(chunk)
        json_bytes = self._json_bytes
        if json_bytes is None or self._seen + len(chunk) <= json_bytes:
            self._decoder.feed(chunk)
        else:
            split = max(0, json_bytes - self._seen)
            if split:
                self._decoder.feed(chunk[:split])
            self._hold.add(len(chunk) - split)
            self._binary += chunk[split:]
        self._seen += len(chunk)

    def finish(self) -> InferRequest:
        if self._json_bytes is not None and self._json_bytes > self._seen:
            raise InvalidArgument(
                f"Inference-Header-Content-Length {self._json_bytes} is outside the body "
                f"of {self._seen} bytes"
            )
        if self._seen == 0:
            raise InvalidArgument("the request body is empty")
        doc = self._decoder.finish()
        if self._dialect == "v1":
            return v1_request(doc, self._manifest, self._decoder.decoded)
        return v2_request(doc, memoryview(self._binary), self._manifest, self._decoder.decoded)


def decode_streamed(
    body: StreamedBody, raw: bytes, encoding: str | None, limit_bytes: int, hold: Hold
) -> InferRequest:
    """A body received whole (compressed, say) through `body`, decompressed a step at a time.
    Blocks for as long as the body takes: run it in a thread when it is large."""
    hold.add(len(raw) + (INFLATE_STEP_BYTES if encoding else 0))
    if encoding is None or encoding.strip().lower() == "identity":
        view = memoryview(raw)
        for start in range(0, len(raw), INFLATE_STEP_BYTES):
            body.feed(bytes(view[start : start + INFLATE_STEP_BYTES]))
    else:
        inflater = Inflater(encoding, limit_bytes, body.feed)
        inflater.feed(raw)
        inflater.close()
    return body.finish()


class ClientDisconnected(Exception):
    """The client went away before its body arrived: nothing to answer."""


async def read_body(
    receive: Receive, limit: int, declared: int | None, timeout_s: float | None = None
) -> bytes:
    """The whole body, refused past `limit` bytes before it is read (when declared) or as soon as it
    is (when not), and cut (408) when it has not all arrived within `timeout_s`."""
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"the body of {declared} bytes is over the limit of {limit} bytes")
    try:
        async with asyncio.timeout(timeout_s):
            return await _receive_body(receive, limit)
    except TimeoutError:
        raise BodyTimeout(f"the body did not arrive within {timeout_s:g} s") from None


async def _receive_body(receive: Receive, limit: int) -> bytes:
    chunks = bytearray()
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        part: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes")
        if not more and not chunks:
            return part  # the whole body in one message: no copy
        chunks += part
    return bytes(chunks)


async def control_json(request: Request, timeout_s: float) -> Any:
    """A control route's JSON body ({} when empty), bounded by CONTROL_BODY_BYTES and `timeout_s`."""
    declared = request.headers.get("content-length")
    length = int(declared) if declared is not None and declared.isdigit() else None
    return load_json(await read_body(request.receive, CONTROL_BODY_BYTES, length, timeout_s), empty={})
