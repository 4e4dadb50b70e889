"""OpenAI's API for the functions that generate text (manifest `text_generation`), so that OpenAI's
own clients work unchanged: `POST /v1/chat/completions` and `POST /v1/completions`, answered whole
or, with `stream: true`, as OpenAI streams them (server-sent events, a chunk each, then
`data: [DONE]`), and `GET /v1/models[/{name}]`. Errors are OpenAI's
`{"error": {"message", "type", "param", "code"}}` (`code`: fngate's error code), with fngate's
statuses (gateway.http.errors).

The text is gateway.http.generation's: the prompt into the function's prompt input (a chat's
messages as `role: content` lines, then `assistant:`), each response of the model a token of the
answer. A streamed request waits for its first token (or its error) before it answers: a call
refused, late or failed before any text gets its status, not an event.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from fngate.errors import FunctionError, FunctionNotFound, InvalidArgument
from fngate.repository import FunctionVersion
from gateway.auth import INVOKE, READ
from gateway.call import Call
from gateway.catalog import Catalog
from gateway.http.codec import load_json
from gateway.http.errors import error_response, status_of
from gateway.http.generation import Generation, inputs_of
from gateway.http.guard import authorization, principal_of
from gateway.http.rendering import dumps, json_response
from gateway.http.streaming import MAX_BODY_BYTES, Responses, event, read_body
from gateway.state import services
from gateway.validation import parse_now, shown

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}
ERROR_TYPES |= {404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}
"""OpenAI's error `type` by status; other 4xx are invalid_request_error, 5xx server_error."""
SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed")
"""Fields passed on to a model's parameters input as given (with max_tokens and stop), once checked
to be numbers (seed an integer)."""
MAX_STOPS = 4
MAX_STOP_CHARS = 256


class BadField(InvalidArgument):
    """A request field that is wrong, named in the error's `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class UnknownModel(FunctionNotFound):
    param = "model"


def openai_error(exc: FunctionError) -> dict[str, Any]:
    status = status_of(exc)
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    param = getattr(exc, "param", None)
    return {"error": {"message": exc.message, "type": kind, "param": param, "code": exc.code.value}}


def error_body(exc: FunctionError) -> bytes:
    """A refusal as OpenAI's clients read it (gateway.http.guard.Guarded's error_body)."""
    return dumps(openai_error(exc))


def answers_errors(
    endpoint: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """`endpoint`, its FunctionErrors answered in OpenAI's shape (not the app's handler's)."""

    async def answered(request: Request) -> Response:
        try:
            return await endpoint(request)
        except FunctionError as exc:
            return error_response(exc, services(request).settings.retry_after_s, error_body)

    return answered


