"""The listening sockets of a gateway's workers (gateway.__main__.listening_sockets)."""

from __future__ import annotations

import contextlib
import socket

import pytest

from gateway.__main__ import listening_sockets


def test_each_worker_gets_a_share_of_the_connections() -> None:
    socks = listening_sockets("127.0.0.1", 0, 2)
    with contextlib.ExitStack() as held:
        for sock in socks:
            held.enter_context(sock)
            sock.setblocking(False)
        port = socks[0].getsockname()[1]
        assert socks[1].getsockname()[1] == port
        clients = [held.enter_context(socket.create_connection(("127.0.0.1", port))) for _ in range(64)]
        accepted = []
        for sock in socks:
            count = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    held.enter_context(sock.accept()[0])
                    count += 1
            accepted.append(count)
        # Spread by a hash of each connection's addresses: all 64 on one socket is a 2**-63 chance.
        assert sum(accepted) == len(clients) and min(accepted) > 0, accepted


def test_a_port_held_by_another_gateway_is_refused_not_shared() -> None:
    first = listening_sockets("127.0.0.1", 0, 2)
    try:
        with pytest.raises(OSError, match="in use"):
            listening_sockets("127.0.0.1", first[0].getsockname()[1], 2)
    finally:
        for sock in first:
            sock.close()
