"""What the routes that stream over HTTP (server-sent events: Triton's generate_stream, the
OpenAI-compatible completions) share: a body read whole up to a limit, the event framing, and a
call's responses as they come, through a bounded queue, with the call cancelled when its reader
goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request

from fngate.errors import FunctionError, Internal, Overloaded, PayloadTooLarge
from fngate.wire import Reply
from gateway.call import Call
from gateway.decompression import decode_body
from gateway.dispatch import Dispatcher

MAX_BODY_BYTES = 1024 * 1024
"""A streamed call's body is one JSON object read whole: it is held to this (or the gateway's body
limit, if smaller); larger tensors go through the infer routes, which decode as they read."""
MAX_QUEUED = 1024
"""Responses of one call waiting for their reader."""


class Responses:
    """The responses of one call, read with `async for` as they come: a decoupled model's each (one
    with `error` set is an error response; the ones after it still come), then the call's own reply
    where it carries outputs (any other model's one answer). The call is sent when this is made.

    The iteration raises the call's error (a FunctionError) where it comes; and Overloaded after the
    last response when the reader let MAX_QUEUED wait, past which the rest were dropped. `close()`,
    or an iteration left before its end, cancels the call (a runner that has not read it never runs
    it; a decoupled model's later responses are dropped)."""

    def __init__(self, dispatcher: Dispatcher, call: Call) -> None:
        self.model_name = call.function.manifest.model_name
        self._parts: asyncio.Queue[Reply | None] = asyncio.Queue()
        self._dropped = 0
        spec = call.function.manifest.model_spec
        if spec is not None and spec.decoupled:
            call.on_part = self._on_part
        self._answer = dispatcher.invoke(call)
        self._answer.add_done_callback(lambda _: self._parts.put_nowait(None))

    def _on_part(self, reply: Reply) -> None:
        if self._parts.qsize() >= MAX_QUEUED:
            self._dropped += 1
        else:
            self._parts.put_nowait(reply)

    async def __aiter__(self) -> AsyncIterator[Reply]:
        try:
            while (part := await self._parts.get()) is not None:
                yield part
            if self._answer.cancelled():
                return
            error = self._answer.exception()
            if isinstance(error, FunctionError):
                raise error
            if error is not None:
                raise Internal("internal error") from error
            reply = self._answer.result()
            if reply.outputs:
                yield reply
            if self._dropped:
                raise Overloaded(
                    f"{self._dropped} responses of model '{self.model_name}' were dropped: the client "
                    f"read its stream too slowly ({MAX_QUEUED} responses waited to be read)"
                )
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the call if it is still on its way (the reader went away, or read enough)."""
        if not self._answer.done():
            self._answer.cancel()


def event(document: Any) -> bytes:
    """One server-sent event of `data:` only, a JSON document (or text as it is, `[DONE]`)."""
    data = document.encode() if isinstance(document, str) else orjson.dumps(document)
    return b"data: " + data + b"\n\n"


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (PayloadTooLarge) as soon as it is declared or found over `limit`,
    its Content-Encoding (gzip, deflate) undone within the same limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body of {declared} bytes is over the limit of {limit} bytes")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return decode_body(b"".join(chunks), request.headers.get("content-encoding"), limit)
