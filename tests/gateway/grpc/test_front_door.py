"""The gRPC front door against callers who hold no key and clients that hold on to what they can:
nothing of an RPC is read before its key is checked, a message's fields are counted before they
are built, and what a connection holds (connections, answers a client does not read, frames that
serve nothing, PINGs, SETTINGS and resets by the hundred) is bounded and timed. Each attack runs
against a real gateway process of each build, uvicorn and Hypercorn, whose peak RSS and CPU time
are read from /proc, while a canary call is still answered."""

from __future__ import annotations

import asyncio
import gzip
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h2.errors
import h2.settings
import hpack
import pytest
import redis.asyncio as aioredis
from tritonclient.grpc import service_pb2

from bench.h2_client import INFER, LIVE, RawClient, hang_up, live_request, message
from fngate import keys
from tests.gateway.grpc.test_transport import grpc_gateway, still_serves
from tests.gateway.http.test_bounds import peak_rss_bytes, reset_peak
from tests.gateway.test_auth import create_key

MiB = 2**20
SERVERS = ["uvicorn", "hypercorn"]
"""The gRPC front end is the same under either HTTP server; each attack runs on both builds."""


def cpu_s(pid: int) -> float:
    """The process's user and system CPU time so far, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def empty_inputs_bomb() -> bytes:
    """A ModelInferRequest of 64 MiB that is nothing but empty `inputs` entries (33 million of
    them for protobuf to build), gzipped: about 65 KB on the wire."""
    number = service_pb2.ModelInferRequest.DESCRIPTOR.fields_by_name["inputs"].number
    entry = bytes([number << 3 | 2, 0])
    return gzip.compress(entry * (32 * MiB - 1024), compresslevel=9)


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


async def keyed_gateway(gateway_with_pid: Callable[..., Any], server: str, **env: str) -> tuple[int, Any]:
    return await grpc_gateway(gateway_with_pid, FNGATE_AUTH="true", FNGATE_SERVER=server, **env)


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.timeout(120)
async def test_nothing_is_read_for_a_caller_without_a_key(
    gateway_with_pid: Callable[..., Any], redis_url: str, server: str
) -> None:
    port, process = await keyed_gateway(gateway_with_pid, server)
    bomb = message(empty_inputs_bomb(), compressed=True)
    assert len(bomb) < 100_000

    # No key, and a key that is not one: refused, and not a byte of the 64 MiB inflated.
    for extra in ([], bearer("fng_0123456789ab_" + "x" * 43)):
        before_rss, before_cpu = reset_peak(process.pid), cpu_s(process.pid)
        client = await RawClient.connect(port)
        stream_id = client.open(INFER, [(b"grpc-encoding", b"gzip"), *extra])
        client.send(stream_id, bomb, end=True)
        found = await client.status_of(stream_id)
        await client.hang_up()
        grown, spent = peak_rss_bytes(process.pid) - before_rss, cpu_s(process.pid) - before_cpu
        print(f"{server}, key {bool(extra)}: refused; peak RSS +{grown / MiB:.1f} MiB, CPU {spent:.2f} s")
        assert found.get(b"grpc-status") == b"16", found  # UNAUTHENTICATED
        assert grown < 16 * MiB
        await still_serves(port)

    # With a key, the same message is inflated (its 64 MiB held once) and counted, never built.
    key, _ = create_key(redis_url, "invoke:*")
    before_rss, before_cpu = reset_peak(process.pid), cpu_s(process.pid)
    client = await RawClient.connect(port)
    stream_id = client.open(INFER, [(b"grpc-encoding", b"gzip"), *bearer(key)])
    client.send(stream_id, bomb, end=True)
    found = await client.status_of(stream_id, timeout_s=30)
    await client.hang_up()
    grown, spent = peak_rss_bytes(process.pid) - before_rss, cpu_s(process.pid) - before_cpu
    print(f"{server}, a good key: refused; peak RSS +{grown / MiB:.1f} MiB, CPU {spent:.2f} s")
    assert found.get(b"grpc-status") == b"8", found  # RESOURCE_EXHAUSTED
    assert b"65536" in found[b"grpc-message"], found
    assert grown < 160 * MiB  # the inflated message once, far from the GiBs protobuf would build
    await still_serves(port)


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.timeout(120)
async def test_answers_a_client_never_reads_hold_no_place_and_are_let_go(
    gateway_with_pid: Callable[..., Any], server: str
) -> None:
    """A client whose windows stay shut (SETTINGS_INITIAL_WINDOW_SIZE 0) asks for more answers
    than the process has RPC places: answered RPCs give their place back while their bytes wait,
    other clients are served, and the waiting answers are reset at the drain timeout."""
    port, _ = await keyed_gateway(
        gateway_with_pid, server, FNGATE_MAX_CONNECTIONS="8", FNGATE_GRPC_DRAIN_TIMEOUT_S="1"
    )
    stingy = await RawClient.connect(port)
    stingy.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    stingy.flush()
    opened: list[int] = []
    for _ in range(5):  # 20 in all, more than the 8 places, 4 at a time
        for _ in range(4):
            stream_id = stingy.open(LIVE)
            stingy.send(stream_id, live_request(), end=True)
            opened.append(stream_id)
        await stingy.read(lambda: len(stingy.statuses) == len(opened))  # their answers' headers are in
    assert not any(b"grpc-status" in stingy.statuses[stream_id] for stream_id in opened)  # none refused
    await still_serves(port)  # a place is free for everyone else
    await stingy.read(lambda: all(stream_id in stingy.resets for stream_id in opened), timeout_s=15)
    assert {stingy.resets[stream_id] for stream_id in opened} == {h2.errors.ErrorCodes.CANCEL}
    await stingy.hang_up()
    await still_serves(port)


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.timeout(120)
async def test_idle_connections_make_room_and_time_out(
    gateway_with_pid: Callable[..., Any], server: str
) -> None:
    """Connections that send their preface and SETTINGS, then nothing, fill the process: a new one
    is served all the same (the longest idle is sent away), and idle ones end at the idle timeout."""
    port, _ = await keyed_gateway(
        gateway_with_pid, server, FNGATE_MAX_CONNECTIONS="8", FNGATE_GRPC_IDLE_TIMEOUT_S="2"
    )
    held = [await RawClient.connect(port) for _ in range(8)]
    await still_serves(port)
    await held[0].ended(timeout_s=5)
    assert held[0].goaway is not None and held[0].goaway.error_code == h2.errors.ErrorCodes.NO_ERROR
    for client in held[1:]:  # the rest, at the idle timeout
        await client.ended(timeout_s=10)
        assert client.goaway is not None
        await client.hang_up()
    await held[0].hang_up()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""A client's preface and an empty SETTINGS."""


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return struct.pack(">HBBBI", len(payload) >> 8, len(payload) & 0xFF, kind, flags, stream_id) + payload


