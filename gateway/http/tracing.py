"""A plain ASGI middleware that gives every HTTP request a server span (OpenTelemetry HTTP
semantic conventions), continuing the caller's trace when it sends a traceparent."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fngate.telemetry import extract

tracer = trace.get_tracer("fngate.gateway")


class TracingMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        parent = extract(headers.get(b"traceparent", b"").decode("latin-1") or None)
        method = scope["method"]
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "url.path": scope["path"],
            "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", "1.1"),
        }
        with tracer.start_as_current_span(
            f"{method} {scope['path']}", context=parent, kind=SpanKind.SERVER, attributes=attributes
        ) as span:

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start" and span.is_recording():
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, traced_send)
            route = scope.get("route")
            if route is not None and span.is_recording():
                span.set_attribute("http.route", route.path)
                span.update_name(f"{method} {route.path}")
