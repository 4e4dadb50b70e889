"""Scenario M of `python -m bench`: Redis's memory under a mixed load for minutes. A gateway and a
runner on a Redis run as `fngate up` runs it (maxmemory, noeviction), the tiny function invoked by
closed-loop clients: 90% synchronous, 10% asynchronous (submitted, then collected with a
long-poll). Redis's used_memory is sampled every 30 s; the growth per minute is the bar (the
issue's: under 5 MB a minute at ~1,030 invocations a second). Then a short phase past a small
result quota: its submissions get 429, and every one accepted is collected (none lost)."""

from __future__ import annotations

import asyncio
import functools
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.deployment import Deployment
from fngate import keys, queue
from fngate.up.supervisor import start_redis

Row = dict[str, Any]
BODY = {"inputs": {"input": [[0.5] * 16]}}
ASYNC = {"Prefer": "respond-async"}
SOAK_S = 180.0
SAMPLE_S = 30.0
MAX_MEMORY = "1gb"


class Counts:
    def __init__(self) -> None:
        self.sync = self.submitted = self.collected = self.refused = self.failed = 0
        self.accepted: list[str] = []


async def _client(
    client: httpx.AsyncClient, share_async: float, until: float, counts: Counts, collect: bool
) -> None:
    rng = random.Random()
    while time.monotonic() < until:
        if rng.random() >= share_async:
            response = await client.post("/v1/functions/tiny", json=BODY)
            counts.sync += response.status_code == 200
            counts.failed += response.status_code != 200
            continue
        response = await client.post("/v1/functions/tiny", json=BODY, headers=ASYNC)
        if response.status_code == 429:
            counts.refused += 1
            await asyncio.sleep(0.05)
            continue
        if response.status_code != 202:
            counts.failed += 1
            continue
        counts.submitted += 1
        invocation = response.json()["id"]
        counts.accepted.append(invocation)
        if collect:
            result = await client.get(f"/v1/invocations/{invocation}", params={"wait": 10})
            counts.collected += result.status_code == 200
            counts.failed += result.status_code != 200


