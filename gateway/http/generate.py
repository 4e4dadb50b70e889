"""Triton's generate extension, streamed: `POST /v2/models/{name}[/versions/{version}]/generate_stream`
answers with server-sent events, one per response as it comes (a decoupled model's any number, any
other model's one). The body is one JSON object: a field per input (a scalar, or nested lists in
the input's shape without its batch dimension), the rest request parameters; each event is
`data: {"model_name", "model_version", and a field per output}` (an output of one element as a
scalar, else nested lists; BYTES as text), an error as `data: {"error": ...}` that ends the stream.

Bounded as gateway.http.streaming bounds every streamed call: the body is read up to its
MAX_BODY_BYTES; events wait for a slow reader in a queue of MAX_QUEUED, past which the rest of the
request's responses are dropped and the stream ends with an error; a client that leaves cancels the
invocation (a runner that has not read it never runs it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fngate.errors import FunctionError, InvalidArgument
from fngate.manifest import FunctionManifest
from fngate.wire import Reply
from gateway.call import Call
from gateway.http.codec import InferRequest, load_json, v2_request
from gateway.http.guard import principal_of
from gateway.http.streaming import MAX_BODY_BYTES, Responses, event, read_body
from gateway.state import services
from gateway.validation import parse_now

MAX_PARAMETERS = 64


async def generate_stream(request: Request) -> Response:
    found = services(request)
    params = request.path_params
    function = found.catalog.get(params["name"], params.get("version"))
    manifest = function.manifest
    body = await read_body(request, min(found.settings.max_body_bytes, MAX_BODY_BYTES))
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
    responses = Responses(found.dispatcher, call)
    return StreamingResponse(_events(responses, manifest), media_type="text/event-stream")


async def _events(responses: Responses, manifest: FunctionManifest) -> AsyncIterator[bytes]:
    try:
        async for reply in responses:
            yield event(_rendered(reply, manifest))
    except FunctionError as exc:
        yield event({"error": exc.message})
    finally:
        responses.close()  # the client left: so does its invocation


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