@dataclasses.dataclass(frozen=True, slots=True)
class Asked:
    """What a completion request asks that the gateway honours."""

    model: str
    prompt: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    stops: tuple[str, ...]
    sampling: dict[str, Any]
    """What a model's parameters input gets (gateway.http.generation.inputs_of)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Head:
    """What every chunk (or the whole answer) of one completion says about it."""

    id: str
    created: int
    model: str
    chat: bool
    fingerprint: str

    def document(self, kind: str) -> dict[str, Any]:
        found = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return found | {"system_fingerprint": self.fingerprint}


@answers_errors
async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


@answers_errors
async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def _complete(request: Request, chat: bool) -> Response:
    found = services(request)
    body = await read_body(request, min(found.settings.max_body_bytes, MAX_BODY_BYTES))
    document = load_json(body)
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise BadField(
            "model", "'model' must name a function that generates text (GET /v1/models lists them)"
        )
    # The route checked that the key is one; whether it may invoke this function, only the body says.
    principal = found.keys.authorize(authorization(request.scope["headers"]), INVOKE, model)
    function = _generator(found.catalog, model)
    asked = parse_now(_asked, document, model, chat)
    generation = function.manifest.text_generation
    assert generation is not None  # _generator checked
    call = Call(
        function,
        inputs_of(function.manifest, asked.prompt, asked.sampling),
        (generation.output,),
        principal,
        traceparent=request.headers.get("traceparent"),
    )
    responses = Responses(found.dispatcher, call)
    text = Generation(responses, generation.output, asked.prompt, asked.max_tokens, asked.stops)
    prefix = "chatcmpl" if chat else "cmpl"
    head = Head(
        f"{prefix}-{uuid.uuid4().hex}", int(time.time()), asked.model, chat, f"fngate-{function.version}"
    )
    pieces = aiter(text)
    if not asked.stream:
        whole = "".join([piece async for piece in pieces])
        return json_response(_whole(head, whole, text))
    first = await anext(pieces, None)  # a failure before the first token is the answer's status
    return StreamingResponse(_chunks(head, asked, first, pieces, text), media_type="text/event-stream")


def _generator(catalog: Catalog, model: str, invoked: bool = True) -> FunctionVersion:
    """The function a request names, if it generates text: the version that answers an invocation
    (`invoked`), else the newest served, unloaded or not."""
    try:
        function = catalog.get(model) if invoked else catalog.find(model)
    except FunctionNotFound as exc:
        raise UnknownModel(f"The model '{shown(model)}' does not exist ({exc.message})") from exc
    if function.manifest.text_generation is None:
        message = f"function '{function.name}' does not generate text (its manifest has no text_generation)"
        if not invoked:
            raise UnknownModel(message)
        raise BadField("model", f"{message}: call it at /v2/models/{function.manifest.model_name}/infer")
    return function


async def _chunks(
    head: Head, asked: Asked, first: str | None, pieces: AsyncIterator[str], text: Generation
) -> AsyncIterator[bytes]:
    try:
        if head.chat:
            yield event(_chunk(head, asked, {"role": "assistant", "content": ""}))
        if first is not None:
            yield event(_chunk(head, asked, {"content": first} if head.chat else first))
        async for piece in pieces:
            yield event(_chunk(head, asked, {"content": piece} if head.chat else piece))
        yield event(_chunk(head, asked, {} if head.chat else "", text.finish_reason))
        if asked.include_usage:
            yield event(head.document(_kind(head, True)) | {"choices": [], "usage": _usage(text)})
        yield event("[DONE]")
    except FunctionError as exc:
        yield event(openai_error(exc))
    finally:
        text.close()  # the client left (or the text ended): so does its invocation


def _kind(head: Head, streamed: bool) -> str:
    if not head.chat:
        return "text_completion"
    return "chat.completion.chunk" if streamed else "chat.completion"


def _chunk(
    head: Head, asked: Asked, delta: dict[str, str] | str, finish: str | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "delta" if head.chat else "text": delta, "logprobs": None, "finish_reason": finish}
    chunk = head.document(_kind(head, True)) | {"choices": [choice]}
    return chunk | {"usage": None} if asked.include_usage else chunk


def _whole(head: Head, whole: str, text: Generation) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": text.finish_reason}
    if head.chat:
        choice["message"] = {"role": "assistant", "content": whole, "refusal": None}
    else:
        choice["text"] = whole
    return head.document(_kind(head, False)) | {"choices": [choice], "usage": _usage(text)}


def _usage(text: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": text.prompt_tokens,
        "completion_tokens": text.tokens,
        "total_tokens": text.prompt_tokens + text.tokens,
    }


def _asked(document: dict[str, Any], model: str, chat: bool) -> Asked:
    """A completion request's body, checked: what the gateway honours of it, and the sampling
    fields a model's parameters input gets. Fields not named here are ignored."""
    prompt = chat_prompt(document.get("messages")) if chat else _prompt(document.get("prompt"))
    if document.get("n", 1) not in (1, None):
        raise BadField("n", "only one choice is generated a request: 'n' must be 1")
    stream = document.get("stream") or False
    options = document.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise BadField("stream", "'stream' must be true or false, 'stream_options' an object")
    limit = _max_tokens(document, "max_completion_tokens") if chat else None
    limit = limit if limit is not None else _max_tokens(document, "max_tokens")
    stops = stops_of(document.get("stop"))
    sampling: dict[str, Any] = {"max_tokens": limit} if limit is not None else {}
    sampling |= {"stop": list(stops)} if stops else {}
    for field in SAMPLING:
        value = document.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int if field == "seed" else int | float):
            raise BadField(
                field, f"'{field}' must be a number" + (" (an integer)" if field == "seed" else "")
            )
        sampling[field] = value
    return Asked(model, prompt, stream, bool(options.get("include_usage")), limit, stops, sampling)


def chat_prompt(messages: Any) -> str:
    """A chat as one prompt: a `role: content` line for each message (a content of parts: its text
    parts joined), then `assistant:`, the line the model completes."""
    if not isinstance(messages, list) or not messages:
        raise BadField("messages", "'messages' must be a non-empty list of {role, content} objects")
    lines = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or not role:
            raise BadField(f"messages[{index}]", f"messages[{index}] must be an object with a 'role'")
        text = _content(message.get("content"), index)
        lines.append(f"{role}: {text}" if text else f"{role}:")
    return "\n".join([*lines, "assistant:"])


def _content(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        ]
        if len(texts) == len(content):
            return "".join(texts)
    raise BadField(
        f"messages[{index}].content", f"messages[{index}].content must be text (a string or text parts)"
    )


def stops_of(stop: Any) -> tuple[str, ...]:
    """`stop`: a string or a list of them, up to MAX_STOPS of up to MAX_STOP_CHARS each."""
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(item, str) and 0 < len(item) <= MAX_STOP_CHARS for item in stops)
    ):
        raise BadField(
            "stop",
            f"'stop' must be a string or a list of up to {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} "
            "characters",
        )
    return tuple(stops)


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadField("prompt", "'prompt' must be one string (several prompts, or tokens, are not taken)")
    return prompt


def _max_tokens(document: dict[str, Any], field: str) -> int | None:
    value = document.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise BadField(field, f"'{field}' must be a positive integer")
    return value


@answers_errors
async def list_models(request: Request) -> Response:
    """The functions that generate text and that the key may read (or invoke)."""
    found = services(request)
    principal = principal_of(request.scope)
    data = [
        _model(function)
        for _, function in sorted(found.catalog.functions.items())
        if function.manifest.text_generation is not None
        and principal.allows(READ, function.manifest.model_name)
    ]
    return json_response({"object": "list", "data": data})


@answers_errors
async def get_model(request: Request) -> Response:
    return json_response(_model(_generator(services(request).catalog, request.path_params["name"], False)))


def _model(function: FunctionVersion) -> dict[str, Any]:
    """A model as OpenAI lists it: `created` is not known (0)."""
    return {"id": function.manifest.model_name, "object": "model", "created": 0, "owned_by": "fngate"}
