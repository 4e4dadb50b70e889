"""Bounded work per request: shapes that claim more than their bytes, data nested past any shape,
and slow or vanished clients cost a gateway process little memory and a bounded time."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import gzip
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from bench.h2_client import hang_up
from tests.conftest import wait_http

INFER = "/v2/models/strings/infer"
RSS_SLACK_BYTES = 64 * 2**20
"""How much a gateway's peak RSS may grow over the whole test: far below what the shapes claim."""


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set size (VmHWM) from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def binary_body(shape: list[int], data: bytes) -> tuple[bytes, dict[str, str]]:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": shape,
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    )
    return header + data, {"inference-header-content-length": str(len(header))}


def nested(depth: int) -> bytes:
    """JSON text of one string inside `depth` lists (built as text: encoders recurse)."""
    return b"[" * depth + b'"x"' + b"]" * depth


def assert_json_400(response: httpx.Response, mentions: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["code"] == "invalid_argument"
    assert mentions in body["error"]


async def test_shapes_beyond_the_bytes_received_are_400_without_allocating(
    redis: Any, gateway_with_pid: Callable[..., Any]
) -> None:
    base, process = gateway_with_pid()
    await wait_http(base)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        await client.post(INFER, content=b"{}")  # warm the code paths before the baseline
        baseline = peak_rss_bytes(process.pid)

        body, headers = binary_body([8, 12_500_000], b"\x00\x00\x00\x00")
        assert len(body) < 200  # a few bytes that claim 100 million strings
        assert_json_400(await client.post(INFER, content=body, headers=headers), "at most 1")

        body, headers = binary_body([1, 10**12], b"\x00\x00\x00\x00")
        assert_json_400(await client.post(INFER, content=body, headers=headers), "at most 1")

        doc = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 10**12], "data": ["abcd"]}]}
        assert_json_400(await client.post(INFER, json=doc), "1 elements of data")

        doc = {"inputs": {"text": [["ab"] * 3] * 2}}
        ok = await client.post("/v1/functions/strings", json={**doc, "timeout_ms": 1})
        assert ok.status_code != 400, ok.text  # a well-formed one passes validation

        peak = peak_rss_bytes(process.pid)
    assert peak - baseline < RSS_SLACK_BYTES, f"peak RSS grew by {(peak - baseline) / 2**20:.0f} MiB"


async def test_data_nested_deeper_than_any_shape_is_400(gateway_with_pid: Callable[..., Any]) -> None:
    base, _process = gateway_with_pid()
    await wait_http(base)
    v2 = b'{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": %s}]}'
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert_json_400(await client.post(INFER, content=v2 % nested(990)), "nested deeper")
        # Deeper than the JSON parser goes: still a JSON 400, never a 500 or plain text.
        assert_json_400(await client.post(INFER, content=v2 % nested(5000)), "JSON")
        v1 = b'{"inputs": {"text": %s}}' % nested(990)
        assert_json_400(await client.post("/v1/functions/strings", content=v1), "rank")


async def test_large_bodies_are_parsed_off_the_loop_with_the_same_answers(
    gateway_with_pid: Callable[..., Any],
) -> None:
    base, _process = gateway_with_pid()
    await wait_http(base)
    rows = [["x" * 1000] * 100] * 4  # about 400 KB of JSON: over the threshold for a parse thread
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        ok = await client.post("/v1/functions/strings", json={"inputs": {"text": rows}, "timeout_ms": 1})
        assert ok.status_code == 504, ok.text  # valid: queued, and no runner answers within 1 ms
        bad = {"inputs": {"text": [*rows, ["x"]]}}
        assert_json_400(await client.post("/v1/functions/strings", json=bad), "401 elements")
        assert_json_400(await client.post(INFER, content=b"[" + b"1," * 200_000), "must be a JSON object")


