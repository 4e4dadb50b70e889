"""Where a callback may go: an http(s) URL whose host is a public address, or a name whose every
address is public. Loopback, private, link-local (the cloud metadata range), shared, multicast,
reserved and unspecified addresses are refused, unless the operator allows them
(`callback_allow`: networks such as 10.1.0.0/16 or 127.0.0.1, and host names). A name is resolved
once per check, and a sender connects to the address it checked, so that a name cannot answer
the check with one address and the connection with another."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
import urllib.parse
from collections.abc import Sequence
from typing import Any

from fngate.errors import InvalidArgument

RESOLVE_TIMEOUT_S = 5.0
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclasses.dataclass(frozen=True, slots=True)
class Destination:
    """A callback URL, checked: what to connect to and what to ask for there."""

    scheme: str
    host: str
    """As the URL names it: the Host header, and the name TLS verifies."""
    port: int
    target: str
    """The path and query."""
    address: str
    """The address that was checked: connect to this one."""


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    scheme: str
    host: str
    port: int
    target: str


class CallbackPolicy:
    def __init__(self, allow: str = "") -> None:
        """`allow`: networks and host names, separated by commas or white space."""
        self.networks: list[Network] = []
        self.names: set[str] = set()
        for item in allow.replace(",", " ").split():
            try:
                self.networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                self.names.add(item.lower().rstrip("."))

    def allows(self, address: IPAddress) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if any(address in network for network in self.networks):
            return True
        return address.is_global and not address.is_multicast

    def check(self, target: Target, addresses: list[str]) -> Destination:
        """The destination, connecting to the first address; refused unless every address of the
        host is one it may reach (a host on the allow-list may reach any)."""
        if not addresses:
            raise InvalidArgument("X-Callback-Url names a host that does not resolve")
        if target.host.lower().rstrip(".") not in self.names:
            for raw in addresses:
                if not self.allows(ipaddress.ip_address(raw.split("%")[0])):
                    raise InvalidArgument(
                        "X-Callback-Url names an internal address (loopback, private, link-local, "
                        "multicast or unspecified); the operator can allow it with --callback-allow"
                    )
        return Destination(target.scheme, target.host, target.port, target.target, addresses[0])

    def resolve(self, url: str) -> Destination:
        """`check` of the URL's host, resolved now. Blocks (name resolution): run it in a thread."""
        target = parse(url)
        return self.check(
            target, _addresses(socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM))
        )

    async def resolve_async(self, url: str) -> Destination:
        target = parse(url)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        except (TimeoutError, OSError):
            raise InvalidArgument("X-Callback-Url names a host that does not resolve") from None
        return self.check(target, _addresses(infos))


def parse(url: str) -> Target:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidArgument("X-Callback-Url is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument("X-Callback-Url must be an http(s) URL with a host")
    if parts.username is not None or parts.password is not None:
        raise InvalidArgument("X-Callback-Url must not carry credentials")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return Target(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), target)


def _addresses(infos: Sequence[tuple[Any, ...]]) -> list[str]:
    found: list[str] = []
    for info in infos:
        address = str(info[4][0])
        if address not in found:
            found.append(address)
    return found
