"""Scenario P of `python -m bench`: what one poison invocation in a batch costs the fifteen innocent
ones beside it. Each round keeps the function busy for a second (an invocation that sleeps, or
loops in onnxruntime), sends sixteen invocations meanwhile (they form one batch when it is done),
and times the innocents from their send to their answer; a round without a poison is the baseline.
The extra latency is what splitting the failed batch (each invocation run again alone) adds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from bench.models import BUSY_TURNS, POISON_ROWS

Row = dict[str, Any]
ROUNDS = {
    # name: (function, the busy invocation's x, the poison's x[0] (None: no poison))
    "python, no poison": ("poison", [-6.0, 1.0, 2.0, 3.0], None),
    "python, its process exits": ("poison", [-6.0, 1.0, 2.0, 3.0], -3.0),
    "python, it hangs (500 ms timeout)": ("poison", [-6.0, 1.0, 2.0, 3.0], -4.0),
    "python, over memory_limit_mb": ("poison", [-6.0, 1.0, 2.0, 3.0], -5.0),
    "onnx, no poison": ("pick", [1.0, BUSY_TURNS, 2.0, 3.0], None),
    "onnx, onnxruntime fails on it": ("pick", [1.0, BUSY_TURNS, 2.0, 3.0], 1000.0),
}


async def _round(client: httpx.AsyncClient, function: str, busy: list[float], poison: float | None) -> Row:
    path = f"/v1/functions/{function}"
    occupying = asyncio.create_task(client.post(path, json={"inputs": {"x": [busy]}}))
    await asyncio.sleep(0.3)  # it runs; what comes now waits, and then forms one batch

    async def timed(first: float) -> tuple[float, httpx.Response]:
        started = time.perf_counter()
        response = await client.post(path, json={"inputs": {"x": [[first, 1.0, 2.0, 3.0]]}})
        return time.perf_counter() - started, response

    firsts = [float(index % 10) for index in range(POISON_ROWS)]
    if poison is not None:
        firsts[POISON_ROWS // 2] = poison
    answers = await asyncio.gather(*(timed(first) for first in firsts))
    await occupying
    innocents = [(first, *answer) for first, answer in zip(firsts, answers, strict=True) if first != poison]
    innocent = [seconds for first, seconds, response in innocents if _doubled(response, first)]
    return {
        "innocents_ok": len(innocent),
        "innocents_failed": len(innocents) - len(innocent),
        "statuses": sorted({response.status_code for _, response in answers}),
        "innocent_p50_ms": float(np.median(innocent) * 1000) if innocent else float("nan"),
        "innocent_max_ms": float(np.max(innocent) * 1000) if innocent else float("nan"),
    }


async def _warm(client: httpx.AsyncClient, function: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    body = {"inputs": {"x": [[1.0, 1.0, 2.0, 3.0]]}}
    while (await client.post(f"/v1/functions/{function}", json=body)).status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{function} did not answer within {timeout_s} s")
        await asyncio.sleep(0.5)


def _doubled(response: httpx.Response, first: float) -> bool:
    return response.status_code == 200 and response.json()["outputs"]["y"][0][0] == first * 2


def poison_rounds(base: str, record: Callable[[Row], None], repeats: int = 3) -> None:
    """Every round `repeats` times (their medians recorded), python and onnx, with its baseline."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            for function in ("poison", "pick"):  # known to the gateway and loaded before anything is timed
                await _warm(client, function)
            baseline: dict[str, float] = {}
            for name, (function, busy, poison) in ROUNDS.items():
                rows = [await _round(client, function, busy, poison) for _ in range(repeats)]
                p50 = float(np.median([row["innocent_p50_ms"] for row in rows]))
                worst = float(np.median([row["innocent_max_ms"] for row in rows]))
                if poison is None:
                    baseline[function] = p50
                row = {
                    "scenario": "P",
                    "round": name,
                    "innocents_ok": sum(item["innocents_ok"] for item in rows),
                    "innocents_failed": sum(item["innocents_failed"] for item in rows),
                    "innocent_p50_ms": round(p50, 1),
                    "innocent_max_ms": round(worst, 1),
                    "extra_p50_ms": round(p50 - baseline[function], 1),
                    "statuses": sorted({status for item in rows for status in item["statuses"]}),
                }
                record(row)
                print(
                    f"P  {name:<36} innocents {row['innocents_ok']:>2} ok {row['innocents_failed']} failed  "
                    f"p50 {p50:8.1f} ms  max {worst:8.1f} ms  extra p50 {row['extra_p50_ms']:8.1f} ms",
                    flush=True,
                )

    asyncio.run(run())