async def read_response(base: str, request: bytes, timeout_s: float = 20) -> bytes:
    """Send raw bytes and read until the server closes the connection."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            return await reader.read()
    finally:
        await hang_up(writer)


@pytest.mark.parametrize("sent", [b"", b'{"inputs": '])
async def test_a_body_that_does_not_arrive_is_cut_at_the_body_timeout(
    serve_gateway: Callable[..., Any], sent: bytes
) -> None:
    base = await serve_gateway(body_timeout_s=0.5)
    head = (
        f"POST {INFER} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        f"content-length: 1000\r\n\r\n"
    ).encode()
    answer = await read_response(base, head + sent)  # returns only once the server closed it
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), answer
    assert b'"code":"invalid_argument"' in rest
    assert b"did not arrive within 0.5 s" in rest


async def test_a_request_head_sent_a_byte_at_a_time_is_cut_at_the_header_timeout(
    serve_gateway: Callable[..., Any],
) -> None:
    base = await serve_gateway(header_timeout_s=1.0)
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    closed_after = None
    try:
        started = asyncio.get_running_loop().time()
        for byte in f"POST {INFER} HTTP/1.1\r\nhost: test\r\nx-slow: ".encode() + b"a" * 200:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)  # every byte well inside any idle limit
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.001):
                    await reader.read(1)
            if reader.at_eof():
                closed_after = asyncio.get_running_loop().time() - started
                break
    except ConnectionError:
        closed_after = asyncio.get_running_loop().time() - started
    finally:
        await hang_up(writer)
    assert closed_after is not None, "the server kept a connection whose head never ended"


async def test_a_client_that_disconnects_mid_body_is_not_an_error_log(
    serve_gateway: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    base = await serve_gateway()
    host, port = base.removeprefix("http://").split(":")
    for _ in range(3):
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST {INFER} HTTP/1.1\r\nhost: test\r\ncontent-length: 100\r\n\r\n{{".encode())
        await writer.drain()
        await hang_up(writer)
        await writer.wait_closed()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert_json_400(await client.post(INFER, content=b"{"), "not valid JSON")  # still serving
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert not errors, [record.getMessage() for record in errors]


async def read_head(reader: asyncio.StreamReader) -> tuple[bytes, int]:
    """A response's status line and headers, and its content-length."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head, length


async def test_responses_without_a_body_and_interim_ones_go_out_at_once(
    serve_gateway: Callable[..., Any],
) -> None:
    """A response leaves in one write when it can; none waits for bytes that never come: a HEAD
    answer, a 100 Continue before the client sends its body, pipelined requests on one connection."""
    base = await serve_gateway()
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        async with asyncio.timeout(20):
            writer.write(b"HEAD /v2/health/live HTTP/1.1\r\nhost: test\r\n\r\n")
            head, _ = await read_head(reader)
            assert head.startswith(b"HTTP/1.1 200"), head

            body = b'{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}'
            writer.write(
                "POST /v2/models/nope/infer HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nexpect: 100-continue\r\n\r\n".encode()
            )
            interim = await reader.readuntil(b"\r\n\r\n")  # the body is sent only after this
            assert interim.startswith(b"HTTP/1.1 100"), interim
            writer.write(body)
            head, length = await read_head(reader)
            assert head.startswith(b"HTTP/1.1 404"), head
            assert b'"code":"not_found"' in await reader.readexactly(length)

            writer.write(b"GET /v2/health/live HTTP/1.1\r\nhost: test\r\n\r\n" * 3)
            for _ in range(3):
                head, length = await read_head(reader)
                assert head.startswith(b"HTTP/1.1 200"), head
                await reader.readexactly(length)
    finally:
        await hang_up(writer)


