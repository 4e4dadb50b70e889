"""What an Idempotency-Key is bound to (gateway.invocations.request_digest), and what a result
renders."""

from __future__ import annotations

import dataclasses
from typing import cast

import numpy as np
import orjson
import pytest

from fngate import queue
from fngate.wire import Reply
from gateway.catalog import Catalog
from gateway.http.results import render
from gateway.invocations import AsyncInvocation, request_digest


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


def test_a_pipelines_result_holds_only_the_outputs_asked_for() -> None:
    """A pipeline's last step answers every output; the submission records the ones asked for."""
    submission = AsyncInvocation("0" * 32, "p", "1", "v1", "k", 2**62, outputs=("b",))
    assert AsyncInvocation.decode(submission.encode()) == submission
    outputs = {"a": np.ones((1, 2), np.float32), "b": np.zeros((1, 2), np.float32)}
    reply = Reply("0" * 32, "1", outputs, None)
    result = queue.Result(submission.encode(), False, dict(reply.encode()))
    status, headers, body = render(result, cast(Catalog, None))  # the v1 shape needs no manifest
    assert (status, headers["x-fngate-state"]) == (200, "done")
    assert orjson.loads(body)["outputs"] == {"b": [[0.0, 0.0]]}
    everything = dataclasses.replace(submission, outputs=None)  # a function's: as it comes
    _status, _headers, body = render(
        dataclasses.replace(result, record=everything.encode()), cast(Catalog, None)
    )
    assert sorted(orjson.loads(body)["outputs"]) == ["a", "b"]
