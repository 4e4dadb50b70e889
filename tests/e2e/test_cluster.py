"""fngate on a Redis Cluster: two gateways whose invocations batch together while a runner is killed
mid-batch, then the cluster changing under load: the primary that holds a function's slot killed
(its replica takes over), and that slot moved to another primary. Every invocation is counted:
answered correctly, refused with an error, or lost. (The other main paths on a cluster are the e2e
tests marked on_cluster_too.)"""

from __future__ import annotations

import asyncio
import collections
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from fngate import keys
from fngate.up.redis_cluster import LocalCluster
from tests.conftest import EVERY_CONNECTION_KEPT, wait_http

pytestmark = [pytest.mark.cluster, pytest.mark.parametrize("redis_url", ["cluster"], indirect=True)]
WORKERS = 12
TIMEOUT_MS = 4000
"""Each invocation's own deadline: one whose entry or reply the dead primary took with it is
answered 504 at this, not at the function's 20 s."""
RUNNER = {
    "FNGATE_FUNCTIONS": '["probe"]',
    "PROBE_SLEEP_S": "0.01",
    "FNGATE_CLAIM_IDLE_MS": "1000",
    "FNGATE_CLAIM_INTERVAL_MS": "200",
}


RECOVERY_S = 30.0
"""How long after the failover the first invocation must be answered again."""


class Tally:
    """Every invocation's outcome: 'answered' (its own rows, doubled), 'wrong' (someone else's
    answer), an error ('503 unavailable'...), or 'lost' (no answer at all)."""

    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.failures_after: list[float] = []
        """When (monotonic) each error came."""

    async def invoke(self, client: httpx.AsyncClient, value: float, base: str = "") -> bool:
        body = {"inputs": {"x": [[value, 1.0, 2.0, 3.0]]}, "timeout_ms": TIMEOUT_MS}
        try:
            response = await client.post(f"{base}/v1/functions/probe", json=body)
        except httpx.HTTPError:
            self.outcomes["lost"] += 1
            return False
        if response.status_code == 200:
            right = response.json()["outputs"]["y"] == [[value * 2, 2.0, 4.0, 6.0]]
            self.outcomes["answered" if right else "wrong"] += 1
            return right
        self.outcomes[f"{response.status_code} {response.json().get('code')}"] += 1
        self.failures_after.append(time.monotonic())
        return False

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())


def tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({exc})"


async def load(client: httpx.AsyncClient, tally: Tally, until: Callable[[], bool]) -> None:
    """WORKERS callers, each invoking with an input of its own until `until()`."""
    serial = iter(range(1, 10**9))

    async def worker() -> None:
        while not until():
            await tally.invoke(client, float(next(serial)))

    await asyncio.gather(*(worker() for _ in range(WORKERS)))


async def submit_async(client: httpx.AsyncClient, value: float) -> str | None:
    body = {"inputs": {"x": [[value, 0.0, 0.0, 0.0]]}}
    response = await client.post("/v1/functions/probe", json=body, headers={"Prefer": "respond-async"})
    return str(response.json()["id"]) if response.status_code == 202 else None


async def async_outcome(client: httpx.AsyncClient, invocation_id: str, value: float) -> str:
    """What became of an accepted asynchronous invocation: 'answered', 'wrong', an error, or
    'lost' (its result is gone: the primary took it with it before its replica had it)."""
    deadline = time.monotonic() + 30
    while True:
        response = await client.get(f"/v1/invocations/{invocation_id}", params={"wait": 5})
        if response.status_code != 202 or time.monotonic() > deadline:
            break
    if response.status_code == 404:
        return "lost"
    if response.status_code == 200:
        return "answered" if response.json()["outputs"]["y"] == [[value * 2, 0.0, 0.0, 0.0]] else "wrong"
    return f"{response.status_code} {response.json().get('code')}"


async def warm(client: httpx.AsyncClient, base: str = "") -> None:
    """Until the runner answers (its first load), through the gateway at `base` (or the client's)."""
    deadline = time.monotonic() + 60
    while not await Tally().invoke(client, 0.5, base):
        assert time.monotonic() < deadline, "the runner never answered"
        await asyncio.sleep(0.1)


async def test_two_gateways_batch_together_and_a_runner_killed_mid_batch_loses_nothing(
    gateway_process: Callable[..., str],
    runner_process: Callable[..., Any],
    redis: aioredis.Redis,
) -> None:
    """The replies of one batch go to two gateways' reply streams, in other slots than the
    function's (DELIVER, then FINISH); a runner SIGKILLed with entries pending leaves them to the
    other, which runs them again: each caller hears once, with its own rows."""
    bases = [gateway_process(), gateway_process()]
    for base in bases:
        await wait_http(base)
    env = {**RUNNER, "PROBE_SLEEP_S": "0.3", "FNGATE_CLAIM_INTERVAL_MS": "100"}
    runners = [runner_process(**env), runner_process(**env)]
    stream = keys.invocations("probe")
    origins: dict[str, set[int]] = collections.defaultdict(set)

    async with httpx.AsyncClient(timeout=30, limits=EVERY_CONNECTION_KEPT) as client:

        async def call(index: int) -> None:
            value = float(index)
            response = await client.post(
                f"{bases[index % 2]}/v1/functions/probe", json={"inputs": {"x": [[value, 1.0, 2.0, 3.0]]}}
            )
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["outputs"]["y"] == [[value * 2, 2.0, 4.0, 6.0]]
            origins[body["batch"]["id"]].add(index % 2)

        for base in bases:  # models loaded, so that the invocations queue on both at once
            await warm(client, base)
        origins.clear()
        calls = [asyncio.create_task(call(index)) for index in range(40)]  # max_queue_size is 50
        consumers: list[Any] = []
        deadline = time.monotonic() + 30
        while not any(consumer["pending"] > 0 for consumer in consumers):
            assert time.monotonic() < deadline, "no runner took invocations"
            await asyncio.sleep(0.05)
            try:
                consumers = await redis.xinfo_consumers(stream, keys.RUNNER_GROUP)
            except ResponseError:  # no runner has made the group yet
                consumers = []
        victim_name = next(consumer["name"] for consumer in consumers if consumer["pending"] > 0)
        victim = next(runner for runner in runners if runner.pid == int(victim_name.decode().split("-")[-2]))
        victim.send_signal(signal.SIGKILL)
        await asyncio.gather(*calls)
    assert victim.wait(timeout=5) == -signal.SIGKILL
    assert any(seen == {0, 1} for seen in origins.values()), f"no batch served both gateways: {origins}"
    assert await drained(redis, stream) == (0, 0)


