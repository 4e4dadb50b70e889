"""Which version answers an invocation that names none: the traffic split, make before break."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from fngate.manifest import FunctionManifest
from fngate.repository import FunctionRecord, FunctionVersion, make_record
from gateway.catalog import choose, route_weights


def record(count: int, versions: dict[str, object]) -> FunctionRecord:
    manifest = FunctionManifest.model_validate(
        {
            "name": "echo",
            "model": {"backend": "python", "path": "model.py"},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
            "versions": versions,
        }
    )
    return make_record(FunctionVersion(manifest, str(number), Path()) for number in range(1, count + 1))


CANARY = {"policy": "latest", "latest": 2, "traffic": {"2": 90, "3": 10}}


@pytest.mark.parametrize(
    ("count", "versions", "ready", "weights"),
    [
        (3, CANARY, {"2", "3"}, {"2": 90, "3": 10}),
        (3, CANARY, set(), {"2": 90, "3": 10}),  # cold: each version wakes on its own invocations
        (3, CANARY, {"2"}, {"2": 100}),  # version 3 still loading: version 2 answers for it
        (3, CANARY, {"3"}, {"2": 90, "3": 10}),  # no older stand-in for 2: it loads on demand
        (3, {}, {"1", "2"}, {"2": 100}),  # a new version replaces the ready previous ones...
        (3, {}, {"3"}, {"3": 100}),
        (3, {}, {"1"}, {"1": 100}),  # ...which keep answering until it is ready
    ],
)
def test_route_weights(
    count: int, versions: dict[str, object], ready: set[str], weights: dict[str, int]
) -> None:
    assert route_weights(record(count, versions), ready) == weights


def test_choose_follows_the_weights() -> None:
    rng = random.Random(7)
    picks = [choose({"1": 90, "2": 10}, rng) for _ in range(10_000)]
    assert 800 < picks.count("2") < 1200
