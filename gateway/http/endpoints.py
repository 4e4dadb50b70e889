"""Thin HTTP handlers of the Open Inference Protocol's non-inference routes: read the path, ask
the core (gateway.metadata), render JSON."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from fngate.errors import Unavailable
from gateway import metadata, metrics
from gateway.auth import READ
from gateway.http.guard import principal_of
from gateway.http.rendering import json_response
from gateway.state import services


async def live(request: Request) -> Response:
    return json_response({"live": True})


async def ready(request: Request) -> Response:
    """This gateway can queue: the loops that read Redis reach it (no round trip of its own: a
    probe must not add load to a Redis in trouble), and its catalog is loaded (the lifespan loaded it
    before serving). Not ready is a 503 with Retry-After, the protocol's body and the reason."""
    found = services(request)
    health = found.catalog.health
    if not health.available:
        reason = f"{health.name} unavailable for {health.down_for_s():.1f} s ({health.last_error})"
        headers = {"Retry-After": str(found.settings.retry_after_s)}
        return json_response({"ready": False, "error": reason, "code": Unavailable.code.value}, 503, headers)
    return json_response({"ready": True})


async def server_metadata(request: Request) -> Response:
    return json_response(metadata.server(services(request).settings.server_name))


async def model_metadata(request: Request) -> Response:
    params = request.path_params
    return json_response(metadata.model(services(request).catalog, params["name"], params.get("version")))


async def model_ready(request: Request) -> Response:
    """200 for a served version, idle or not (its next invocation loads it); 400 once explicitly
    unloaded, until loaded again."""
    params = request.path_params
    function, ready = metadata.ready(services(request).catalog, params["name"], params.get("version"))
    return json_response({"name": function.manifest.model_name, "ready": ready}, 200 if ready else 400)


async def model_config_json(request: Request) -> Response:
    params = request.path_params
    found = metadata.configuration(services(request).catalog, params["name"], params.get("version"))
    return json_response(found)


async def model_statistics(request: Request) -> Response:
    """Of one function, or of every function the key may read."""
    params = request.path_params
    found = services(request)
    principal = principal_of(request.scope)
    stats = await metadata.statistics(
        found.catalog,
        found.redis,
        params.get("name"),
        params.get("version"),
        lambda name: principal.allows(READ, name),
    )
    return json_response(stats)


async def list_functions(request: Request) -> Response:
    return json_response({"functions": metadata.functions(services(request).catalog)})


async def prometheus(request: Request) -> Response:
    found = services(request)
    functions = found.catalog.functions
    await metrics.refresh_queue_gauges(
        found.redis, {name: functions[name].manifest.batching.priorities for name in sorted(functions)}
    )
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