async def drained(redis: aioredis.Redis, stream: str, timeout_s: float = 30) -> tuple[int, int]:
    """(entries, pending) of the function's stream once both are 0, or at `timeout_s`. A caller
    hears its answer before its entry leaves the stream: on a Redis Cluster a batch's replies are
    delivered first (DELIVER, on the reply streams' slots), then FINISH acknowledges and deletes
    its entries; and entries whose replies the killed runner delivered before it died stay pending
    until the other runner claims them (claim_idle_ms), runs them again and finishes them. Both
    settle by themselves, just after the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = (await redis.xlen(stream), (await redis.xpending(stream, keys.RUNNER_GROUP))["pending"])
        if left == (0, 0) or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.1)


async def test_the_primary_of_a_functions_slot_killed_under_load(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    redis_cluster: LocalCluster,
    redis: aioredis.Redis,
    tmp_path: Path,
) -> None:
    base = await serve_gateway()
    runner_process(**RUNNER)
    victim = redis_cluster.primary_of(keys.invocations("probe"))
    tally = Tally()
    accepted: list[tuple[str, float]] = []
    try:
        async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT_MS / 1000 + 10) as client:
            await wait_http(base)
            await warm(client)
            started = time.monotonic()
            killed_at = started + 1.0
            recovered: list[float] = []

            async def kill_and_submit() -> None:
                for index in range(20):  # asynchronous ones too, before and after the kill
                    if index == 10:
                        await asyncio.sleep(max(0.0, killed_at - time.monotonic()))
                        await asyncio.to_thread(redis_cluster.kill, victim)
                    found = await submit_async(client, 1000.0 + index)
                    if found is not None:
                        accepted.append((found, 1000.0 + index))
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(redis_cluster.wait_for_failover, victim)  # the replica took over
                recovered.append(time.monotonic())

            def until() -> bool:  # a second of load after the failover
                return bool(recovered) and time.monotonic() > recovered[0] + 1.0

            await asyncio.gather(load(client, tally, until), kill_and_submit())
            # Gateways and runners find the new primary by themselves (no restart): on a busy
            # machine that can take longer than the second of load above.
            probe, deadline = Tally(), time.monotonic() + RECOVERY_S
            while not await probe.invoke(client, 4000.0):
                assert time.monotonic() < deadline, (
                    f"not served again: {dict(probe.outcomes)}; primaries {redis_cluster.primaries()}; "
                    f"the runner's log ends:\n{tail(tmp_path / 'runner-0.log')}"
                )
                await asyncio.sleep(0.2)
            recovery_s = time.monotonic() - recovered[0]
            settled = Tally()  # once the replica took over, everything is served again
            for value in range(40):
                await settled.invoke(client, 5000.0 + value)
            ended = collections.Counter(
                [await async_outcome(client, invocation, value) for invocation, value in accepted]
            )
    finally:
        # Back as a replica, for the tests after this one.
        await asyncio.to_thread(redis_cluster.restart, victim)
        await asyncio.to_thread(redis_cluster.wait_until_healthy)
        await asyncio.to_thread(redis_cluster.wait_for_replicas)
    print(f"\nfailover: synchronous {dict(tally.outcomes)}; asynchronous {len(accepted)}: {dict(ended)}")
    print(f"served again {recovery_s:.1f} s after the cluster was healthy")
    assert tally.outcomes["wrong"] == 0 and tally.outcomes["lost"] == 0, tally.outcomes
    assert set(tally.outcomes) <= {"answered", "503 unavailable", "504 deadline_exceeded"}, tally.outcomes
    assert tally.outcomes["answered"] > 100
    assert settled.outcomes == {"answered": 40}, settled.outcomes
    assert ended["wrong"] == 0 and sum(ended.values()) == len(accepted)
    assert set(ended) <= {"answered", "lost", "504 deadline_exceeded"}, ended


async def test_a_functions_slot_moved_while_invocations_run(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    redis_cluster: LocalCluster,
    redis: aioredis.Redis,
) -> None:
    base = await serve_gateway()
    runner_process(**RUNNER)
    stream = keys.invocations("probe")
    source = redis_cluster.primary_of(stream)
    target = next(port for port in redis_cluster.primaries() if port != source)
    tally = Tally()
    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT_MS / 1000 + 10) as client:
        await wait_http(base)
        await warm(client)

        async def move_soon() -> None:  # a key at a time, its slot split between two nodes meanwhile
            await asyncio.sleep(1.0)
            await asyncio.to_thread(redis_cluster.move_slot, keys.slot(stream), target, 1, 0.05)

        moving = asyncio.create_task(move_soon())
        await load(client, tally, moving.done)
        await moving
        for value in range(20):
            await tally.invoke(client, 9000.0 + value)
    assert redis_cluster.primary_of(stream) == target
    assert tally.outcomes == {"answered": tally.total}, tally.outcomes
    assert tally.total > 50
