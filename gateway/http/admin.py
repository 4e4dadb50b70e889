"""Administrative HTTP routes: the Open Inference Protocol model repository extension (index, load,
unload; gateway.control carries them out). Kept apart from the data plane, in a route list of their
own, so that they can sit behind their own auth scope."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import control
from gateway.auth import ADMIN, READ
from gateway.http.bodies import control_json
from gateway.http.guard import Guarded
from gateway.http.rendering import json_response
from gateway.state import services


async def repository_index(request: Request) -> Response:
    body = await control_json(request, services(request).settings.body_timeout_s)
    entries = await control.repository_index(services(request).catalog, bool(body.get("ready", False)))
    return json_response(entries)


async def load_model(request: Request) -> Response:
    found = services(request)
    body = await control_json(request, found.settings.body_timeout_s)
    parameters = body.get("parameters") if isinstance(body, dict) else None
    parameters = parameters if isinstance(parameters, dict) else {}
    name = request.path_params["name"]
    await control.load_request(found.catalog, name, parameters, found.settings.load_timeout_s)
    return json_response({})


async def unload_model(request: Request) -> Response:
    found = services(request)
    await control.unload(found.catalog, request.path_params["name"], found.settings.load_timeout_s)
    return json_response({})


ROUTES: list[Route] = [
    Guarded("/v2/repository/index", repository_index, READ, methods=["POST"]),
    Guarded("/v2/repository/models/{name}/load", load_model, ADMIN, methods=["POST"]),
    Guarded("/v2/repository/models/{name}/unload", unload_model, ADMIN, methods=["POST"]),
]
