"""AuthMiddleware: a plain ASGI middleware that checks the key and scope of every HTTP request but
health before the app sees it. The invocation routes in front of it (gateway.http.invoke) check
their own."""

from __future__ import annotations

from typing import Any

from fngate.errors import FunctionError
from gateway.auth import KeyTable, required_scope
from gateway.http.errors import error_body, headers_of, status_of

PRINCIPAL = "fngate.principal"
"""Scope key: the caller's Principal, for the routes that need to know who calls."""


class AuthMiddleware:
    def __init__(self, app: Any, table: KeyTable, retry_after_s: int) -> None:
        self.app = app
        self.table = table
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        need = required_scope(scope["method"], scope["path"])
        if need is None:
            await self.app(scope, receive, send)
            return
        try:
            scope[PRINCIPAL] = self.table.authorize(authorization(scope["headers"]), *need)
        except FunctionError as exc:
            await send_error(send, exc, self.retry_after_s)
            return
        await self.app(scope, receive, send)


def authorization(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


async def send_error(send: Any, exc: FunctionError, retry_after_s: int) -> None:
    body = error_body(exc)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in headers_of(exc, retry_after_s).items()]
    await send({"type": "http.response.start", "status": status_of(exc), "headers": raw})
    await send({"type": "http.response.body", "body": body})
