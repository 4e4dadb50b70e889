"""What HTTP/1.1 alone costs the gateway per invocation request: one keep-alive connection's server
side fed the bench's tiny V2 JSON requests (as `python -m bench` sends them) and answering each
with a small JSON body, in one thread with no network and no work between request and answer. Two
engines:

- `uvicorn`: the protocol the gateway serves invocations with (gateway.http.uvicorn_link: uvicorn's
  httptools protocol with the head limits and the connection's timers), its request cycle, and the
  answer written as UvicornLink writes it (its head, uvicorn's date header, one write);
- `httptools`: httptools' parser with callbacks that keep the URL, the headers and the body, and
  the answer written with a head built the same way: the floor a protocol of the gateway's own
  would start from, before the limits and timers it would have to keep.

The difference is at most what such a protocol could take off each request (docs/benchmarks/
triton/targets.md).

    .venv/bin/python -m bench.http1_cost [--requests N] [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

import httptools
import uvloop

from bench.__main__ import requests_for
from fngate.config import GatewaySettings
from gateway.http.uvicorn_link import UvicornLink, head_timeout_protocol

ANSWER = b'{"model_name":"tiny","outputs":[{"name":"output","datatype":"FP32","shape":[1,16],"data":[0.0]}]}'
CONTENT_TYPE = b"application/json"
DATE = b"Mon, 07 Dec 2026 00:00:00 GMT"
"""The date header uvicorn's server loop keeps in its state (the gateway sends no server header)."""


def requests(count: int) -> list[bytes]:
    """`count` of the bench's tiny V2 JSON requests, as its load generator writes them."""
    outgoing, _ = requests_for("tiny", 16, count, False, seed=5)
    return [request.encode("127.0.0.1:8000") for request in outgoing]


class Transport(asyncio.Transport):
    """A connection that takes what is written and counts it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += len(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def uvicorn_engine(loop: asyncio.AbstractEventLoop) -> tuple[Callable[[bytes], None], Transport]:
    import uvicorn

    base = head_timeout_protocol(GatewaySettings(), lean=True)

    class Answering(base):  # type: ignore[misc, valid-type]
        """The gateway's protocol, answering each request as the exchange's link does, at once."""

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            cycle.lean = _Answer(UvicornLink(self, cycle))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError(scope)  # never called: every request is answered above

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    config.load()
    state = uvicorn.Server(config).server_state
    state.default_headers = [(b"date", DATE)]
    protocol = Answering(config=config, server_state=state, app_state={}, _loop=loop)
    transport = Transport()
    protocol.connection_made(transport)
    return protocol.data_received, transport


class _Answer:
    """What gateway.http.lean.Exchange does with a request once its body is complete, less the
    invocation: the body taken, the answer sent through the link."""

    streaming = False

    def __init__(self, link: UvicornLink) -> None:
        self.link = link

    def body_grew(self) -> None:
        pass

    def body_complete(self) -> None:
        self.link.take_body()
        self.link.send(200, [(b"content-type", CONTENT_TYPE)], ANSWER, False)
        self.link.release()

    def caller_left(self) -> None:
        pass


def httptools_engine() -> tuple[Callable[[bytes], None], Transport]:
    transport = Transport()

    class Request:
        def __init__(self) -> None:
            self.url = b""
            self.headers: list[tuple[bytes, bytes]] = []
            self.body = bytearray()
            self.parser = httptools.HttpRequestParser(self)

        def on_message_begin(self) -> None:
            self.url, self.headers, self.body = b"", [], bytearray()

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers.append((name.lower(), value))

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            head = b"HTTP/1.1 200 OK\r\ndate: %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
            transport.write(head % (DATE, CONTENT_TYPE, len(ANSWER)) + ANSWER)

    request = Request()
    return request.parser.feed_data, transport


def measure(feed: Callable[[bytes], None], fed: list[bytes], loop: asyncio.AbstractEventLoop | None) -> float:
    """Microseconds of CPU per request."""
    started = time.process_time()
    for at, request in enumerate(fed):
        feed(request)
        if loop is not None and at % 512 == 0:  # the cancelled timers leave the loop's heap
            loop.run_until_complete(asyncio.sleep(0))
    return (time.process_time() - started) / len(fed) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.http1_cost", description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    fed = requests(args.requests)
    loop = uvloop.new_event_loop()  # the gateway's (its timers are uvloop's)
    try:
        for round_ in range(1, args.rounds + 1):
            feed, transport = uvicorn_engine(loop)
            on_uvicorn = measure(feed, fed, loop)
            written = transport.written
            assert written > len(fed) * len(ANSWER) and not transport.closed
            feed, transport = httptools_engine()
            on_httptools = measure(feed, fed, None)
            assert transport.written == written  # the same answers, byte for byte
            print(
                f"round {round_}: uvicorn's protocol {on_uvicorn:6.1f} µs a request, "
                f"httptools alone {on_httptools:5.1f} µs ({len(fed):,} requests each)"
            )
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
