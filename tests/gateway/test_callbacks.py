"""Pure parts of callback delivery: the signature a receiver checks, and the retry schedule."""

from __future__ import annotations

import hashlib
import hmac

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
