"""AuthMiddleware: a plain ASGI middleware that checks the key and scope of every HTTP request but
health, and the key's limits for invocations, before the app sees the request."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import orjson

from fngate.errors import Unavailable
from gateway.auth import INVOKE, AuthError, KeyTable, required_scope
from gateway.limits import Limiter

PRINCIPAL = "fngate.principal"
"""Scope keys: the caller, its invocation's admission (when its key has limits), and whether the
enqueue admitted it (then it holds a place until released)."""
ADMISSION = "fngate.admission"
ADMITTED = "fngate.admitted"
RELEASE = "fngate.release"
"""Scope key: what takes an admitted invocation out of its key's limits; the invocation route calls
it before it answers, so that a client that has its answer finds its place free."""


class AuthMiddleware:
    """Refusals are answered here (401, 403, 429); an admitted invocation leaves the key's
    in-flight sets when answered. The caller's Principal goes into the scope as `fngate.principal`."""

    def __init__(self, app: Any, table: KeyTable, limiter: Limiter | None = None) -> None:
        self.app = app
        self.table = table
        self.limiter = limiter

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        need = required_scope(scope["method"], scope["path"])
        if need is None:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        admit = None
        function = need[1] or ""
        try:
            principal = self.table.authorize(header, *need)
            if need[0] == INVOKE and principal.limited and self.limiter is not None:
                # Checked by the enqueue script, in the invocation's own round trip (gateway.invoke).
                admit = self.limiter.admission(principal, function)
                scope[ADMISSION] = admit
                scope[RELEASE] = functools.partial(self.limiter.release, principal, function, admit)
        except AuthError as exc:
            await send_error(send, exc.status, exc.body(), exc.headers)
            return
        except Unavailable as exc:
            body = orjson.dumps({"error": exc.message, "code": exc.code.value})
            await send_error(send, 503, body, {"Retry-After": "1"})
            return
        scope[PRINCIPAL] = principal
        if admit is None:
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:  # the invocation route released it before answering, unless it failed first
            if scope.get(ADMITTED) and self.limiter is not None:
                await asyncio.shield(self.limiter.release(principal, function, admit))


async def send_error(send: Any, status: int, body: bytes, headers: dict[str, str]) -> None:
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
