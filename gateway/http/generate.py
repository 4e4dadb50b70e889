"""Triton's generate extension, streamed: `POST /v2/models/{name}[/versions/{version}]/generate_stream`
answers with server-sent events, one per response as it comes (a decoupled model's any number, any
other model's one). The body is one JSON object: a field per input (a scalar, or nested lists in
the input's shape without its batch dimension), the rest request parameters; each event is
`data: {"model_name", "model_version", and a field per output}` (an output of one element as a
scalar, else nested lists; BYTES as text), an error as `data: {"error": ...}` that ends the stream.

Bounded: the body is read up to MAX_BODY_BYTES; events wait for a slow reader in a queue
of MAX_QUEUED, past which the rest of the request's responses are dropped and the stream ends with
an error; a client that leaves cancels the invocation (a runner that has not read it never runs it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fngate.errors import FunctionError, InvalidArgument, PayloadTooLarge
from fngate.manifest import FunctionManifest
from fngate.wire import Reply
from gateway.call import Call
from gateway.http.codec import InferRequest, load_json, v2_request
from gateway.http.guard import principal_of
from gateway.state import services
from gateway.validation import parse_now

MAX_BODY_BYTES = 1024 * 1024
"""A generate body is one JSON object read whole: it is held to this (or the gateway's body limit,
if smaller); larger tensors go through the infer routes, which decode as they read."""
MAX_QUEUED = 1024
"""Responses of one request waiting for its client to read them."""
MAX_PARAMETERS = 64


async def generate_stream(request: Request) -> Response:
    found = services(request)
    params = request.path_params
    function = found.catalog.get(params["name"], params.get("version"))
    manifest = function.manifest
    body = await _body(request, min(found.settings.max_body_bytes, MAX_BODY_BYTES))
    parsed = parse_now(_parsed, body, manifest)
    call = Call(
        function,
        parsed.inputs,
        parsed.outputs,
        principal_of(request.scope),
        parsed.timeout_ms,
        use_cache=parsed.use_cache,
        traceparent=request.headers.get("traceparent"),
        priority=parsed.priority,
    )
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    dropped = [0]
    spec = manifest.model_spec
    if spec is not None and spec.decoupled:

        def on_part(reply: Reply) -> None:
            if events.qsize() >= MAX_QUEUED:
                dropped[0] += 1
            else:
                events.put_nowait(("part", reply))

        call.on_part = on_part
    answer = found.dispatcher.invoke(call)
    answer.add_done_callback(lambda done: events.put_nowait(("end", done)))
    return StreamingResponse(_events(events, answer, manifest, dropped), media_type="text/event-stream")


async def _events(
    events: asyncio.Queue[tuple[str, Any]],
    answer: asyncio.Future[Reply],
    manifest: FunctionManifest,
    dropped: list[int],
) -> AsyncIterator[bytes]:
    try:
        while True:
            kind, item = await events.get()
            if kind == "part":
                yield _event(_rendered(item, manifest))
                continue
            if item.cancelled():
                return
            error = item.exception()
            if error is not None:
                message = error.message if isinstance(error, FunctionError) else "internal error"
                yield _event({"error": message})
                return
            reply: Reply = item.result()
            if reply.outputs:
                yield _event(_rendered(reply, manifest))
            if dropped[0]:
                message = (
                    f"{dropped[0]} responses were dropped: the client read its stream too slowly "
                    f"({MAX_QUEUED} responses waited to be read)"
                )
                yield _event({"error": message})
            return
    finally:
        if not answer.done():  # the client left: so does its invocation
            answer.cancel()


def _event(document: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(document) + b"\n\n"


def _rendered(reply: Reply, manifest: FunctionManifest) -> dict[str, Any]:
    if reply.error is not None:
        return {"error": reply.error.message}
    document: dict[str, Any] = {"model_name": manifest.model_name, "model_version": reply.version}
    for name, array in reply.outputs.items():
        value = np.asarray(array)
        if value.dtype == object:
            value = np.vectorize(_text, otypes=[object])(value)
        document[name] = value.reshape(()).item() if value.size == 1 else value.tolist()
    return document


def _text(item: Any) -> Any:
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else item


async def _body(request: Request, limit: int) -> bytes:
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
    return b"".join(chunks)


def _parsed(body: bytes, manifest: FunctionManifest) -> InferRequest:
    """The V2 request the generate body stands for: its inputs by name, the rest parameters."""
    document = load_json(body)
    inputs = []
    parameters: dict[str, Any] = {}
    for key, value in document.items():
        spec = manifest.input(key)
        if spec is None:
            if isinstance(value, dict | list):
                raise InvalidArgument(f"'{key[:64]}' is no input of '{manifest.model_name}' nor a parameter")
            parameters[key] = value
            continue
        data = value if isinstance(value, list) else [value]
        shape = list(np.shape(data))
        if manifest.batched and len(shape) == len(spec.shape) - 1:
            shape = [1, *shape]
        inputs.append({"name": key, "datatype": spec.datatype, "shape": shape, "data": data})
    if len(parameters) > MAX_PARAMETERS:
        raise InvalidArgument(f"at most {MAX_PARAMETERS} parameters")
    return v2_request({"inputs": inputs, "parameters": parameters}, memoryview(b""), manifest, {})
