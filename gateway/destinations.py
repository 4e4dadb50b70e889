"""Where a callback may go: an http(s) URL whose host is a public address, or a name whose every
address is public. Loopback, private, link-local (the cloud metadata range), shared, multicast,
reserved and unspecified addresses are refused, unless the operator allows them
(`callback_allow`: networks such as 10.1.0.0/16 or 127.0.0.1, and host names). An IPv6 address
that embeds or translates an IPv4 one (IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo) is
judged by the IPv4 addresses it carries, as a plain IPv4 target is; the local-use NAT64 prefix
64:ff9b:1::/48, whose embedding its operator chooses, is refused whole. A name is resolved once
per check, and a sender connects to the address it checked, so that a name cannot answer the
check with one address and the connection with another."""

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
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
"""RFC 6052's well-known prefix: the IPv4 address in the last 32 bits."""
LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")
"""RFC 8215's local-use prefix: the IPv4 address wherever its operator's prefix length puts it."""
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
"""::a.b.c.d (deprecated, still routed to the IPv4 address by some stacks); :: and ::1 among them."""


class Unresolved(InvalidArgument):
    """The callback URL's host does not resolve (now)."""


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
        if any(address in network for network in self.networks):
            return True
        if isinstance(address, ipaddress.IPv6Address):
            if address in LOCAL_NAT64:
                return False
            carried = embedded_ipv4(address)
            if carried:
                return all(self.allows(inner) for inner in carried)
        return address.is_global and not address.is_multicast

    def check(self, target: Target, addresses: list[str]) -> Destination:
        """The destination, connecting to the first address; refused unless every address of the
        host is one it may reach (a host on the allow-list may reach any)."""
        if not addresses:
            raise Unresolved("X-Callback-Url names a host that does not resolve")
        if target.host.lower().rstrip(".") not in self.names:
            for raw in addresses:
                if not self.allows(ipaddress.ip_address(raw.split("%")[0])):
                    raise InvalidArgument(
                        "X-Callback-Url names an internal address (loopback, private, link-local, "
                        "multicast or unspecified); the operator can allow it with --callback-allow"
                    )
        return Destination(target.scheme, target.host, target.port, target.target, addresses[0])

    async def resolve_async(self, url: str) -> Destination:
        """`check` of the URL's host, resolved now (within RESOLVE_TIMEOUT_S)."""
        target = parse(url)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
        except (TimeoutError, OSError, ValueError):  # ValueError: a name IDNA cannot encode
            raise Unresolved("X-Callback-Url names a host that does not resolve") from None
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
    try:  # what name resolution would fail on later, refused now (`a..b`, a label over 63 bytes)
        parts.hostname.encode("idna")
    except UnicodeError:
        raise InvalidArgument("X-Callback-Url's host is not a valid host name") from None
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    if not target.isascii() or not target.isprintable() or " " in target:
        raise InvalidArgument("X-Callback-Url's path must be printable ASCII (percent-encode the rest)")
    return Target(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), target)


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address embeds or is translated to (a Teredo address: its
    server's and its client's); none for a plain IPv6 address."""
    if address.ipv4_mapped is not None:
        return [address.ipv4_mapped]
    if address.teredo is not None:
        return list(address.teredo)
    if address.sixtofour is not None:
        return [address.sixtofour]
    if address in NAT64 or address in IPV4_COMPATIBLE:
        return [ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)]
    return []


def _addresses(infos: Sequence[tuple[Any, ...]]) -> list[str]:
    found: list[str] = []
    for info in infos:
        address = str(info[4][0])
        if address not in found:
            found.append(address)
    return found
