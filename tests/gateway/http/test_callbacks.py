"""Callback delivery: the signature a receiver checks, the retry schedule, and the addresses a
callback may reach (refused at submission, before anything is queued)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from fngate.errors import InvalidArgument
from gateway.destinations import CallbackPolicy, parse
from gateway.http.callbacks import MAX_ATTEMPTS, retry_delay_s, signature


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
    ["ftp://example.com/", "http:///nohost", "http://user:pw@example.com/", "http://example.com:99999/"],
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
