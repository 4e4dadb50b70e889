"""Thin HTTP handlers: parse the request, call one service, render the answer."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from starlette.requests import Request
from starlette.responses import Response

import fngate
from fngate.errors import Unavailable
from fngate.manifest import FunctionManifest
from fngate.repository import FunctionVersion
from gateway.catalog import Catalog
from gateway.dispatch import Dispatcher
from gateway.rendering import json_response

Handler = Callable[[Request], Awaitable[Response]]
EXTENSIONS = ["binary_tensor_data"]
CACHE_HEADER = "x-fngate-cache"


@dataclasses.dataclass(frozen=True, slots=True)
class Services:
    """What the lifespan opened, handed to every request as `request.state.services`."""

    catalog: Catalog
    dispatcher: Dispatcher
    max_body_bytes: int
    redis: aioredis.Redis


def services(request: Request) -> Services:
    found: Services = request.state.services
    return found


async def live(request: Request) -> Response:
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    """Ready while this gateway's loops reach Redis: a load balancer stops sending to it otherwise."""
    health = services(request).catalog.health
    if not health.available:
        message = f"{health.name} unavailable for {health.down_for_s():.1f} s ({health.last_error})"
        raise Unavailable(message)
    return Response(status_code=200)


async def server_metadata(request: Request) -> Response:
    return json_response({"name": "fngate", "version": fngate.__version__, "extensions": EXTENSIONS})


async def model_metadata(request: Request) -> Response:
    pinned = request.path_params.get("version")
    if pinned is not None:
        function = _function(request)
        versions = [function.version]
    else:  # no version asked for: every served one, described by the default
        record = services(request).catalog.record(request.path_params["name"])
        function = record.default or record.newest()
        versions = list(record.served)
    manifest = function.manifest
    return json_response(
        {
            "name": manifest.name,
            "versions": versions,
            "platform": _platform(manifest),
            "inputs": [_tensor_metadata(spec) for spec in manifest.inputs],
            "outputs": [_tensor_metadata(spec) for spec in manifest.outputs],
        }
    )


async def model_ready(request: Request) -> Response:
    _function(request)
    return Response(status_code=200)


async def list_functions(request: Request) -> Response:
    catalog = services(request).catalog
    return json_response(
        {
            "functions": [
                {"name": name, "version": entry.version, "backend": entry.manifest.model.backend}
                for name, entry in sorted(catalog.functions.items())
            ]
        }
    )


def _function(request: Request) -> FunctionVersion:
    return services(request).catalog.get(request.path_params["name"], request.path_params.get("version"))


def _platform(manifest: FunctionManifest) -> str:
    return {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan", "python": "python"}[
        manifest.model.backend
    ]


def _tensor_metadata(spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}