async def test_pipelined_invocations_are_answered_in_order(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any]
) -> None:
    """HTTP/1.1 pipelining: invocations written back to back on one connection, with an answer
    that fails among them, are each answered, in the order sent."""
    base = await serve_gateway()
    await inprocess_runner()
    host, port = base.removeprefix("http://").split(":")
    rows = [[float(index + column) for column in range(16)] for index in range(4)]
    bodies = [orjson.dumps({"inputs": {"input": [row]}}) for row in rows]
    bodies.insert(2, b"{")
    head = "POST /v1/functions/classifier HTTP/1.1\r\nhost: test\r\ncontent-length: {}\r\n\r\n"
    data = b"".join(head.format(len(body)).encode() + body for body in bodies)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        async with asyncio.timeout(30):
            writer.write(data)
            answers = []
            for _ in bodies:
                head, length = await read_head(reader)
                answers.append((head.split(b" ")[1], orjson.loads(await reader.readexactly(length))))
    finally:
        await hang_up(writer)
    assert [status for status, _ in answers] == [b"200", b"200", b"400", b"200", b"200"]
    for (_, answer), row in zip(answers[:2] + answers[3:], rows, strict=True):
        alone = await post_one(base, row)
        assert answer["outputs"] == alone["outputs"]


async def post_one(base: str, row: list[float]) -> Any:
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        return (await client.post("/v1/functions/classifier", json={"inputs": {"input": [row]}})).json()


MiB = 2**20
SERVERS = ["uvicorn", "hypercorn"]  # the lean invoke path on uvicorn, the ASGI path on Hypercorn
PROBE_HEAD = b'{"inputs":[{"name":"input","datatype":"FP32","shape":[1,16],"data":['


def reset_peak(pid: int) -> int:
    """Reset the process's peak RSS to its RSS now (/proc/PID/clear_refs); that RSS, in bytes."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc status")


def gzipped_probe(numbers_mib: int) -> bytes:
    """A gzip body (members one after another, as gzip allows) of a V2 request for classifier that
    declares a [1, 16] input and sends `numbers_mib` Mi one-digit numbers."""
    member = gzip.compress(b"1," * MiB, compresslevel=9)
    return gzip.compress(PROBE_HEAD) + member * numbers_mib + gzip.compress(b"1]}]}")


async def answer_while_sending(base: str, data: bytes) -> bytes:
    """What the server answers to `data`, read while it is sent, until the server ends the
    connection (a server may answer, and stop reading, before the request is all sent)."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))

    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(data)
            await writer.drain()

    sending = asyncio.create_task(send())
    answer = b""
    try:
        async with asyncio.timeout(20):
            while chunk := await reader.read(65536):
                answer += chunk
    except ConnectionResetError:
        pass  # after the answer, or instead of it: the assertion on what was read says which
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        await hang_up(writer)
    return answer


async def post_raw(base: str, path: str, body: bytes, *headers: str) -> tuple[int, bytes]:
    """POST `body`, reading the answer while it is sent: a server may refuse it before its end."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = "\r\n".join([f"POST {path} HTTP/1.1", "host: test", f"content-length: {len(body)}", *headers])

    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(head.encode() + b"\r\n\r\n")
            for start in range(0, len(body), MiB):
                writer.write(body[start : start + MiB])
                await writer.drain()

    sending = asyncio.create_task(send())
    try:
        async with asyncio.timeout(60):
            response, length = await read_head(reader)
            content = await reader.readexactly(length)
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        await hang_up(writer)
    return int(response.split(b" ")[1]), content


@pytest.mark.parametrize("server", SERVERS)
async def test_an_invocations_answer_carries_the_date_as_every_answer_does(
    gateway_with_pid: Callable[..., Any], server: str
) -> None:
    """uvicorn's lean invoke path writes its answers itself: they carry the server's Date header
    (RFC 9110) as the ASGI app's answers do, on either server."""
    base, _ = gateway_with_pid(FNGATE_SERVER=server)
    await wait_http(base)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        refused = await client.post("/v2/models/classifier/infer", content=b"{}")
        live = await client.get("/v2/health/live")
    assert refused.status_code == 400, refused.text
    for answer in (refused, live):
        sent = email.utils.parsedate_to_datetime(answer.headers["date"])
        assert abs(sent.timestamp() - time.time()) < 5, answer.headers


