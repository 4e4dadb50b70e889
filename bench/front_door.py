"""What callers without a key, and clients that hold on to what they can, cost one gateway process
at its gRPC port: a private redis-server and `python -m gateway` (auth on, max_connections 40), each
attack run while a canary calls ServerLive every 50 ms; for each, the gateway's peak RSS added and
CPU time (from /proc), the wall time and the canary's worst wait.

  python -m bench.front_door [--checkout DIR] [ATTACK...]

--checkout runs the gateway of another checkout of fngate (its root; the same virtual environment),
for a before-and-after comparison. Attacks: bomb (a 65 KB gzip ModelInfer of 64 MiB of empty
`inputs`, no key), window (250 answers parked on a zero window, then 100,000 connection
WINDOW_UPDATEs), table (SETTINGS_HEADER_TABLE_SIZE 2^32-1, then 4,000 calls answered with distinct
grpc-messages), idle (40 connections that send their preface and SETTINGS, then a new client),
reset (with a key: 10 rounds of 32 ModelInfer calls queued, no runner up, then each reset by its client; what
counts is how many of them stay queued for a runner to run). Loopback only; every attack is bounded
and ends by itself."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gzip
import os
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import h2.errors
import h2.exceptions
import h2.settings
import redis
from tritonclient.grpc import service_pb2

from bench.deployment import free_port
from bench.h2_client import INFER, LIVE, RawClient, live_request, message
from fngate import apikeys, keys

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


async def canary(port: int, stop: asyncio.Event, waits: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        try:
            client = await RawClient.connect(port)
            stream_id = client.open(LIVE)
            client.send(stream_id, live_request(), end=True)
            await client.status_of(stream_id, timeout_s=30)
            client.close()
        except (OSError, TimeoutError, h2.exceptions.ProtocolError):
            pass  # refused: its wait counts all the same
        waits.append(time.perf_counter() - started)
        await asyncio.sleep(0.05)


async def bomb(port: int, _redis_url: str) -> str:
    number = service_pb2.ModelInferRequest.DESCRIPTOR.fields_by_name["inputs"].number
    body = message(gzip.compress(bytes([number << 3 | 2, 0]) * (32 * MiB - 1024), 9), compressed=True)
    client = await RawClient.connect(port)
    stream_id = client.open(INFER, [(b"grpc-encoding", b"gzip")])
    client.send(stream_id, body, end=True)
    found = await client.status_of(stream_id, timeout_s=60)
    client.close()
    return f"{len(body)} bytes sent, grpc-status {found.get(b'grpc-status', b'-').decode()}"


async def window(port: int, _redis_url: str) -> str:
    client = await RawClient.connect(port)
    client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    client.flush()
    opened: list[int] = []
    for _ in range(5):
        for _ in range(50):
            stream_id = client.open(LIVE)
            client.send(stream_id, live_request(), end=True)
            opened.append(stream_id)
        await client.read(lambda: len(client.statuses) >= len(opened), timeout_s=30)
    update = struct.pack(">HBBBI", 0, 4, 8, 0, 0) + struct.pack(">I", 1)
    for _ in range(100):
        client.writer.write(update * 1000)
        await client.writer.drain()
    await asyncio.sleep(0.5)
    client.close()
    return "250 parked answers, then 100,000 connection WINDOW_UPDATEs (1.3 MB)"


def answered(client: RawClient, opened: list[int]) -> bool:
    return all(b"grpc-status" in client.statuses.get(each, {}) for each in opened)


async def table(port: int, _redis_url: str) -> str:
    client = await RawClient.connect(port)
    client.h2.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 2**32 - 1})
    client.flush()
    for turn in range(20):
        opened = []
        for index in range(200):
            stream_id = client.open(b"/inference.GRPCInferenceService/Nope%d-%d" % (turn, index))
            client.send(stream_id, live_request(), end=True)
            opened.append(stream_id)
        await client.read(functools.partial(answered, client, opened), timeout_s=60)
    client.close()
    return "4,000 calls, each answered with its own grpc-message"


async def idle(port: int, _redis_url: str) -> str:
    held = []
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
    for _ in range(40):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(preface)
        held.append(writer)
    await asyncio.sleep(0.5)
    try:
        client = await RawClient.connect(port)
        stream_id = client.open(LIVE)
        client.send(stream_id, live_request(), end=True)
        found = await client.status_of(stream_id, timeout_s=5)
        client.close()
        outcome = f"grpc-status {found.get(b'grpc-status', b'-').decode()}"
    except (OSError, TimeoutError, h2.exceptions.ProtocolError) as exc:
        outcome = f"refused ({type(exc).__name__})"
    for writer in held:
        writer.close()
    return f"a new client after 40 idle connections: {outcome}"


def added(client: redis.Redis, stream: str) -> int:
    """The entries ever added to the stream (withdrawn ones too)."""
    try:
        info: dict[str, int] = client.xinfo_stream(stream)
    except redis.ResponseError:  # not made yet
        return 0
    return int(info["entries-added"])


async def reset(port: int, redis_url: str) -> str:
    rounds, calls = 10, 32  # within the gateway's 40 RPCs in flight (max_connections), beside the canary's
    with redis.Redis.from_url(redis_url) as client:
        key, _ = apikeys.create(client, ["invoke:*"])
        stream = keys.invocations("classifier")
        request = service_pb2.ModelInferRequest(model_name="classifier")
        request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
        request.raw_input_contents.append(bytes(64))
        body = message(request.SerializeToString())
        headers = [(b"authorization", b"Bearer " + key.encode()), (b"grpc-timeout", b"60S")]
        queued = 0
        for _ in range(rounds):
            caller = await RawClient.connect(port)
            before = added(client, stream)
            streams = [caller.open(INFER, headers, send=False) for _ in range(calls)]
            for stream_id in streams:
                caller.h2.send_data(stream_id, body, end_stream=True)
            caller.flush()
            for _ in range(500):  # until the round is queued, 10 s at most
                if added(client, stream) >= before + calls:
                    break
                await asyncio.sleep(0.02)
            queued += added(client, stream) - before
            for stream_id in streams:
                caller.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            caller.flush()
            await asyncio.sleep(0.3)  # under the gateway's reset limit, and its places given back
            caller.close()
        await asyncio.sleep(1)  # what the gateway does about the last resets is done by then
        left = int(client.xlen(stream))
        client.delete(stream)
    return f"{queued} calls queued, then reset by their clients: {left} still queued for a runner"


ATTACKS: dict[str, Callable[[int, str], Awaitable[str]]] = {
    "bomb": bomb,
    "window": window,
    "table": table,
    "idle": idle,
    "reset": reset,
}


def reset_peak(pid: int) -> int:
    """The process's peak RSS starts again from its RSS now, which is answered."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return memory_bytes(pid, "VmRSS:")


