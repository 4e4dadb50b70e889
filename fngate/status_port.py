"""A small HTTP port for what a scraper or a probe GETs (a runner's /metrics and /healthz, a
gateway's metrics port): a stdlib asyncio server, one request per connection, a bounded request
head. A few GET routes need no web framework."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024
HEAD_TIMEOUT_S = 5.0

Route = Callable[[str], Awaitable[tuple[str, str, bytes]]]
"""A GET's path (without its query) -> (status line, content type, body)."""


async def start(route: Route, host: str, port: int, sock: socket.socket | None = None) -> asyncio.Server:
    """Listen on `sock` if given, else on host:port (raises OSError when that is taken)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=HEAD_TIMEOUT_S)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(request_line) < 2 or request_line[0] != "GET":
                status, content_type, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            else:
                status, content_type, body = await route(request_line[1].split("?", 1)[0])
            writer.write(
                f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    if sock is not None:
        return await asyncio.start_server(handle, sock=sock, limit=MAX_HEADER_BYTES)
    return await asyncio.start_server(handle, host, port, limit=MAX_HEADER_BYTES)


NOT_FOUND = ("404 Not Found", "text/plain", b"not found\n")


def bind(host: str, port: int, what: str) -> socket.socket | None:
    """A listening socket that child processes inherit (a supervisor's, for its workers); None
    for port 0 (no such port) or one that is taken (logged: the process goes on without it)."""
    if not port:
        return None
    try:
        sock = socket.create_server((host, port), backlog=128)
    except OSError as exc:
        log.warning("%s port %s:%d unavailable (%s); going on without it", what, host, port, exc)
        return None
    sock.set_inheritable(True)
    return sock
