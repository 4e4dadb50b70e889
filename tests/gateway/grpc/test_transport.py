"""The gRPC front end's HTTP/2 transport (gateway.grpc.transport): messages past the flow-control
windows and compressed ones reach the function whole; hostile streams and connections are refused
with a status or a GOAWAY, cost the gateway process little memory, and end alone."""

from __future__ import annotations

import asyncio
import gzip
import signal
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.grpc import service_pb2

from bench.h2_client import INFER, RawClient, hang_up, live_request, message
from tests.conftest import free_port
from tests.gateway.http.test_bounds import peak_rss_bytes, reset_peak

MiB = 2**20
RSS_SLACK_BYTES = 48 * MiB
"""Far below what the probes claim (a GiB message, 64 MiB inflated, hundreds of streams)."""


def unit_rows(batch: np.ndarray) -> np.ndarray:
    """What normalize answers: each row scaled to unit L2 norm."""
    result: np.ndarray = batch / np.linalg.norm(batch, axis=1, keepdims=True)
    return result


def infer_normalize(port: int, batch: np.ndarray, compression: str | None) -> np.ndarray:
    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        item = triton.InferInput("input", list(batch.shape), "FP32")
        item.set_data_from_numpy(batch)
        result = client.infer("normalize", [item], client_timeout=60, compression_algorithm=compression)
        answer: np.ndarray = result.as_numpy("normalized")
        return answer
    finally:
        client.close()


async def test_messages_past_the_windows_and_compressed_ones_arrive_whole(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], repo: Path
) -> None:
    """6 MB each way: several times the stream's receive window (1 MiB) and the client's (64 KiB
    at first), so both directions wait on WINDOW_UPDATEs."""
    port = free_port()
    await serve_gateway(grpc_port=port)
    await inprocess_runner()
    batch = np.random.default_rng(5).standard_normal((4, 400_000), dtype=np.float32)
    wanted = unit_rows(batch)
    for compression in (None, "gzip", "deflate"):
        answer = await asyncio.to_thread(infer_normalize, port, batch, compression)
        np.testing.assert_allclose(answer, wanted, rtol=1e-5, err_msg=str(compression))


async def still_serves(port: int) -> None:
    client = await RawClient.connect(port)
    try:
        stream_id = client.open(b"/inference.GRPCInferenceService/ServerLive")
        client.send(stream_id, live_request(), end=True)
        assert (await client.status_of(stream_id))[b"grpc-status"] == b"0"
    finally:
        await client.hang_up()


async def grpc_gateway(gateway_with_pid: Callable[..., Any], **env: str) -> tuple[int, Any]:
    """`python -m gateway` with its gRPC port, once that port serves: (port, process)."""
    port = free_port()
    _, process = gateway_with_pid(FNGATE_GRPC_PORT=str(port), **env)
    for _ in range(100):
        try:
            await still_serves(port)
            return port, process
        except ConnectionRefusedError:  # not bound yet (any other failure is the test's)
            assert process.poll() is None, "the gateway stopped"
            await asyncio.sleep(0.1)
    raise AssertionError("the gateway's gRPC port did not serve within 10 s")


