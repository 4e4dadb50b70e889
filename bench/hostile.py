"""Scenario H, hostile callers: what a request that tries to make a gateway process work or hold
memory costs it, as time to the answer and the process's peak memory (VmHWM from /proc, reset
before each probe). On uvicorn and on Hypercorn, one gateway process each, no runner (nothing
here should reach one). `python -m bench --only H`, or alone: `python -m bench.hostile`.

Probes: a 65 KB gzip of a V2 body with 32 M one-digit numbers for a [1, 16] input, alone and 16 at
once; the same body uncompressed (64 MiB); an asynchronous invocation whose callback names a
loopback address; a 1 MiB .tar.gz of zeros deployed; a 1 MiB header; 10,000 headers; 3,000
connections holding half-sent requests. Over gRPC (one gateway process): a message claiming a GiB,
a gzip of 64 MiB of zeros, a 60 MiB message that is not protobuf, 400 streams opened and reset,
400 PINGs, 1,000 streams held without a message."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import io
import os
import struct
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h2.errors

from bench.deployment import Deployment, deployment, free_port
from bench.h2_client import INFER, RawClient, message
from bench.models import build_repository

Row = dict[str, Any]
MiB = 2**20
NUMBERS = 32_000_000
"""As the issue's probe: 64 MB of text, under the 64 MiB body limit once decompressed."""
HALF_SENT = 3000
GRPC_FLOOD = 400
"""Frames of a flood: past what a gateway takes in a second (200 resets, 100 PINGs)."""
GRPC_HELD = 1000


def proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> int:
    """Reset the process's peak RSS to its RSS now (clear_refs 5); the RSS in KiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return proc_kib(pid, "VmRSS")


def probe_body(count: int) -> bytes:
    head = b'{"inputs":[{"name":"input","datatype":"FP32","shape":[1,16],"data":['
    return head + b"1," * (count - 1) + b"1]}]}"


def zeros_archive() -> bytes:
    """A .tar.gz of about 1 MB: one file of 1 GiB of zeros."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=9) as zipped:
        info = tarfile.TarInfo("function.yaml")
        info.size = 1024**3
        zipped.write(info.tobuf(format=tarfile.GNU_FORMAT))
        block = bytes(MiB)
        for _ in range(1024):
            zipped.write(block)
        zipped.write(bytes(1024))  # the end of the archive
    return buffer.getvalue()


