"""fngate.clients against Redis that dies under its connections: a node that accepts a connection
and resets it at once (what a killed node or a failover does to a client connecting at that
moment) is a lost connection, on uvloop (the processes' loop) as on asyncio's own."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

from fngate import clients

TRIES = 30
"""Rounds against the resetting node per test. On uvloop about one connection in nine met the
closed transport (uvloop's RuntimeError) before fngate.clients said it as a lost connection."""

LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {
    "uvloop": uvloop.run,
    "asyncio": asyncio.run,
}


@contextlib.contextmanager
def resetting_node() -> Iterator[int]:
    """A port on loopback that accepts each connection and resets it (RST) at once."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                accepted, _ = listener.accept()
            except OSError:
                return
            accepted.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            accepted.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
        thread.join(timeout=5)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_reset_at_once_is_a_lost_connection(loop: str) -> None:
    async def scenario(port: int) -> None:
        for _ in range(TRIES):
            client = clients.connect(f"redis://127.0.0.1:{port}", protocol=3)
            with pytest.raises(RedisConnectionError):  # not uvloop's RuntimeError
                await client.set("key", "value")
            pubsub = client.pubsub()
            with pytest.raises(RedisConnectionError):
                await clients.subscribe(pubsub, "channel")
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await client.aclose()
            pool = clients.connect_pool(f"redis://127.0.0.1:{port}", 2, 1.0)
            with pytest.raises(RedisConnectionError):
                await pool.get("key")
            await pool.aclose()

    with resetting_node() as port:
        LOOPS[loop](scenario(port))


async def named_connections(admin: Any, name: str) -> int:
    listed = await admin.client_list()
    return sum(1 for client in listed if client["name"] == name)


@pytest.mark.parametrize("kind", ["connect", "connect_pool"])
async def test_a_closed_client_holds_no_connection_and_opens_none(redis_url: str, kind: str) -> None:
    """Closed while a command is on its way (not started yet, connecting, waiting for its answer),
    a client ends with no connection open on Redis, and a command sent after it refuses as a lost
    connection does: one left open would be freed only by the garbage collector, after its event
    loop (a stopped gateway's, a stopped runner's) is gone."""
    admin = clients.connect(redis_url)
    try:
        for turns in range(6):  # the command's progress when the client closes
            name = f"closing-{kind}-{turns}"
            if kind == "connect":
                client = clients.connect(redis_url, client_name=name)
            else:
                client = clients.connect_pool(redis_url, 4, 1.0, client_name=name)
            under_way = [asyncio.create_task(client.ping()) for _ in range(3)]
            for _ in range(turns):
                await asyncio.sleep(0)
            await client.aclose()
            await asyncio.gather(*under_way, return_exceptions=True)
            with pytest.raises(RedisConnectionError, match="closed"):
                await client.ping()
            for _ in range(250):  # Redis lists a closed connection until it has read its end
                if await named_connections(admin, name) == 0:
                    break
                await asyncio.sleep(0.02)
            assert await named_connections(admin, name) == 0, f"closed after {turns} turns"
    finally:
        await admin.aclose()