def _used(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def soak(
    repo: Path, logs: Path, record: Callable[[Row], None], seconds: float = SOAK_S, concurrency: int = 32
) -> None:
    """The soak, then the quota phase, each on a Redis of its own (run as `fngate up` runs it)."""
    logs.mkdir(parents=True, exist_ok=True)
    phases: list[Callable[[Deployment], None]] = [
        functools.partial(_soak, record=record, seconds=seconds, concurrency=concurrency),
        functools.partial(_past_the_quota, record=record, concurrency=concurrency),
    ]
    for phase in phases:
        with tempfile.TemporaryDirectory(prefix="fngate-soak-") as folder:
            options = ("--maxmemory", MAX_MEMORY, "--maxmemory-policy", "noeviction")
            process, url = start_redis(Path(folder), *options)
            deployed = Deployment(url, repo, logs)
            try:
                phase(deployed)
            finally:
                deployed.stop()
                process.terminate()
                process.wait(timeout=10)


def _soak(deployed: Deployment, record: Callable[[Row], None], seconds: float, concurrency: int) -> None:
    base = deployed.start_gateway()
    deployed.start_runner()
    client = redis.Redis.from_url(deployed.redis_url)
    httpx.post(f"{base}/v1/functions/tiny", json=BODY, timeout=60)  # loaded before the clock starts
    counts = Counts()
    samples: list[tuple[float, int]] = []

    async def run() -> None:
        started = time.monotonic()
        until = started + seconds
        # Every connection kept alive: past max_keepalive_connections, or idle past keepalive_expiry,
        # httpcore 1.0 may close a connection it has just handed to a request (encode/httpcore#1110):
        # a ReadError that is not the server's.
        limits = httpx.Limits(
            max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=None
        )
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:
            clients = [
                asyncio.create_task(_client(http, 0.1, until, counts, True)) for _ in range(concurrency)
            ]
            while time.monotonic() < until:
                samples.append((time.monotonic() - started, await asyncio.to_thread(_used, client)))
                print(
                    f"M  {samples[-1][0]:6.0f} s  used_memory {samples[-1][1] / 2**20:8.2f} MiB", flush=True
                )
                await asyncio.sleep(min(SAMPLE_S, max(0.0, until - time.monotonic())))
            await asyncio.gather(*clients)
        samples.append((time.monotonic() - started, await asyncio.to_thread(_used, client)))

    asyncio.run(run())
    stored = list(client.scan_iter(match=queue.stored_result(keys.result("*")), count=1000))[:200]
    per_result = sum(int(client.memory_usage(key) or 0) for key in stored) / max(1, len(stored))
    (first_s, first), (last_s, last) = samples[1] if len(samples) > 2 else samples[0], samples[-1]
    growth = (last - first) / max(1e-9, (last_s - first_s) / 60)
    rate = (counts.sync + counts.submitted) / seconds
    async_per_s = counts.submitted / seconds
    # What each result added to Redis as it ran (after the first sample: the bells and the queues'
    # first nodes are made by then), and that at the rate of asynchronous invocations.
    in_redis = (last - first) / max(1.0, async_per_s * (last_s - first_s))
    row = {
        "scenario": "M",
        "seconds": seconds,
        "invocations_per_s": round(rate, 1),
        "async_per_s": round(async_per_s, 1),
        "synchronous": counts.sync,
        "asynchronous": counts.submitted,
        "collected": counts.collected,
        "failed": counts.failed,
        "samples_mib": [(round(at, 1), round(used / 2**20, 2)) for at, used in samples],
        "growth_mb_per_min": round(growth / 1e6, 2),
        "growth_from_start_mb_per_min": round(
            (last - samples[0][1]) / max(1e-9, (last_s - samples[0][0]) / 60) / 1e6, 2
        ),
        "stored_result_bytes": round(per_result),
        "bytes_in_redis_per_result": round(in_redis),
        "growth_at_103_async_per_s_mb_per_min": round(in_redis * 103 * 60 / 1e6, 2),
    }
    record(row)
    print(
        f"M  {rate:.0f} invocations/s ({row['async_per_s']}/s asynchronous), {counts.failed} failed; "
        f"Redis grew {row['growth_mb_per_min']} MB a minute after the first sample, "
        f"{row['bytes_in_redis_per_result']} B a result (a stored result alone: "
        f"{row['stored_result_bytes']} B): {row['growth_at_103_async_per_s_mb_per_min']} MB a minute "
        "at 103 asynchronous a second, the issue's rate, for as long as results are kept",
        flush=True,
    )


def _past_the_quota(deployed: Deployment, record: Callable[[Row], None], concurrency: int) -> None:
    """Asynchronous submissions only, never collected, against a quota of 256 KiB a key: they get
    429 once it is held; every accepted one has its result."""
    base = deployed.start_gateway(FNGATE_RESULT_QUOTA_BYTES=str(256 * 1024))
    deployed.start_runner()
    counts = Counts()

    async def run() -> None:
        until = time.monotonic() + 15
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            await asyncio.gather(*(_client(http, 1.0, until, counts, False) for _ in range(concurrency)))
            lost = 0
            for invocation in counts.accepted:
                result = await http.get(f"/v1/invocations/{invocation}", params={"wait": 10})
                lost += result.status_code != 200
            counts.failed += lost

    asyncio.run(run())
    row = {
        "scenario": "M-quota",
        "accepted": counts.submitted,
        "refused_429": counts.refused,
        "lost": counts.failed,
    }
    record(row)
    print(
        f"M  past a 256 KiB result quota: {counts.submitted} accepted, {counts.refused} refused (429), "
        f"{counts.failed} accepted and not answered",
        flush=True,
    )