@pytest.mark.timeout(120)
async def test_hostile_streams_and_connections_are_refused_alone_and_cost_little(
    gateway_with_pid: Callable[..., Any],
) -> None:
    port, process = await grpc_gateway(
        gateway_with_pid,
        FNGATE_MAX_BODY_BYTES=str(MiB),
        FNGATE_BODY_TIMEOUT_S="1",
        FNGATE_HEADER_TIMEOUT_S="1",
        FNGATE_MAX_CONNECTIONS="8",
    )
    before = reset_peak(process.pid)
    client = await RawClient.connect(port)

    # A message that declares a GiB, one that inflates past the limit, and what is not a message.
    huge = client.open()
    client.send(huge, struct.pack(">BI", 0, 2**30) + b"\0" * 1000)
    bomb = client.open(extra=[(b"grpc-encoding", b"gzip")])
    client.send(bomb, message(gzip.compress(b"\0" * 64 * MiB), compressed=True), end=True)
    garbage = client.open()
    client.send(garbage, message(b"\xff" * 100), end=True)
    # A whole request whose gzip trailer (CRC and length) is cut off: refused, not parsed.
    truncated = client.open(b"/inference.GRPCInferenceService/ModelMetadata", [(b"grpc-encoding", b"gzip")])
    request = service_pb2.ModelMetadataRequest(name="tiny").SerializeToString()
    client.send(truncated, message(gzip.compress(request)[:-8], compressed=True), end=True)
    unknown_encoding = client.open(extra=[(b"grpc-encoding", b"zstd")])
    unknown_method = client.open(b"/inference.GRPCInferenceService/Nope")
    not_grpc = client.open(extra=[(b"content-type", b"text/plain")])
    crowded = client.open(extra=[(b"x-filler-%d" % index, b"1") for index in range(200)])
    slow = client.open()  # a head and no message: cut at the body timeout
    expected = {
        huge: (b"8", b"larger than max"),
        bomb: (b"8", b"decompressed message larger than max"),
        garbage: (b"3", b"could not be parsed"),
        truncated: (b"13", b"gzip message is truncated"),
        unknown_encoding: (b"12", b"zstd"),
        unknown_method: (b"12", b"Method not found"),
        crowded: (b"8", b"more than 100 headers"),
        slow: (b"4", b"did not arrive within 1 s"),
    }
    for stream_id, (status, words) in expected.items():
        found = await client.status_of(stream_id)
        assert found.get(b"grpc-status") == status, (stream_id, found)
        assert words in found.get(b"grpc-message", b"").replace(b"%20", b" "), (stream_id, found)
    assert (await client.status_of(not_grpc))[b":status"] == b"415"
    assert client.goaway is None  # each was refused alone, on a connection that still serves
    stream_id = client.open(b"/inference.GRPCInferenceService/ServerLive")
    client.send(stream_id, live_request(), end=True)
    assert (await client.status_of(stream_id))[b"grpc-status"] == b"0"

    # A header block past max_header_bytes ends that connection (HPACK's limit), not the process.
    client.open(extra=[(b"x-big", b"x" * 16_000), (b"x-big-2", b"y" * 16_000), (b"x-big-3", b"z" * 16_000)])
    await client.ended()
    assert client.closed or client.goaway is not None
    await client.hang_up()

    # Streams opened and cancelled as fast as they go (the rapid-reset attack): GOAWAY.
    rapid = await RawClient.connect(port)
    for _ in range(400):
        stream_id = rapid.open(send=False)
        rapid.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
    rapid.flush()
    await rapid.ended()
    assert rapid.closed
    if rapid.goaway is not None:  # unless the close overtook it
        assert rapid.goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    await rapid.hang_up()

    # PINGs as fast as they go (each costs an ACK): GOAWAY.
    pinging = await RawClient.connect(port)
    for index in range(300):
        pinging.h2.ping(b"%08d" % index)
    pinging.flush()
    await pinging.ended()
    assert pinging.closed
    if pinging.goaway is not None:
        assert pinging.goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    await pinging.hang_up()

    # A frame past 16 KiB (what the gateway advertises): GOAWAY FRAME_SIZE_ERROR, then the close.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
    writer.write(bytes([0, 0x50, 0, 0, 0, 0, 0, 0, 1]) + b"x" * 100)
    received = b""
    async with asyncio.timeout(10):
        while chunk := await reader.read(65536):
            received += chunk
    await hang_up(writer)
    assert received[-14] == 7 and received.endswith(struct.pack(">I", 6))  # GOAWAY, its code last

    # A connection that never sends its preface is closed at the header timeout.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    async with asyncio.timeout(10):
        while await reader.read(65536):
            pass
    await hang_up(writer)

    # RPCs in flight past max_connections (8), over all connections: RESOURCE_EXHAUSTED.
    busy = await RawClient.connect(port)
    opened = [busy.open() for _ in range(9)]
    found = await busy.status_of(opened[-1])
    assert found.get(b"grpc-status") == b"8" and b"8 RPCs in flight" in found[b"grpc-message"], found
    assert all(b"grpc-status" not in busy.statuses.get(stream_id, {}) for stream_id in opened[:-1])
    await busy.hang_up()

    # Past max_connections (8), a new connection is sent away at once.
    held = [await RawClient.connect(port) for _ in range(8)]
    for each in held:
        each.open(b"/inference.GRPCInferenceService/ServerLive")  # keeps it busy past the timeout
    extra = await RawClient.connect(port)
    await extra.ended()
    assert extra.goaway is not None and extra.goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    for each in [*held, extra]:
        await each.hang_up()

    await asyncio.sleep(1.5)  # the held connections' streams time out and free their places
    await still_serves(port)
    grown = peak_rss_bytes(process.pid) - before
    print(f"gateway peak RSS grew {grown / MiB:.1f} MiB over the probes")
    assert grown < RSS_SLACK_BYTES