async def attack(name: str, port: int, pid: int, redis_url: str) -> None:
    rss, cpu, started = reset_peak(pid), cpu_s(pid), time.perf_counter()
    stop, waits = asyncio.Event(), list[float]()
    watching = asyncio.create_task(canary(port, stop, waits))
    try:
        outcome = await ATTACKS[name](port, redis_url)
    except (OSError, TimeoutError, RuntimeError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    stop.set()
    await watching
    print(
        f"{name}: {outcome}; peak RSS +{(memory_bytes(pid, 'VmHWM:') - rss) / MiB:.0f} MiB, "
        f"CPU {cpu_s(pid) - cpu:.2f} s, wall {time.perf_counter() - started:.2f} s, "
        f"canary's worst wait {max(waits, default=0) * 1000:.0f} ms",
        flush=True,
    )


@contextlib.contextmanager
def gateway_of(checkout: Path) -> Iterator[tuple[int, int, str]]:
    """A private redis-server and the checkout's gateway, auth on: (its gRPC port, its pid, the
    Redis URL)."""
    with tempfile.TemporaryDirectory(prefix="fngate-front-door-") as folder:
        socket_path = Path(folder) / "redis.sock"
        redis = subprocess.Popen(
            ["redis-server", "--port", "0", "--unixsocket", str(socket_path), "--save", ""],
            stdout=subprocess.DEVNULL,
        )
        port = free_port()
        env = {key: value for key, value in os.environ.items() if not key.startswith("FNGATE_")}
        env.update(
            FNGATE_REDIS_URL=f"unix://{socket_path}",
            FNGATE_REPO=str(ROOT / "functions"),
            FNGATE_AUTH="true",
            FNGATE_GRPC_PORT=str(port),
            FNGATE_PORT=str(free_port()),
            FNGATE_STATUS_PORT="0",
            FNGATE_METRICS_PORT="0",
            FNGATE_MAX_CONNECTIONS="40",
        )
        with open(Path(folder) / "gateway.log", "wb") as log:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "gateway"], env=env, cwd=checkout, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            yield port, gateway.pid, f"unix://{socket_path}"
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
            redis.terminate()
            redis.wait(timeout=30)


async def run(port: int, pid: int, redis_url: str, names: list[str]) -> None:
    for _ in range(150):
        try:
            (await RawClient.connect(port)).close()
            break
        except OSError:
            await asyncio.sleep(0.2)
    for name in names:
        await attack(name, port, pid, redis_url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.front_door", description=__doc__)
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose gateway runs")
    parser.add_argument(
        "attacks", nargs="*", metavar="ATTACK", help=f"of {', '.join(ATTACKS)} (default: all)"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.attacks) - set(ATTACKS))
    if unknown:
        parser.error(f"no attack {', '.join(unknown)}: choose from {', '.join(ATTACKS)}")
    with gateway_of(args.checkout.resolve()) as (port, pid, redis_url):
        asyncio.run(run(port, pid, redis_url, args.attacks or list(ATTACKS)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
