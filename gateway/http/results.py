"""An asynchronous invocation's result as HTTP: the 202 of a submission, GET and DELETE
/v1/invocations/{id} (gateway.invocations reads and cancels), and the rendering of a result that
callbacks send too."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fngate import queue
from fngate.errors import DeadlineExceeded, FunctionError, InvalidArgument
from fngate.manifest import FunctionManifest
from fngate.wire import Reply
from gateway.auth import ANY, Principal
from gateway.catalog import Catalog
from gateway.http.codec import InferRequest, render_v1, render_v2
from gateway.http.errors import error_body, status_of
from gateway.http.guard import Guarded, principal_of
from gateway.http.rendering import dumps, json_response
from gateway.invocations import MAX_WAIT_S, Accepted, AsyncInvocation, AsyncInvocations, is_pending
from gateway.state import services


def render(result: queue.Result, catalog: Catalog) -> tuple[int, dict[str, str], bytes]:
    """The answer of GET /v1/invocations/{id}: the synchronous call's status, headers and body once
    done; 202 and the state while pending; 410 once cancelled."""
    submission = AsyncInvocation.decode(result.record)
    headers = {"x-fngate-state": result.state, **_callback_headers(result)}
    if result.reply is None:
        if result.cancelled:
            body = {"error": "the invocation was cancelled", "code": "cancelled", "state": "cancelled"}
            return 410, headers | {"content-type": "application/json"}, dumps(body)
        if not is_pending(result):  # nobody ran it in time, and no runner came to say so
            headers["x-fngate-state"] = "failed"
            return _failure(headers, DeadlineExceeded("the deadline passed while queued"))
        return 202, headers | {"content-type": "application/json"}, dumps(state_document(result))
    reply = Reply.decode(result.reply)
    if reply.error is not None:
        headers["x-fngate-state"] = "failed"
        return _failure(headers, reply.error)
    if submission.outputs is not None:
        reply = dataclasses.replace(reply, outputs={name: reply.outputs[name] for name in submission.outputs})
    if submission.dialect == "v1":
        return 200, headers | {"content-type": "application/json"}, render_v1(reply)
    request = InferRequest({}, None, frozenset(submission.binary_outputs), submission.request_id, None)
    content, extra = render_v2(request, reply, _manifest(catalog, submission))
    return 200, headers | extra, content


def state_document(result: queue.Result) -> dict[str, Any]:
    submission = AsyncInvocation.decode(result.record)
    doc: dict[str, Any] = {"id": submission.id, "function": submission.function, "state": result.state}
    if submission.callback_url:
        doc["callback"] = {"attempts": [orjson.loads(attempt) for attempt in result.callbacks]}
    return doc


def _failure(headers: dict[str, str], error: FunctionError) -> tuple[int, dict[str, str], bytes]:
    return status_of(error), headers | {"content-type": "application/json"}, error_body(error)


def _callback_headers(result: queue.Result) -> dict[str, str]:
    if not result.callbacks:
        return {}
    last = orjson.loads(result.callbacks[-1])
    return {"x-fngate-callback-attempts": str(len(result.callbacks)), "x-fngate-callback": last["outcome"]}


def _manifest(catalog: Catalog, submission: AsyncInvocation) -> FunctionManifest:
    try:
        return catalog.get(submission.function, submission.version).manifest
    except FunctionError:  # removed since: the newest known manifest still names the datatypes
        return catalog.get(submission.function, None).manifest


def accepted_response(accepted: Accepted) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The 202 of a submission: where to fetch the result, and the id."""
    location = f"/v1/invocations/{accepted.invocation_id}"
    headers = [
        (b"content-type", b"application/json"),
        (b"location", location.encode()),
        (b"preference-applied", b"respond-async"),
    ]
    if accepted.again:
        headers.append((b"x-fngate-idempotent-replay", b"true"))
    body = {
        "id": accepted.invocation_id,
        "state": "done" if accepted.done else "accepted",
        "location": location,
    }
    return 202, headers, dumps(body)


def _principal(request: Request) -> Principal:
    return principal_of(request.scope)


def _service(request: Request) -> AsyncInvocations:
    return services(request).invocations


def _wait_s(request: Request) -> float:
    raw = request.query_params.get("wait", "0")
    try:
        wait_s = float(raw)
    except ValueError:
        raise InvalidArgument(f"wait must be a number of seconds, not {raw[:32]!r}") from None
    if not 0 <= wait_s <= MAX_WAIT_S:
        raise InvalidArgument(f"wait must be between 0 and {MAX_WAIT_S:g} s")
    return wait_s


def _delete(request: Request) -> bool:
    raw = request.query_params.get("delete", "false")
    if raw not in ("true", "false"):
        raise InvalidArgument(f"delete must be true or false, not {raw[:32]!r}")
    return raw == "true"


async def get_invocation(request: Request) -> Response:
    """The result; with ?delete=true, a result that is no longer pending is dropped once read (its
    bytes leave its key's quota at once, rather than at its result_ttl_s)."""
    service = _service(request)
    delete = _delete(request)
    invocation_id = request.path_params["id"]
    result = await service.read(invocation_id, _principal(request), _wait_s(request))
    if request.query_params.get("view") == "state":
        return json_response(state_document(result))
    status, headers, content = render(result, service.catalog)
    if status == 202:
        headers["retry-after"] = "1"
    elif delete:
        await service.drop(invocation_id, result)
    media = headers.pop("content-type", "application/json")
    return Response(content, status, headers, media_type=media)


async def delete_invocation(request: Request) -> Response:
    invocation_id = request.path_params["id"]
    outcome = await _service(request).cancel(invocation_id, _principal(request))
    if outcome == "cancelled":
        return json_response({"id": invocation_id, "state": "cancelled"})
    body = {"error": f"the invocation has already {'started' if outcome == 'running' else 'finished'}"}
    return json_response(body | {"code": "invalid_argument", "state": outcome}, 409)


# Any valid key: an invocation is read or cancelled only by the key that made it (or an admin's).
ROUTES: list[Route] = [
    Guarded("/v1/invocations/{id}", get_invocation, ANY, methods=["GET"]),
    Guarded("/v1/invocations/{id}", delete_invocation, ANY, methods=["DELETE"]),
]