async def goaway_code(port: int, frames: bytes) -> int:
    """The code of the GOAWAY a new connection gets for `frames`, read up to the close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(PREFACE + frames)
    received = b""
    async with asyncio.timeout(10):
        while chunk := await reader.read(65536):
            received += chunk
    await hang_up(writer)
    position = 0
    while position + 9 <= len(received):  # the server's frames, to its GOAWAY
        high, low, kind, _, _ = struct.unpack_from(">HBBBI", received, position)
        payload = received[position + 9 : position + 9 + (high << 8 | low)]
        if kind == 7:
            code: int = struct.unpack_from(">I", payload, 4)[0]
            return code
        position += 9 + len(payload)
    raise AssertionError(f"no GOAWAY in {received[-60:]!r}")


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.timeout(120)
async def test_frame_floods_end_their_connection_at_little_cost(
    gateway_with_pid: Callable[..., Any], server: str
) -> None:
    """Empty CONTINUATION frames without end, PRIORITY frames by the thousand, and WINDOW_UPDATEs
    over a thousand parked answers: each connection ended (GOAWAY ENHANCE_YOUR_CALM) or its frames
    cost the gateway little CPU; a huge SETTINGS_HEADER_TABLE_SIZE changes nothing."""
    port, process = await keyed_gateway(gateway_with_pid, server)

    live = b"\x83\x86\x44\x29/inference.GRPCInferenceService/ServerLive"  # POST, http, :path literal
    continuations = frame(1, 0, 1, live) + frame(9, 0, 1) * 100
    assert await goaway_code(port, continuations) == 11
    priorities = frame(2, 0, 3, bytes(5)) * 2000
    assert await goaway_code(port, priorities) == 11

    # A client that asks for an HPACK table of 2^32-1 and a window of 0, parks 200 answers,
    # then sends 20,000 connection WINDOW_UPDATEs of one byte each.
    client = await RawClient.connect(port)
    client.h2.update_settings(
        {
            h2.settings.SettingCodes.HEADER_TABLE_SIZE: 2**32 - 1,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0,
        }
    )
    client.flush()
    opened = []
    for _ in range(200):
        stream_id = client.open(LIVE)
        client.send(stream_id, live_request(), end=True)
        opened.append(stream_id)
    await client.read(lambda: len(client.statuses) == len(opened))
    before = cpu_s(process.pid)
    async with asyncio.timeout(30):  # a gateway that stopped reading fails here, not at the suite's timeout
        for _ in range(20):
            client.writer.write(frame(8, 0, 0, struct.pack(">I", 1)) * 1000)
            await client.writer.drain()
    await still_serves(port)
    spent = cpu_s(process.pid) - before
    print(f"20,000 connection WINDOW_UPDATEs over 200 parked answers: {spent:.2f} s of the gateway's CPU")
    assert spent < 2.0  # walking every parked answer per frame cost 5.4 s for 1.3 MB of them
    await client.hang_up()


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.timeout(120)
async def test_ping_settings_and_reset_floods_end_their_connection(
    gateway_with_pid: Callable[..., Any], server: str
) -> None:
    """PINGs and SETTINGS (each costs an ACK) past 100 a second, and streams opened and reset at
    once past 200 a second (the rapid-reset attack): GOAWAY ENHANCE_YOUR_CALM, at little cost, and
    other clients are served."""
    port, process = await keyed_gateway(gateway_with_pid, server)
    encoder = hpack.Encoder()
    fields = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", LIVE),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]
    floods = {
        "PING": b"".join(frame(6, 0, 0, b"%08d" % index) for index in range(300)),
        "SETTINGS": frame(4, 0, 0) * 300,
        "rapid reset": b"".join(  # the blocks encoded in the order they are sent
            frame(1, 0x4, stream_id, encoder.encode(fields)) + frame(3, 0, stream_id, struct.pack(">I", 8))
            for stream_id in range(1, 801, 2)
        ),
    }
    before = cpu_s(process.pid)
    for name, frames in floods.items():
        assert await goaway_code(port, frames) == 11, name
        await still_serves(port)
    spent = cpu_s(process.pid) - before
    print(f"{server}: PING, SETTINGS and reset floods ended for {spent:.2f} s of the gateway's CPU")
    assert spent < 2.0


def classifier_request() -> bytes:
    request = service_pb2.ModelInferRequest(model_name="classifier")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(bytes(64))
    return message(request.SerializeToString())


@pytest.mark.timeout(120)
async def test_a_cancelled_rpc_lets_go_of_its_invocation(
    gateway_with_pid: Callable[..., Any], redis_url: str, redis: aioredis.Redis
) -> None:
    """A key allowed one invocation in flight: while one waits (no runner serves it), a second is
    refused; once the client resets the first, the key's place is free again."""
    port, _ = await keyed_gateway(gateway_with_pid, "uvicorn")
    key, record = create_key(redis_url, "invoke:*", max_in_flight=1)
    places = keys.key_in_flight(record.id)
    client = await RawClient.connect(port)
    first = client.open(INFER, bearer(key))
    client.send(first, classifier_request(), end=True)

    async def held(expected: int) -> None:
        """Until the key's places in flight (in Redis, as every gateway counts them) are `expected`."""
        for _ in range(200):
            if await redis.zcard(places) == expected:
                return
            assert b"grpc-status" not in client.statuses.get(first, {}), client.statuses[first]
            await asyncio.sleep(0.05)
        raise AssertionError(f"the key's places in flight never came to {expected}")

    async def second_call() -> dict[bytes, bytes]:
        stream_id = client.open(INFER, [*bearer(key), (b"grpc-timeout", b"300m")])
        client.send(stream_id, classifier_request(), end=True)
        return await client.status_of(stream_id)

    await held(1)
    refused = await second_call()
    assert b"in flight" in refused.get(b"grpc-message", b""), refused
    client.h2.reset_stream(first, h2.errors.ErrorCodes.CANCEL)
    client.flush()
    await held(0)
    queued = await second_call()
    assert queued.get(b"grpc-status") == b"4", queued  # queued, then past its own deadline: not refused
    await client.hang_up()