@pytest.mark.parametrize("server", SERVERS)
async def test_bodies_that_send_more_than_they_declare_cost_little_memory(
    gateway_with_pid: Callable[..., Any], server: str
) -> None:
    """The probes of docs/security.md: a small gzip of 30 Mi one-digit numbers for a [1, 16] input,
    alone and 16 at once, and the same body uncompressed (64 MiB). Each is refused at the first
    number past the shape, never decompressed or held whole."""
    base, process = gateway_with_pid(FNGATE_SERVER=server)
    await wait_http(base)
    compressed = gzipped_probe(30)  # 60 MiB of numbers: under the body limit once decompressed
    assert len(compressed) < 200_000
    plain = PROBE_HEAD + b"1," * ((64 * MiB - 200) // 2) + b"1]}]}"
    infer = "/v2/models/classifier/infer"
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        await client.post(infer, content=b"{}")  # warm the code paths before the baseline
    for probes, body, headers in [
        (1, compressed, ["content-encoding: gzip"]),
        (16, compressed, ["content-encoding: gzip"]),
        (1, plain, []),
    ]:
        before = reset_peak(process.pid)
        answers = await asyncio.gather(*(post_raw(base, infer, body, *headers) for _ in range(probes)))
        for status, content in answers:
            assert status == 400, content
            assert b"more than 16 elements of data" in content
        growth = peak_rss_bytes(process.pid) - before
        assert growth < 64 * MiB, f"{probes} x {len(body)} bytes: peak RSS grew by {growth / MiB:.0f} MiB"


@pytest.mark.parametrize("server", SERVERS)
async def test_large_heads_many_headers_too_many_connections_and_decodes_are_refused(
    gateway_with_pid: Callable[..., Any], server: str
) -> None:
    base, _process = gateway_with_pid(
        FNGATE_SERVER=server, FNGATE_MAX_CONNECTIONS="8", FNGATE_MAX_DECODE_BYTES=str(MiB)
    )
    await wait_http(base)
    host, port = base.removeprefix("http://").split(":")
    huge = b"x-big: " + b"a" * MiB + b"\r\n"
    many = b"".join(b"x-%d: %d\r\n" % (i, i) for i in range(200))  # 2 KB: under the size limit
    for extra in (huge, many):
        answer = await answer_while_sending(
            base, b"GET /v2/health/live HTTP/1.1\r\nhost: test\r\n" + extra + b"\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    # Eight requests waiting for their bodies hold every place; the ninth is refused, not held.
    held = []
    try:
        for _ in range(8):
            _reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v2/models/classifier/infer HTTP/1.1\r\nhost: test\r\ncontent-length: 100\r\n\r\n"
            )
            await writer.drain()
            held.append(writer)
        await asyncio.sleep(0.2)
        answer = await answer_while_sending(base, b"GET /v2/health/live HTTP/1.1\r\nhost: test\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"retry-after: 1" in answer.lower()
    finally:
        for writer in held:
            await hang_up(writer)
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await client.get("/v2/health/live")).status_code == 200  # places free again
    # Eight connections holding half a request head each hold every place too.
    held = []
    try:
        for _ in range(8):
            _reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v2/models/classifier/infer HTTP/1.1\r\nhost: te")
            await writer.drain()
            held.append(writer)
        await asyncio.sleep(0.2)
        answer = await answer_while_sending(base, b"GET /v2/health/live HTTP/1.1\r\nhost: test\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    finally:
        for writer in held:
            await hang_up(writer)
    await asyncio.sleep(0.2)
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        assert (await client.get("/v2/health/live")).status_code == 200
    # One body being decoded holds more than the decode allowance (alone, it goes on); a second is 503.
    numbers = 400_000
    head = b'{"inputs":[{"name":"input","datatype":"FP32","shape":[1,%d],"data":[' % numbers
    first = head + b"1," * (numbers // 2)
    length = len(first) + 2 * (numbers // 2) + 10
    _reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v2/models/normalize/infer HTTP/1.1\r\nhost: test\r\ncontent-length: %d\r\n\r\n" % length
        )
        writer.write(first)
        await writer.drain()
        await asyncio.sleep(0.5)
        second = b'{"inputs":[{"name":"input","datatype":"FP32","shape":[1,200000],"data":['
        second += b"1," * 199_999 + b"1]}]}"
        status, content = await post_raw(base, "/v2/models/normalize/infer", second)
        assert status == 503, content
        assert b"max_decode_bytes" in content
    finally:
        await hang_up(writer)


@pytest.mark.parametrize("server", SERVERS)
async def test_one_client_holds_at_most_its_share_of_the_connections(
    gateway_with_pid: Callable[..., Any], server: str
) -> None:
    """One client (127.0.0.3) holding 4 connections with half-sent request heads holds all it may
    (max_client_connections 4 of max_connections 16): its fifth is answered 503 and closed, while
    another client (127.0.0.2) is served; once it lets one go, it is served again. (Not 127.0.0.1:
    Hypercorn counts the connection wait_http closed until its keep-alive timeout.)"""
    base, _process = gateway_with_pid(
        FNGATE_SERVER=server, FNGATE_MAX_CONNECTIONS="16", FNGATE_MAX_CLIENT_CONNECTIONS="4"
    )
    await wait_http(base)
    host, port = base.removeprefix("http://").split(":")
    request = b"GET /v2/health/live HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n"

    async def answer_from(source: str) -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
        try:
            writer.write(request)
            async with asyncio.timeout(20):
                return await reader.read()
        finally:
            await hang_up(writer)

    held = []
    try:
        for _ in range(4):
            _reader, writer = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.3", 0))
            writer.write(b"POST /v2/models/classifier/infer HTTP/1.1\r\nhost: te")
            await writer.drain()
            held.append(writer)
        await asyncio.sleep(0.2)
        refused = await answer_from("127.0.0.3")
        assert refused.startswith(b"HTTP/1.1 503"), refused[:200]
        assert b"max_client_connections" in refused
        assert (await answer_from("127.0.0.2")).startswith(b"HTTP/1.1 200")
        await hang_up(held.pop())
        for _ in range(50):  # once the server has seen it go (Hypercorn ends a connection a moment later)
            await asyncio.sleep(0.1)
            again = await answer_from("127.0.0.3")
            if again.startswith(b"HTTP/1.1 200"):
                break
        assert again.startswith(b"HTTP/1.1 200"), again[:200]
    finally:
        for writer in held:
            await hang_up(writer)


async def test_long_names_are_cut_in_errors_and_an_invalid_one_is_400_on_deploy(
    serve_gateway: Callable[..., Any],
) -> None:
    base = await serve_gateway()
    name = "n" * 20_000
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for method, path, status in [
            ("POST", f"/v1/functions/{name}", 404),
            ("POST", f"/v2/models/{name}/infer", 404),
            ("GET", f"/v2/models/{name}", 404),
            ("PUT", f"/v1/functions/{name}", 400),
            ("PUT", "/v1/functions/Not_A_Name", 400),
        ]:
            response = await client.request(method, path, content=b"{}")
            assert response.status_code == status, (method, path[:40], response.text[:200])
            assert len(response.content) < 1024


async def test_control_routes_refuse_a_body_past_their_small_bound(
    serve_gateway: Callable[..., Any],
) -> None:
    base = await serve_gateway()
    big = b'{"ready": true, "pad": "' + b"x" * (1024 * 1024) + b'"}'
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for method, path in [("POST", "/v2/repository/index"), ("PUT", "/v1/functions/nope/traffic")]:
            response = await client.request(method, path, content=big)
            assert response.status_code == 413, (method, path, response.text[:200])
        assert (await client.post("/v2/repository/index", content=b"{}")).status_code == 200
