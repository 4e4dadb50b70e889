"""What an Idempotency-Key is bound to (gateway.invocations.request_digest)."""

from __future__ import annotations

import pytest

from gateway.invocations import request_digest


@pytest.mark.parametrize(
    "other",
    [
        ("g", "v1", b'{"inputs": {"x": [1]}}'),  # another function
        ("f", "v2", b'{"inputs": {"x": [1]}}'),  # another route
        ("f", "v1", b'{"inputs": {"x": [2]}}'),  # another body
        ("fv", "1", b'{"inputs": {"x": [1]}}'),  # the same bytes, split differently
    ],
)
def test_another_request_has_another_digest(other: tuple[str, str, bytes]) -> None:
    first = request_digest("f", "v1", b'{"inputs": {"x": [1]}}')
    assert request_digest("f", "v1", b'{"inputs": {"x": [1]}}') == first
    assert request_digest(*other) != first
    assert " " not in first  # it is stored beside the invocation id, space-separated
