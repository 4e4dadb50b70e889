"""An answered invocation leaves nothing for the cyclic garbage collector: every object of its
request (the connection's request cycle, the lean path's exchange, the call) is freed by reference
counting as soon as it is answered. Left in reference cycles, each request's objects would wait for
the collector, which would then run many times as often over the same keep-alive traffic and stop
the event loop for milliseconds each time (python -m bench's open-loop tail)."""

from __future__ import annotations

import asyncio
import collections
import gc
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

from bench.h2_client import hang_up

BODY = orjson.dumps({"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]})
OURS = ("gateway", "fngate", "runner", "uvicorn", "hypercorn")


@pytest.fixture
def saving_garbage() -> Iterator[None]:
    """While the test runs: what the collector finds unreachable is kept in gc.garbage, not freed."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def invoke(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: int) -> None:
    """`count` invocations, one after the other, on one keep-alive connection."""
    head = b"POST /v2/models/classifier/infer HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
    request = head + b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY)
    for _ in range(count):
        writer.write(request)
        answer = await reader.readuntil(b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200"), answer
        lines = answer.split(b"\r\n")
        length = next(
            int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)


def of_ours(garbage: list[Any]) -> dict[str, int]:
    kinds = collections.Counter(f"{type(item).__module__}.{type(item).__qualname__}" for item in garbage)
    return {kind: count for kind, count in kinds.items() if kind.startswith(OURS)}


async def test_an_answered_invocation_leaves_no_cycles(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], saving_garbage: None
) -> None:
    base = await serve_gateway()
    await inprocess_runner()
    reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
    try:
        await invoke(reader, writer, 20)  # the function loaded, every lazy import done
        gc.collect()
        gc.garbage.clear()
        await invoke(reader, writer, 50)
        gc.collect()
        assert of_ours(gc.garbage) == {}  # the connection, still open, is not garbage yet
    finally:
        await hang_up(writer)
