"""The HTTP app: Starlette's routes for everything but the invocation routes, and the layers in
front of them, built in one visible expression."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.types import ASGIApp

from fngate import telemetry
from fngate.config import GatewaySettings
from fngate.errors import FunctionError
from gateway.auth import ADMIN, ANY, BROWSE, INVOKE, READ, KeyTable
from gateway.http import admin, deployments, endpoints, openai, results, shared_memory
from gateway.http.asgi_link import InvokeRoutes
from gateway.http.compression import GZIP_MIN_BYTES, GzipLargeResponses
from gateway.http.errors import handle_function_error, handle_unknown_route
from gateway.http.generate import generate_stream
from gateway.http.guard import OPEN_ROUTE, Guarded
from gateway.http.tracing import TracingMiddleware

# The invocation routes are gateway.http.invoke's, in front of these. Each route names the scope
# its callers' keys need (gateway.http.guard.Guarded).
ROUTES = [
    Guarded("/v2/health/live", endpoints.live, OPEN_ROUTE),
    Guarded("/v2/health/ready", endpoints.ready, OPEN_ROUTE),
    Guarded("/v2", endpoints.server_metadata, ANY),  # name, version, extensions: perf_analyzer reads them
    Guarded("/v2/", endpoints.server_metadata, ANY),
    Guarded("/v2/models/stats", endpoints.model_statistics, BROWSE),  # lists only what the key may read
    Guarded("/v2/models/{name}", endpoints.model_metadata, READ),
    Guarded("/v2/models/{name}/versions/{version}", endpoints.model_metadata, READ),
    Guarded("/v2/models/{name}/ready", endpoints.model_ready, READ),
    Guarded("/v2/models/{name}/versions/{version}/ready", endpoints.model_ready, READ),
    Guarded("/v2/models/{name}/config", endpoints.model_config_json, READ),
    Guarded("/v2/models/{name}/versions/{version}/config", endpoints.model_config_json, READ),
    Guarded("/v2/models/{name}/stats", endpoints.model_statistics, READ),
    Guarded("/v2/models/{name}/versions/{version}/stats", endpoints.model_statistics, READ),
    Guarded("/v2/models/{name}/generate_stream", generate_stream, INVOKE, methods=["POST"]),
    Guarded(
        "/v2/models/{name}/versions/{version}/generate_stream", generate_stream, INVOKE, methods=["POST"]
    ),
    Guarded("/v1/functions", endpoints.list_functions, READ),
    # OpenAI's API: the function is named in the body, its invoke scope checked once it is read.
    Guarded("/v1/chat/completions", openai.chat_completions, BROWSE, ["POST"], openai.error_body),
    Guarded("/v1/completions", openai.completions, BROWSE, ["POST"], openai.error_body),
    Guarded("/v1/models", openai.list_models, BROWSE, error_body=openai.error_body),
    Guarded("/v1/models/{name}", openai.get_model, READ, error_body=openai.error_body),
    Guarded("/metrics", endpoints.prometheus, ADMIN),
    *deployments.ROUTES,
    *admin.ROUTES,
    *results.ROUTES,
    *shared_memory.ROUTES,
]


def build(settings: GatewaySettings, key_table: KeyTable, lifespan: Callable[[Any], Any]) -> ASGIApp:
    """The app, outermost layer first: tracing (only with a tracing SDK configured; otherwise its
    spans would be no-ops), gzip for clients that accept it (large responses only, invocations'
    included), the invocation routes (which check their own keys), then Starlette's routes (each
    checks the scope it needs)."""
    app = Starlette(
        routes=ROUTES,
        lifespan=lifespan,
        exception_handlers={
            FunctionError: handle_function_error,
            404: handle_unknown_route,
            405: handle_unknown_route,
        },
    )
    invoking = InvokeRoutes(app, settings.max_headers, settings.max_connections, settings.retry_after_s)
    served: ASGIApp = GzipLargeResponses(invoking, GZIP_MIN_BYTES)
    return TracingMiddleware(served) if telemetry.tracing_active() else served