async def test_metadata_never_reaches_the_log_even_at_debug(
    gateway_with_pid: Callable[..., Any], tmp_path: Path
) -> None:
    """HTTP/2's libraries log each header block they decode at DEBUG; a key in it must not follow."""
    port, process = await grpc_gateway(gateway_with_pid, FNGATE_LOG_LEVEL="DEBUG")
    secret = "fng_0123456789ab_thisIsNotToBeLoggedAnywhere0123456789abcdef"
    client = await RawClient.connect(port)
    stream_id = client.open(
        b"/inference.GRPCInferenceService/ServerLive", [(b"authorization", f"Bearer {secret}".encode())]
    )
    client.send(stream_id, live_request(), end=True)
    assert (await client.status_of(stream_id))[b"grpc-status"] == b"0"
    await client.hang_up()
    process.terminate()
    process.wait(timeout=15)
    log = (tmp_path / "gateway-0.log").read_text()
    assert secret not in log


def classifier_request() -> bytes:
    request = service_pb2.ModelInferRequest(model_name="classifier")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.linspace(0, 1, 16, dtype=np.float32).tobytes())
    return message(request.SerializeToString())


@pytest.mark.timeout(120)
async def test_an_rpc_in_flight_when_the_gateway_stops_is_answered_then_the_connection_ends(
    gateway_with_pid: Callable[..., Any], inprocess_runner: Callable[..., Any]
) -> None:
    """SIGTERM: RPCs already open are answered (here once a runner comes), new ones are refused
    with REFUSED_STREAM (a client retries those elsewhere), then GOAWAY and the process exits."""
    port, process = await grpc_gateway(gateway_with_pid)
    client = await RawClient.connect(port)
    waiting = client.open(INFER)
    client.send(waiting, classifier_request(), end=True)
    await asyncio.sleep(0.5)  # queued, with no runner to answer it yet
    process.send_signal(signal.SIGTERM)
    refused = None
    for _ in range(50):  # once the gateway's lifespan ends, the gRPC front end takes no new RPC
        await asyncio.sleep(0.1)
        probe = client.open(b"/inference.GRPCInferenceService/ServerLive")
        client.send(probe, live_request(), end=True)
        await client.read(
            lambda probe=probe: probe in client.resets or b"grpc-status" in client.statuses.get(probe, {})
        )
        if probe in client.resets:
            refused = client.resets[probe]
            break
    assert refused == h2.errors.ErrorCodes.REFUSED_STREAM
    await inprocess_runner()
    answered = await client.status_of(waiting, timeout_s=30)
    assert answered[b"grpc-status"] == b"0", answered
    await client.ended(timeout_s=30)
    assert client.goaway is not None
    await client.hang_up()
    assert process.wait(timeout=30) == 0


@pytest.mark.timeout(120)
async def test_a_large_message_costs_about_its_own_size_plain_or_inflated(
    gateway_with_pid: Callable[..., Any],
) -> None:
    """A 48 MiB message (under the 64 MiB limit) that is not protobuf, sent plain and as a gzip,
    each refused with INVALID_ARGUMENT; the gateway holds it once, not a copy per step."""
    port, process = await grpc_gateway(gateway_with_pid)
    size = 48 * MiB
    plain = message(b"\xff" * size)
    packed = message(gzip.compress(b"\xff" * size, compresslevel=1), compressed=True)
    for name, body, head in (("plain", plain, []), ("gzip", packed, [(b"grpc-encoding", b"gzip")])):
        before = reset_peak(process.pid)
        client = await RawClient.connect(port)
        stream_id = client.open(INFER, head)
        await client.send_all(stream_id, body, end=True)
        found = await client.status_of(stream_id, timeout_s=60)
        await client.hang_up()
        assert found.get(b"grpc-status") == b"3", (name, found)
        grown = peak_rss_bytes(process.pid) - before
        print(f"{name}: the gateway's peak RSS grew {grown / MiB:.1f} MiB for a {size // MiB} MiB message")
        assert grown < 1.5 * size, name
