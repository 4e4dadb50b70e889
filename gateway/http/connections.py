"""The limits both HTTP servers put on connections (gateway.http.server for Hypercorn,
gateway.http.uvicorn_link for uvicorn): the open connections of one client, and the whole answers
that refuse a connection or a request head before any request is read."""

from __future__ import annotations

import ipaddress
from http import HTTPStatus
from typing import Any

from fngate.config import GatewaySettings

SHUTDOWN_IDLE_GRACE_S = 1.0
"""How long an idle keep-alive connection stays open at shutdown for a request already on its way."""
LINGER_S = 2.0
"""How long a connection refused before its request was read drops what the client still sends."""


class ClientConnections:
    """The open connections of one server by client (an IPv4 address, or an IPv6 /64: what one
    host holds), and the most one client may hold (0: no limit of its own)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}

    def admit(self, peer: Any) -> str | None:
        """The client of a new connection (its peername), counted; None when it holds its limit
        (or has no address to count by: a unix socket's, counted as admitted with ''). Release
        what this returns when the connection ends."""
        client = client_of(peer)
        if not self.limit or not client:
            return ""
        held = self._open.get(client, 0)
        if held >= self.limit:
            return None
        self._open[client] = held + 1
        return client

    def release(self, client: str) -> None:
        if not client:
            return
        held = self._open.get(client, 0) - 1
        if held > 0:
            self._open[client] = held
        else:
            self._open.pop(client, None)


def client_of(peer: Any) -> str:
    """What a connection from `peer` (a socket's peername) counts against: its IPv4 address, or
    its IPv6 address's /64 (a host has a /64 of them); '' for none."""
    if not isinstance(peer, tuple) or not peer:
        return ""
    address = str(peer[0]).partition("%")[0]
    if ":" not in address:
        return address
    try:
        ipv6 = ipaddress.IPv6Address(address)
    except ValueError:
        return address
    if ipv6.ipv4_mapped is not None:  # a dual-stack socket's IPv4 client
        return str(ipv6.ipv4_mapped)
    return str(ipaddress.IPv6Network((ipv6, 64), strict=False))


def refusal(status: int, message: str, retry_after_s: int | None = None) -> bytes:
    """A whole response that ends its connection, for a refusal before any request is read whole."""
    body = b'{"error": "%s", "code": "%s"}' % (
        message.encode(),
        b"overloaded" if status == 503 else b"invalid_argument",
    )
    retry = b"retry-after: %d\r\n" % retry_after_s if retry_after_s is not None else b""
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % (
        status,
        HTTPStatus(status).phrase.encode(),
        len(body),
    )
    return head + retry + b"connection: close\r\n\r\n" + body


def too_many_connections(settings: GatewaySettings) -> bytes:
    """The refusal of a connection past max_connections (both servers)."""
    return refusal(503, "this gateway process has too many connections open", settings.retry_after_s)


def too_many_client_connections(settings: GatewaySettings) -> bytes:
    """The refusal of a connection past max_client_connections (both servers)."""
    return refusal(
        503,
        f"this gateway process has {settings.max_client_connections} connections open from your "
        "address (max_client_connections)",
        settings.retry_after_s,
    )
