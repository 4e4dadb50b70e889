"""Which version answers an invocation that names none: the traffic split, make before break; and
a deploy announced on the control stream read at once, whenever it comes."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from fngate import clients
from fngate.manifest import FunctionManifest
from fngate.registry import ControlOp, send_control
from fngate.repository import FunctionRecord, FunctionVersion, make_record
from gateway.catalog import Catalog, choose, route_weights


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


async def nothing() -> dict[str, FunctionRecord]:
    return {}


async def test_a_deploy_announced_while_the_catalog_is_being_read_is_news_at_once(
    redis: aioredis.Redis,
) -> None:
    """Another gateway deploys while this one re-reads its catalog, between two waits on the control
    stream: the next wait takes it at once, not an interval later (until then the function answered
    404 here)."""
    catalog = Catalog(nothing, redis)
    assert not await catalog.news(0.05)  # nothing announced yet: the catalog re-reads on time
    await send_control(redis, ControlOp("deploy", "echo", ("1",)))  # while it re-reads
    async with asyncio.timeout(10):
        assert await catalog.news(60)


async def test_an_interval_longer_than_the_socket_timeout_is_waited_in_shorter_reads(redis_url: str) -> None:
    """FNGATE_CATALOG_REFRESH_S above the reader's socket timeout: the catalog still waits out its
    interval (in reads that each block less), with no timeout taken for a Redis that is gone."""
    client = clients.connect(redis_url, socket_timeout=0.5)
    try:
        catalog = Catalog(nothing, client, block_s=0.2)
        assert not await catalog.news(1.5)
        await send_control(client, ControlOp("deploy", "echo", ("1",)))
        assert await catalog.news(1.5)
    finally:
        await client.aclose()


class TakesCancellationForATimeout(aioredis.Redis):
    """A client whose read, cancelled, fails as a timeout of its own: a client call can take the
    cancellation for a failure."""

    async def xread(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().xread(*args, **kwargs)
        except asyncio.CancelledError:
            raise redis.exceptions.TimeoutError("Timeout reading from the server") from None


async def test_the_loop_ends_when_cancelled_in_a_call_that_takes_it_for_a_failure(redis_url: str) -> None:
    """Cancelled during its wait on the control stream, the catalog's loop ends, even where the
    call reports the cancellation as a Redis timeout: it does not back off and retry past its
    gateway's shutdown on a closed client."""
    client = TakesCancellationForATimeout.from_url(redis_url, socket_timeout=10)
    try:
        catalog = Catalog(nothing, client, block_s=3.0)
        loop = asyncio.create_task(catalog.run(30))
        await asyncio.sleep(0.5)  # blocked in its read
        loop.cancel()
        await asyncio.wait([loop], timeout=5)
        try:
            assert loop.cancelled()
            assert catalog.health.last_error == ""  # the cancellation was not taken for an outage
        finally:
            loop.cancel()  # one that went on: once more, while it backs off
            await asyncio.wait([loop], timeout=5)
    finally:
        await client.aclose()
