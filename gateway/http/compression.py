"""Compressed responses: an ASGI layer that hands a request to Starlette's gzip responder only when
its Accept-Encoding names gzip, so that every other request (the invocation traffic of most
clients) pays one header scan and nothing more. Compressed requests are undone by
gateway.decompression, which the gRPC front end shares."""

from __future__ import annotations

from starlette.middleware.gzip import GZipResponder
from starlette.types import ASGIApp, Receive, Scope, Send

GZIP_MIN_BYTES = 64 * 1024
"""An answer this large or larger is compressed for a client whose Accept-Encoding names gzip (on
the lean invoke path and through the ASGI app alike)."""


class GzipLargeResponses:
    def __init__(self, app: ASGIApp, minimum_bytes: int) -> None:
        self.app = app
        self.minimum_bytes = minimum_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and accepts_gzip(scope["headers"]):
            await GZipResponder(self.app, self.minimum_bytes, 5)(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def accepts_gzip(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"accept-encoding":
            return b"gzip" in value.lower()
    return False
