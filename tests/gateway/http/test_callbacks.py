"""Callback delivery: the signature a receiver checks, the retry schedule, the addresses a
callback may reach (refused at submission, before anything is queued), and one attempt against
real receivers on loopback: every way it can fail is a failed attempt, within one deadline."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from fngate.errors import InvalidArgument
from gateway.destinations import CallbackPolicy, parse
from gateway.http.callbacks import MAX_ATTEMPTS, post, retry_delay_s, signature


def test_signature_is_hmac_sha256_over_timestamp_and_body() -> None:
    header = signature(b"secret", 1_764_000_000, b'{"outputs": {}}')
    stamp, mac = (part.split("=", 1)[1] for part in header.split(","))
    assert stamp == "1764000000"
    expected = hmac.new(b"secret", b'1764000000.{"outputs": {}}', hashlib.sha256).hexdigest()
    assert mac == expected
    assert signature(b"other", 1_764_000_000, b'{"outputs": {}}') != header
    assert signature(b"secret", 1_764_000_001, b'{"outputs": {}}') != header


def test_retries_back_off_and_are_bounded() -> None:
    delays = [retry_delay_s(attempt) for attempt in range(1, MAX_ATTEMPTS)]
    assert delays == sorted(delays)
    assert delays[1] == 2 * delays[0]
    assert sum(delays) < 60  # every attempt within a minute or so


TEREDO = "2001:0:4136:e378:8000:63bf:80ff:fffe"


@pytest.mark.parametrize(
    ("url", "addresses", "allow", "allowed"),
    [
        ("http://example.com/hook", ["93.184.215.14"], "", True),
        ("https://example.com:8443/hook?x=1", ["2606:2800:21f:cb07:6820:80da:af6b:8b2c"], "", True),
        ("http://127.0.0.1:9/hook", ["127.0.0.1"], "", False),
        ("http://localhost/hook", ["::1", "127.0.0.1"], "", False),  # a name that resolves to loopback
        ("http://metadata/latest", ["169.254.169.254"], "", False),  # link-local: the cloud metadata range
        ("http://[fe80::1]/", ["fe80::1"], "", False),
        ("http://10.1.2.3/", ["10.1.2.3"], "", False),
        ("http://172.16.0.1/", ["172.16.0.1"], "", False),
        ("http://192.168.1.1/", ["192.168.1.1"], "", False),
        ("http://100.64.0.1/", ["100.64.0.1"], "", False),  # shared address space
        ("http://224.0.0.1/", ["224.0.0.1"], "", False),
        ("http://0.0.0.0/", ["0.0.0.0"], "", False),
        ("http://[::ffff:127.0.0.1]/", ["::ffff:127.0.0.1"], "", False),
        # IPv6 forms that embed or translate an IPv4 address: judged by that address.
        ("http://[64:ff9b::7f00:1]/", ["64:ff9b::7f00:1"], "", False),  # NAT64 of 127.0.0.1
        ("http://[64:ff9b::a9fe:a9fe]/", ["64:ff9b::a9fe:a9fe"], "", False),  # NAT64 of 169.254.169.254
        ("http://[64:ff9b::808:808]/", ["64:ff9b::808:808"], "", True),  # NAT64 of 8.8.8.8
        ("http://[64:ff9b:1::a00:1]/", ["64:ff9b:1::a00:1"], "", False),  # local-use NAT64: refused whole
        ("http://[64:ff9b:1:808:8:800::]/", ["64:ff9b:1:808:8:800::"], "", False),
        ("http://[2002:7f00:1::]/", ["2002:7f00:1::"], "", False),  # 6to4 of 127.0.0.1
        ("http://[2002:a00:1::1]/", ["2002:a00:1::1"], "", False),  # 6to4 of 10.0.0.1
        ("http://[2002:808:808::1]/", ["2002:808:808::1"], "", True),  # 6to4 of 8.8.8.8
        ("http://[::7f00:1]/", ["::7f00:1"], "", False),  # IPv4-compatible 127.0.0.1
        ("http://[::a9fe:a9fe]/", ["::a9fe:a9fe"], "", False),  # IPv4-compatible 169.254.169.254
        ("http://[::ffff:a00:1]/", ["::ffff:a00:1"], "", False),  # IPv4-mapped 10.0.0.1
        ("http://[::]/", ["::"], "", False),
        # Teredo: server 65.54.227.120, client 127.0.0.1 (stored inverted: 80ff:fffe)
        (
            "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/",
            ["2001:0:4136:e378:8000:63bf:80ff:fffe"],
            "",
            False,
        ),
        ("http://[::ffff:127.0.0.1]/", ["::ffff:127.0.0.1"], "127.0.0.1", True),  # allowed as IPv4
        ("http://[64:ff9b::7f00:1]/", ["64:ff9b::7f00:1"], "64:ff9b::/96", True),  # or as itself
        ("http://split.example/", ["93.184.215.14", "10.0.0.1"], "", False),  # every address counts
        ("http://127.0.0.1:9/hook", ["127.0.0.1"], "127.0.0.1", True),
        ("http://10.1.2.3/", ["10.1.2.3"], "10.1.0.0/16, 192.168.0.0/24", True),
        ("http://10.2.0.1/", ["10.2.0.1"], "10.1.0.0/16", False),
        ("http://receiver.internal/", ["10.9.9.9"], "receiver.internal", True),
    ],
)
def test_callbacks_reach_only_public_addresses_unless_allowed(
    url: str, addresses: list[str], allow: str, allowed: bool
) -> None:
    policy = CallbackPolicy(allow)
    target = parse(url)
    if allowed:
        destination = policy.check(target, addresses)
        assert destination.address == addresses[0]  # the address checked is the one connected to
        assert destination.host == target.host
    else:
        with pytest.raises(InvalidArgument, match="internal address"):
            policy.check(target, addresses)


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.com/",
        "http:///nohost",
        "http://user:pw@example.com/",
        "http://example.com:99999/",
        "http://a..b/",  # no name: IDNA cannot encode an empty label
        "http://" + "a" * 64 + ".example/",  # a label over 63 bytes
        "http://example.com/caf\u00e9",  # not what a request line may carry
    ],
)
def test_callback_urls_of_other_kinds_are_refused(url: str) -> None:
    with pytest.raises(InvalidArgument):
        parse(url)


INVOCATION = {"inputs": {"input": [[0.5] * 16]}}


async def test_internal_callback_urls_are_400_before_anything_is_queued(
    serve_gateway: Callable[..., Any], redis: Any
) -> None:
    """Nothing is sent: each URL is refused when the invocation is submitted."""
    base = await serve_gateway(callback_secret="s")
    async with httpx.AsyncClient(base_url=base) as client:
        for url in [
            "http://127.0.0.1:9/hook",
            "http://localhost:9/",
            "http://169.254.169.254/latest",
            "http://[::1]:9/",
            "http://10.0.0.1/",
        ]:
            headers = {"Prefer": "respond-async", "X-Callback-Url": url}
            response = await client.post("/v1/functions/classifier", json=INVOCATION, headers=headers)
            assert response.status_code == 400, (url, response.text)
            assert "internal address" in response.json()["error"]
        assert await redis.keys("*result*") == []
    base = await serve_gateway()  # no secret: callbacks are always signed, so there are none
    async with httpx.AsyncClient(base_url=base) as client:
        headers = {"Prefer": "respond-async", "X-Callback-Url": "https://example.com/hook"}
        response = await client.post("/v1/functions/classifier", json=INVOCATION, headers=headers)
        assert response.status_code == 400
        assert "callback_secret" in response.json()["error"]


async def test_a_host_idna_cannot_encode_is_400_at_submission(serve_gateway: Callable[..., Any]) -> None:
    """`http://a..b/` is answered 400, as every URL the gateway could never call (it once raised
    past the handler, leaving the request unanswered)."""
    base = await serve_gateway(callback_secret="s")
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        for url in ["http://a..b/", "https://a..b:8443/hook", "http://" + "x" * 64 + ".example/"]:
            headers = {"Prefer": "respond-async", "X-Callback-Url": url}
            response = await client.post("/v1/functions/classifier", json=INVOCATION, headers=headers)
            assert response.status_code == 400, (url, response.text)
            assert "host" in response.json()["error"]


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def receiver(handle: Handler) -> AsyncIterator[str]:
    """A receiver on loopback, whose connections `handle` serves; yields its URL."""
    tasks: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        try:
            await handle(reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook?from=fngate"
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


LOOPBACK = CallbackPolicy("127.0.0.1")
BODY = b'{"outputs": {}}'
HEADERS = {"Content-Type": "application/json", "X-Fngate-Signature": "t=1,v1=00"}


async def test_an_attempt_delivers_the_signed_body_and_reads_the_status() -> None:
    seen: list[bytes] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        seen.append(head + await reader.readexactly(length))
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    async with receiver(accept) as url:
        assert await post(LOOPBACK, url, BODY, HEADERS, 5.0) == (204, "")
    [request] = seen
    assert request.startswith(b"POST /hook?from=fngate HTTP/1.1\r\n")
    assert b"\r\nX-Fngate-Signature: t=1,v1=00\r\n" in request
    assert request.endswith(b"\r\n\r\n" + BODY)


async def test_a_receiver_that_trickles_its_answer_fails_the_attempt_at_its_deadline() -> None:
    """One byte of the status line every 0.2 s: each read is quick, the attempt is not. It fails
    at the attempt's deadline (1 s here) and the connection is closed, rather than held as long as
    the receiver trickles (a deadline per read never fires)."""
    ended: list[float] = []

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            for byte in b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"y" * 60 + b"\r\n\r\n":  # 16 s in all
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)
        finally:
            ended.append(time.monotonic())

    async with receiver(trickle) as url:
        answered = await post(LOOPBACK, url, BODY, HEADERS, 1.0)
        assert answered == (None, "Timeout")
        for _ in range(100):  # the receiver sees its connection go (bounded: 10 s)
            if ended:
                break
            await asyncio.sleep(0.1)
        assert ended, "the receiver was still held after the attempt ended"


@pytest.mark.parametrize(
    ("answer", "failure"),
    [
        (b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:9/\r\n\r\n", None),  # not followed
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "BadResponse"),
        (b"HTTP/1.1 200 OK\r\n", "IncompleteReadError"),  # closed before its head ended
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 20_000 + b"\r\n\r\n", "LimitOverrunError"),
        (b"", "IncompleteReadError"),
    ],
)
async def test_every_failure_of_an_attempt_is_a_failed_attempt(answer: bytes, failure: str | None) -> None:
    async def answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()

    async with receiver(answer_then_close) as url:
        status, what = await post(LOOPBACK, url, BODY, HEADERS, 5.0)
    if failure is None:
        assert status == 302  # a status outside 2xx: the attempt failed
    else:
        assert (status, what) == (None, failure)


async def test_addresses_that_fail_when_sent_are_failed_attempts() -> None:
    """What the submission checked may not hold when the attempt is made: a name that no longer
    resolves, an address now refused, a port nobody listens on. Each is a failed attempt, never an
    error raised past the sender."""
    async with receiver(lambda reader, writer: asyncio.sleep(0)) as url:
        closed = url  # a port that was listening and is no longer
    cases = [
        (LOOPBACK, "http://a..b/", "RefusedAddress"),
        (LOOPBACK, "http://no-such-host.invalid/hook", "Unresolved"),
        (CallbackPolicy(), closed, "RefusedAddress"),  # loopback, not allowed
        (LOOPBACK, closed, "ConnectionRefusedError"),
    ]
    for policy, url, failure in cases:
        assert await post(policy, url, BODY, HEADERS, 5.0) == (None, failure), url
