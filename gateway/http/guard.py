"""The key check of every HTTP route but the invocation routes (gateway.http.invoke checks theirs):
each route of the router says the scope it needs (`Guarded`), and the check runs once the router
has matched it, so that no route is served without one. Paths that no route serves, and methods a
route does not take, answer 404 and 405 only to a caller with a valid key
(gateway.http.errors.handle_unknown_route)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from fngate.errors import FunctionError
from gateway.auth import OPEN, Principal
from gateway.http.errors import error_body, headers_of, status_of

PRINCIPAL = "fngate.principal"
"""Scope key: the caller's Principal, for the routes that need to know who calls."""
OPEN_ROUTE = None
"""The scope of a route any caller may use, without a key (health)."""


ErrorBody = Callable[[FunctionError], bytes]
"""How a route's errors are written: fngate's `{"error", "code"}`, or a foreign API's own shape."""


class Guarded(Route):
    """A Starlette route with the scope its callers' keys need (None: open): of the function named
    by its `{name}` for the scopes that go by function (invoke, read), else the scope alone. A
    refusal's body is `error_body`'s."""

    def __init__(
        self,
        path: str,
        endpoint: Callable[..., Any],
        need: str | None,
        methods: list[str] | None = None,
        error_body: ErrorBody = error_body,
    ) -> None:
        super().__init__(path, endpoint, methods=methods)
        self.need = need
        self.error_body = error_body

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.need is not None and not (self.methods and scope["method"] not in self.methods):
            services = scope["state"]["services"]
            function = scope.get("path_params", {}).get("name")
            try:
                scope[PRINCIPAL] = await services.keys.authorize_async(
                    authorization(scope["headers"]), self.need, function
                )
            except FunctionError as exc:
                await send_error(send, exc, services.settings.retry_after_s, self.error_body)
                return
        await super().handle(scope, receive, send)


def principal_of(scope: Scope) -> Principal:
    found: Principal = scope.get(PRINCIPAL, OPEN)
    return found


def authorization(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


async def send_error(
    send: Any, exc: FunctionError, retry_after_s: int, render: ErrorBody = error_body
) -> None:
    body = render(exc)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in headers_of(exc, retry_after_s).items()]
    await send({"type": "http.response.start", "status": status_of(exc), "headers": raw})
    await send({"type": "http.response.body", "body": body})
