"""`python -m bench.redis_clients`: client CPU per Redis call from asyncio, for the gateway's choice
of client. The same script call (EVALSHA of a tiny script with 5 keys and 6 arguments, the shape of
fngate's enqueue), made one at a time and 16 at a time (pipelined where the client can), against a
private redis-server. Prints microseconds of this process's CPU per call.

Clients: redis-py (with hiredis), redis-py pipelined, and a minimal asyncio protocol around
hiredis's Reader (a floor: what parsing with hiredis costs without a client library's layers);
coredis when it is installed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import hiredis
import redis.asyncio as aioredis

from fngate.process import run_forever
from fngate.up.supervisor import private_redis

SCRIPT = "return {'queued'}"
KEYS = ["fngate:q:tiny", "fngate:q:tiny:bytes", "", "", ""]
ARGS: list[bytes | str | int] = [
    1000,
    0,
    b"x" * 200,
    b"y" * 64,
    "fngate:r:abc 0123456789abcdef 1764000000000",
    5000,
]
CALLS = 4000


def encode(*parts: Any) -> bytes:
    """A command in RESP: what every client sends."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out += [b"$%d\r\n" % len(data), data, b"\r\n"]
    return b"".join(out)


class HiredisProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = hiredis.Reader()
        self._waiting: list[asyncio.Future[Any]] = []
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            self._waiting.pop(0).set_result(reply)

    def call(self, *commands: bytes) -> list[asyncio.Future[Any]]:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        self._waiting += futures
        self.transport.write(b"".join(commands))
        return futures


async def measure(name: str, one: Callable[[], Awaitable[Any]], many: Callable[[], Awaitable[Any]]) -> None:
    for label, call, per in (("1 at a time", one, 1), ("16 pipelined", many, 16)):
        await call()
        started = time.process_time()
        for _ in range(CALLS // per):
            await call()
        used = time.process_time() - started
        print(f"{name:28s} {label:14s} {used / CALLS * 1e6:7.1f} µs CPU per call", flush=True)


async def main() -> None:
    with private_redis() as url:
        client = aioredis.from_url(url)
        sha = await client.script_load(SCRIPT)

        async def pyredis_one() -> Any:
            return await client.evalsha(sha, len(KEYS), *KEYS, *ARGS)

        async def pyredis_many() -> Any:
            async with client.pipeline(transaction=False) as pipe:
                for _ in range(16):
                    pipe.evalsha(sha, len(KEYS), *KEYS, *ARGS)
                return await pipe.execute()

        await measure("redis-py (hiredis parser)", pyredis_one, pyredis_many)
        await client.aclose()

        path = url.removeprefix("unix://").split("?")[0]
        loop = asyncio.get_running_loop()
        if url.startswith("unix://"):
            _transport, protocol = await loop.create_unix_connection(HiredisProtocol, path)
        else:
            host, port = url.removeprefix("redis://").split("/")[0].split(":")
            _transport, protocol = await loop.create_connection(HiredisProtocol, host, int(port))
        command = encode(b"EVALSHA", sha, len(KEYS), *KEYS, *ARGS)

        async def hiredis_one() -> Any:
            return await protocol.call(command)[0]

        async def hiredis_many() -> Any:
            return await asyncio.gather(*protocol.call(*[command] * 16))

        await measure("hiredis Reader + protocol", hiredis_one, hiredis_many)
        try:
            import coredis  # type: ignore[import-not-found, unused-ignore]
        except ImportError:
            print("coredis: not installed (pip install coredis to compare)")
        else:
            core = coredis.Redis.from_url(url)

            async def coredis_one() -> Any:
                return await core.evalsha(sha, KEYS, ARGS)

            async def coredis_many() -> Any:
                return await asyncio.gather(*(core.evalsha(sha, KEYS, ARGS) for _ in range(16)))

            await measure("coredis", coredis_one, coredis_many)


if __name__ == "__main__":
    run_forever(main())
