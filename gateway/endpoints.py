"""Thin HTTP handlers: parse the request, call one service, render the answer."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response

import fngate
from fngate import keys
from fngate.errors import FunctionNotFound, Unavailable
from fngate.repository import FunctionVersion
from fngate.statistics import model_stats
from gateway.catalog import Catalog
from gateway.dispatch import Dispatcher
from gateway.model_config import backend_of, model_config, platform_of
from gateway.rendering import json_response

Handler = Callable[[Request], Awaitable[Response]]
EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration", "statistics"]
READY_TIMEOUT_S = 1.0
CACHE_HEADER = "x-fngate-cache"


@dataclasses.dataclass(frozen=True, slots=True)
class Services:
    """What the lifespan opened, handed to every request as `request.state.services`."""

    catalog: Catalog
    dispatcher: Dispatcher
    max_body_bytes: int
    redis: aioredis.Redis
    load_timeout_s: float
    """How long POST /v2/repository/models/{name}/load waits for a runner to report the model ready."""


def services(request: Request) -> Services:
    found: Services = request.state.services
    return found


async def live(request: Request) -> Response:
    return json_response({"live": True})


async def ready(request: Request) -> Response:
    """This gateway can queue: the loops that read Redis reach it (no round trip of its own: a
    probe must not add load to a Redis in trouble), and its catalog is loaded (the lifespan loaded it
    before serving). Not ready is a 503 with Retry-After, the protocol's body and the reason."""
    health = services(request).catalog.health
    if not health.available:
        reason = f"{health.name} unavailable for {health.down_for_s():.1f} s ({health.last_error})"
        headers = {"Retry-After": str(request.app.state.retry_after_s)}
        return json_response({"ready": False, "error": reason, "code": Unavailable.code.value}, 503, headers)
    return json_response({"ready": True})


async def server_metadata(request: Request) -> Response:
    return json_response({"name": "fngate", "version": fngate.__version__, "extensions": EXTENSIONS})


async def model_metadata(request: Request) -> Response:
    pinned = request.path_params.get("version")
    if pinned is not None:
        function = _described(request)
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
            "platform": platform_of(manifest),
            "inputs": [_tensor_metadata(spec) for spec in manifest.inputs],
            "outputs": [_tensor_metadata(spec) for spec in manifest.outputs],
        }
    )


async def model_ready(request: Request) -> Response:
    """200 for a served version, idle or not (its next invocation loads it); 400 once explicitly
    unloaded, until loaded again."""
    function = _described(request)
    ready = not services(request).catalog.is_unloaded(function.name)
    return json_response({"name": function.name, "ready": ready}, 200 if ready else 400)


async def model_config_json(request: Request) -> Response:
    """Triton's model configuration of the version asked for, or of the default one."""
    pinned = request.path_params.get("version")
    if pinned is not None:
        function = _described(request)
    else:
        record = services(request).catalog.record(request.path_params["name"])
        function = record.default or record.newest()
    return json_response(model_config(function.manifest))


async def model_statistics(request: Request) -> Response:
    """Triton's statistics of every served version (of one function, or of all), summed over every
    runner; a pinned version may be any stored one."""
    catalog = services(request).catalog
    name = request.path_params.get("name")
    pinned = request.path_params.get("version")
    if name is None:
        wanted = [
            (name, version) for name, record in sorted(catalog.records.items()) for version in record.served
        ]
    elif pinned is not None:
        record = catalog.record(name)
        if pinned not in record.versions:
            raise FunctionNotFound(f"function '{name}' has no version '{pinned}'")
        wanted = [(name, pinned)]
    else:
        wanted = [(name, version) for version in catalog.record(name).served]
    try:
        async with services(request).redis.pipeline(transaction=False) as pipe:
            for function, version in wanted:
                pipe.hgetall(keys.statistics(function, version))
            hashes: list[dict[bytes, bytes]] = await pipe.execute()
    except RedisError as exc:
        raise Unavailable(f"statistics are unavailable: {exc}") from exc
    return json_response(
        {
            "model_stats": [
                model_stats(function, version, raw)
                for (function, version), raw in zip(wanted, hashes, strict=True)
            ]
        }
    )


async def list_functions(request: Request) -> Response:
    catalog = services(request).catalog
    return json_response(
        {
            "functions": [
                {"name": name, "version": entry.version, "backend": backend_of(entry.manifest)}
                for name, entry in sorted(catalog.functions.items())
            ]
        }
    )


def _described(request: Request) -> FunctionVersion:
    return services(request).catalog.find(request.path_params["name"], request.path_params.get("version"))


def _tensor_metadata(spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}