async def exchange(
    port: int, head: bytes, body: bytes = b"", timeout_s: float = 60
) -> tuple[int | None, float]:
    """Send a request (its body while reading: a server may answer before it is all sent); the
    status of the answer (None: no answer, the connection closed) and the seconds it took."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(head)
            view = memoryview(body)
            for start in range(0, len(body), MiB):
                writer.write(view[start : start + MiB])
                await writer.drain()

    sending = asyncio.create_task(send())
    try:
        async with asyncio.timeout(timeout_s):
            line = await reader.readline()
    except (TimeoutError, ConnectionError):
        line = b""
    finally:
        took = time.perf_counter() - started
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sending
        writer.close()
    status = int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else None
    return status, took


def request_head(method: str, path: str, length: int, *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1", f"content-length: {length}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def half_sent(port: int, count: int) -> tuple[int, int]:
    """`count` connections that each send half a request head and wait: how many the server
    refused at once (503), and how many it kept open."""
    connections = []
    refused = 0
    for _ in range(count):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v2/models/tiny/infer HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        except OSError:
            refused += 1
            continue
        connections.append((reader, writer))
    await asyncio.sleep(0.5)
    kept = 0
    for reader, writer in connections:
        try:
            answered = await asyncio.wait_for(reader.read(64), 0.001)
        except TimeoutError:
            answered = None
        except ConnectionError:
            answered = b"reset"
        if answered or reader.at_eof():
            refused += 1
        else:
            kept += 1
        writer.close()
    return refused, kept


async def probes(base: str, pid: int, server: str, record: Callable[[Row], None], at_once: int) -> None:
    port = int(base.rsplit(":", 1)[1])
    compressed = gzip.compress(probe_body(NUMBERS), compresslevel=9)
    plain = probe_body((64 * MiB - 200) // 2)
    archive = zeros_archive()
    small = b'{"inputs": {"input": [[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]]}}'
    infer = "/v2/models/tiny/infer"
    gz = request_head("POST", infer, len(compressed), "content-encoding: gzip")
    hook = ("prefer: respond-async", "x-callback-url: http://127.0.0.1:9/hook")
    deploy = request_head("PUT", "/v1/functions/bomb", len(archive), "content-type: application/gzip")
    many = (f"x-{i}: {i}" for i in range(10_000))
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("gzip 32M numbers", lambda: exchange(port, gz, compressed)),
        (
            f"gzip 32M numbers x{at_once}",
            lambda: asyncio.gather(*(exchange(port, gz, compressed) for _ in range(at_once))),
        ),
        ("plain 64 MiB JSON", lambda: exchange(port, request_head("POST", infer, len(plain)), plain)),
        (
            "callback to loopback",
            lambda: exchange(port, request_head("POST", "/v1/functions/tiny", len(small), *hook), small),
        ),
        ("1 MB tar.gz of zeros", lambda: exchange(port, deploy, archive)),
        (
            "1 MiB header",
            lambda: exchange(port, request_head("GET", "/v2/health/live", 0, "x-big: " + "a" * MiB)),
        ),
        ("10,000 headers", lambda: exchange(port, request_head("GET", "/v2/health/live", 0, *many))),
    ]
    for name, run in cases:
        before_kib = reset_peak(pid)
        started = time.perf_counter()
        outcome = await run()
        took = time.perf_counter() - started
        statuses = [status for status, _ in outcome] if isinstance(outcome, list) else [outcome[0]]
        await asyncio.sleep(0.2)  # what the process frees after answering
        row = {
            "scenario": "H",
            "server": server,
            "probe": name,
            "status": "/".join(str(status) for status in sorted(set(statuses), key=str)),
            "time_s": round(took, 3),
            "peak_mib": round((proc_kib(pid, "VmHWM") - before_kib) / 1024, 1),
            "worker_peak_mib": round(proc_kib(pid, "VmHWM") / 1024, 1),
        }
        record(row)
    before_kib = reset_peak(pid)
    started = time.perf_counter()
    refused, kept = await half_sent(port, HALF_SENT)
    record(
        {
            "scenario": "H",
            "server": server,
            "probe": f"{HALF_SENT} half-sent requests",
            "status": f"{refused} refused, {kept} held",
            "time_s": round(time.perf_counter() - started, 3),
            "peak_mib": round((proc_kib(pid, "VmHWM") - before_kib) / 1024, 1),
            "worker_peak_mib": round(proc_kib(pid, "VmHWM") / 1024, 1),
        }
    )


async def grpc_probes(port: int, pid: int, record: Callable[[Row], None]) -> None:
    """What grpc's clients never send, to the gateway's gRPC port: each probe's outcome (the
    RPC's grpc-status, or the connection's end), time and the process's peak memory."""
    bomb = gzip.compress(b"\0" * 64 * MiB, compresslevel=9)

    async def one_rpc(head: list[tuple[bytes, bytes]], body: bytes) -> str:
        client = await RawClient.connect(port)
        stream_id = client.open(INFER, head)
        await client.send_all(stream_id, body, end=True)
        found = await client.status_of(stream_id, timeout_s=30)
        client.close()
        return "grpc-status " + found.get(b"grpc-status", b"-").decode()

    async def flood(what: str) -> str:
        client = await RawClient.connect(port)
        for index in range(GRPC_FLOOD):
            if what == "reset":
                client.h2.reset_stream(client.open(send=False), h2.errors.ErrorCodes.CANCEL)
            else:
                client.h2.ping(b"%08d" % index)
        client.flush()
        await client.ended(timeout_s=30)
        client.close()
        if client.goaway is None:
            return "closed (before its GOAWAY was read)"
        return f"GOAWAY {getattr(client.goaway.error_code, 'name', client.goaway.error_code)}"

    async def held_streams() -> str:
        client = await RawClient.connect(port)
        for _ in range(GRPC_HELD):
            client.open(send=False)  # a head, and no message: held until the body timeout
        client.flush()
        await asyncio.sleep(1.0)
        client.close()
        return f"{GRPC_HELD} held"

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("gRPC message claiming 1 GiB", lambda: one_rpc([], struct.pack(">BI", 0, 2**30) + b"\0" * 1024)),
        ("gRPC gzip of 64 MiB of zeros", lambda: one_rpc([(b"grpc-encoding", b"gzip")], message(bomb, True))),
        ("gRPC 60 MiB message of garbage", lambda: one_rpc([], message(b"\xff" * 60 * MiB))),
        (f"gRPC {GRPC_FLOOD} streams opened and reset", lambda: flood("reset")),
        (f"gRPC {GRPC_FLOOD} PINGs", lambda: flood("ping")),
        (f"gRPC {GRPC_HELD} streams without a message", held_streams),
    ]
    for name, run in cases:
        before_kib = reset_peak(pid)
        started = time.perf_counter()
        outcome = await run()
        took = time.perf_counter() - started
        await asyncio.sleep(0.2)
        record(
            {
                "scenario": "H",
                "server": "grpc",
                "probe": name,
                "status": outcome,
                "time_s": round(took, 3),
                "peak_mib": round((proc_kib(pid, "VmHWM") - before_kib) / 1024, 1),
                "worker_peak_mib": round(proc_kib(pid, "VmHWM") / 1024, 1),
            }
        )


def run(deployed: Deployment, record: Callable[[Row], None], at_once: int = 16) -> None:
    """The probes against one single-process gateway on each server (no runner needed); the gRPC
    probes against the first one's gRPC port."""
    for server in ("uvicorn", "hypercorn"):
        grpc_port = free_port()
        base = deployed.start_gateway(
            workers=1, FNGATE_SERVER=server, FNGATE_CALLBACK_SECRET="bench", FNGATE_GRPC_PORT=str(grpc_port)
        )
        process = deployed.gateways[-1][0]
        asyncio.run(probes(base, process.pid, server, record, at_once))
        if server == "uvicorn":
            asyncio.run(grpc_probes(grpc_port, process.pid, record))


def show(row: Row) -> None:
    print("  " + " ".join(f"{key}={value}" for key, value in row.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__)
    parser.add_argument(
        "--at-once",
        type=int,
        default=16,
        help="how many gzip probes go at once (16; fewer against a gateway that holds each whole)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fngate-hostile-") as folder:
        repo = Path(folder) / "repo"
        build_repository(repo)
        with deployment(repo, Path(folder) / "logs") as deployed:
            run(deployed, show, args.at_once)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
