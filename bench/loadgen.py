"""A closed-loop HTTP/1.1 load generator on raw asyncio protocols: N keep-alive connections, each
sending its next request as soon as the previous answer arrives. Outgoing bodies are encoded before
the run, so the generator spends its CPU on sockets only."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class Outgoing:
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    def encode(self, host: str) -> bytes:
        lines = [f"POST {self.path} HTTP/1.1", f"host: {host}", f"content-length: {len(self.body)}"]
        lines += [f"{name}: {value}" for name, value in self.headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + self.body


@dataclasses.dataclass(slots=True)
class Result:
    concurrency: int
    duration_s: float
    latencies_ns: np.ndarray
    errors: int
    error_sample: str
    checked: int

    @property
    def completed(self) -> int:
        return len(self.latencies_ns)

    @property
    def throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s else 0.0

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_ns, q) / 1e6) if self.completed else float("nan")


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._need = -1
        self._status = 0
        self._header_end = 0
        self.closing = False
        """The server said `connection: close`: open a new connection before the next request."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError(f"connection closed: {exc}"))

    def send(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._buffer.clear()
        self._need = -1
        self.transport.write(data)
        return self._waiter

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._need < 0:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
            self._status = int(head[0].split(" ", 2)[1])
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and value.strip().lower() == "close":
                    self.closing = True
            self._header_end = end + 4
            self._need = self._header_end + length
        if len(self._buffer) >= self._need and self._waiter is not None:
            body = bytes(self._buffer[self._header_end : self._need])
            self._waiter.set_result((self._status, body))


async def run(
    host: str,
    port: int,
    requests: Sequence[Outgoing],
    concurrency: int,
    warmup_s: float,
    measure_s: float,
    check: Callable[[int, int, bytes], str | None] | None = None,
    check_every: int = 50,
    max_requests: int = 200_000,
) -> Result:
    """Drive the server; latencies count only requests started inside the measurement window.
    `check(index, status, body)` returns an error text or None, for one response in `check_every`."""
    loop = asyncio.get_running_loop()
    encoded = [request.encode(f"{host}:{port}") for request in requests]
    connections = []
    for _ in range(concurrency):
        _transport, protocol = await loop.create_connection(_Connection, host, port)
        connections.append(protocol)
    latencies: list[int] = []
    counter = iter(range(max_requests))
    errors = 0
    error_sample = ""
    checked = 0
    start = time.perf_counter()
    measure_from = start + warmup_s
    measure_until = measure_from + measure_s

    async def client(connection: _Connection) -> None:
        nonlocal errors, error_sample, checked
        for index in counter:
            if connection.closing:  # as any HTTP client would: the server asked to end this one
                _transport, connection = await loop.create_connection(_Connection, host, port)
                connections.append(connection)
            now = time.perf_counter()
            if now >= measure_until:
                return
            sent = time.perf_counter_ns()
            try:
                status, body = await connection.send(encoded[index % len(encoded)])
            except ConnectionError as exc:
                errors += 1
                error_sample = error_sample or str(exc)
                return
            elapsed = time.perf_counter_ns() - sent
            problem = None
            if status != 200:
                problem = f"HTTP {status}: {body[:200]!r}"
            elif check is not None and index % check_every == 0:
                checked += 1
                problem = check(index % len(encoded), status, body)
            if problem is not None:
                errors += 1
                error_sample = error_sample or problem
            elif now >= measure_from:
                latencies.append(elapsed)

    await asyncio.gather(*(client(connection) for connection in connections))
    for connection in connections:
        if connection.transport is not None:
            connection.transport.close()
    duration = min(time.perf_counter(), measure_until) - measure_from
    return Result(concurrency, duration, np.asarray(latencies, dtype=np.int64), errors, error_sample, checked)