def hpack_literal(name: bytes, value: bytes) -> bytes:
    """A header field literal without indexing, its name a literal too (RFC 7541 6.2.2)."""
    return bytes([0, len(name)]) + name + bytes([len(value)]) + value


@pytest.mark.parametrize(
    "field",
    [(b"X-Upper", b"1"), (b"connection", b"close"), (b"te", b"gzip"), (b":unknown", b"1")],
)
@pytest.mark.timeout(60)
async def test_a_malformed_request_is_reset_alone(
    gateway_with_pid: Callable[..., Any], field: tuple[bytes, bytes]
) -> None:
    """RFC 9113 8.1.1: a request with an uppercase field name, a connection-specific field, a TE
    other than trailers or an unknown pseudo-header is malformed: its stream is reset with
    PROTOCOL_ERROR, and the connection serves on (a PING is answered)."""
    port, _ = await grpc_gateway(gateway_with_pid)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    path = b"/inference.GRPCInferenceService/ServerLive"
    block = (
        b"\x83\x86"
        + bytes([0x44, len(path)])
        + path
        + hpack_literal(b"content-type", b"application/grpc")
        + hpack_literal(*field)
    )
    head = struct.pack(">HBBBI", 0, len(block), 1, 0x4, 1)
    writer.write(
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
        + head
        + block
        + struct.pack(">HBBBI", 0, 8, 6, 0, 0)
        + b"pingpong"
    )
    frames: list[tuple[int, int, int, bytes]] = []
    received = b""
    async with asyncio.timeout(10):
        while not any(kind == 6 and flags & 1 for kind, flags, _, _ in frames):
            received += await reader.read(65536)
            frames, position = [], 0
            while position + 9 <= len(received):
                high, low, kind, flags, stream_id = struct.unpack_from(">HBBBI", received, position)
                size = high << 8 | low
                frames.append((kind, flags, stream_id, received[position + 9 : position + 9 + size]))
                position += 9 + size
    await hang_up(writer)
    resets = [payload for kind, _, stream_id, payload in frames if kind == 3 and stream_id == 1]
    assert resets == [struct.pack(">I", 1)], frames
    assert not any(kind == 7 for kind, _, _, _ in frames)
