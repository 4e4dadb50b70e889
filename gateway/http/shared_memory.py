"""Triton's shared memory routes over HTTP: system shared memory regions (gateway.shared_memory) of
the caller's key, registered, listed and unregistered; CUDA shared memory listed as empty and
unregistered as nothing to do (Triton's example clients unregister both before they start), and
refused at registration (a gateway holds no GPU)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fngate.errors import InvalidArgument
from gateway.auth import INVOKER
from gateway.http.bodies import control_json
from gateway.http.guard import Guarded, principal_of
from gateway.http.rendering import json_response
from gateway.shared_memory import SharedMemory
from gateway.state import services


def _regions(request: Request) -> tuple[SharedMemory, str, str | None]:
    found = services(request).shared_memory
    assert found is not None
    return found, principal_of(request.scope).key_id, request.path_params.get("region")


async def status(request: Request) -> Response:
    regions, key_id, name = _regions(request)
    return json_response(await regions.status(key_id, name))


async def register(request: Request) -> Response:
    regions, key_id, name = _regions(request)
    body: Any = await control_json(request, services(request).settings.body_timeout_s)
    if not isinstance(body, dict) or "key" not in body:
        raise InvalidArgument("Shared memory register request has no 'key' field")
    if "byte_size" not in body:
        raise InvalidArgument("Shared memory register request has no 'byte_size' field")
    await regions.register(key_id, name or "", body["key"], body.get("offset", 0), body["byte_size"])
    return json_response({})


async def unregister(request: Request) -> Response:
    regions, key_id, name = _regions(request)
    await regions.unregister(key_id, name)
    return json_response({})


async def cuda_status(request: Request) -> Response:
    return json_response(SharedMemory.cuda_status(request.path_params.get("region")))


async def cuda_register(request: Request) -> Response:
    SharedMemory.cuda_register()
    return json_response({})


async def cuda_unregister(request: Request) -> Response:
    return json_response({})


ROUTES: list[Route] = [
    Guarded("/v2/systemsharedmemory/status", status, INVOKER, methods=["GET"]),
    Guarded("/v2/systemsharedmemory/region/{region}/status", status, INVOKER, methods=["GET"]),
    Guarded("/v2/systemsharedmemory/region/{region}/register", register, INVOKER, methods=["POST"]),
    Guarded("/v2/systemsharedmemory/unregister", unregister, INVOKER, methods=["POST"]),
    Guarded("/v2/systemsharedmemory/region/{region}/unregister", unregister, INVOKER, methods=["POST"]),
    Guarded("/v2/cudasharedmemory/status", cuda_status, INVOKER, methods=["GET"]),
    Guarded("/v2/cudasharedmemory/region/{region}/status", cuda_status, INVOKER, methods=["GET"]),
    Guarded("/v2/cudasharedmemory/region/{region}/register", cuda_register, INVOKER, methods=["POST"]),
    Guarded("/v2/cudasharedmemory/unregister", cuda_unregister, INVOKER, methods=["POST"]),
    Guarded("/v2/cudasharedmemory/region/{region}/unregister", cuda_unregister, INVOKER, methods=["POST"]),
]
