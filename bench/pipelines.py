"""`python -m bench.pipelines`: the two-step pipeline (normalize, then the classifier) against a
client that calls both functions in turn, on one deployment (a private Redis, one gateway process,
one runner). Closed loop, the same HTTP client for both; latency and throughput per answer."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from bench.deployment import deployment

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = {
    "name": "scored",
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}],
    "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 4]}],
    "batching": {"timeout_ms": 30000},  # the first call pays both cold starts
    "pipeline": {
        "steps": [
            {"name": "norm", "function": "normalize", "inputs": {"input": "request.input"}},
            {"name": "score", "function": "classifier", "inputs": {"input": "norm.normalized"}},
        ],
        "outputs": {"probabilities": "score.probabilities"},
    },
}
ROW = [[float(value) for value in range(16)]]
Call = Callable[[httpx.AsyncClient], Awaitable[None]]


async def pipeline(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/functions/scored", json={"inputs": {"input": ROW}})
    response.raise_for_status()


async def in_turn(client: httpx.AsyncClient) -> None:
    first = await client.post("/v1/functions/normalize", json={"inputs": {"input": ROW}})
    first.raise_for_status()
    normalized = first.json()["outputs"]["normalized"]
    second = await client.post("/v1/functions/classifier", json={"inputs": {"input": normalized}})
    second.raise_for_status()


async def measure(url: str, call: Call, concurrency: int, warmup_s: float, seconds: float) -> dict[str, Any]:
    """Answers per second and latency percentiles (ms) of `call`, `concurrency` clients in a closed loop."""
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        start = time.perf_counter()
        measure_from, until = start + warmup_s, start + warmup_s + seconds

        async def loop() -> None:
            nonlocal errors
            while (now := time.perf_counter()) < until:
                try:
                    await call(client)
                except httpx.HTTPError:
                    errors += 1
                    continue
                if now >= measure_from:
                    latencies.append(time.perf_counter() - now)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    samples = np.asarray(latencies) * 1000
    return {
        "concurrency": concurrency,
        "answers_per_s": len(samples) / seconds,
        "p50_ms": float(np.percentile(samples, 50)),
        "p99_ms": float(np.percentile(samples, 99)),
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per point")
    parser.add_argument("--concurrency", default="1,16", help="closed-loop clients, comma-separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        repo = Path(folder) / "repo"
        for name in ("normalize", "classifier"):
            shutil.copytree(ROOT / "functions" / name, repo / name)
        (repo / "scored").mkdir()
        (repo / "scored" / "function.yaml").write_text(yaml.safe_dump(PIPELINE))
        with deployment(repo, Path(folder) / "logs") as deployed:
            url = deployed.start_gateway(workers=1)
            deployed.start_runner()
            asyncio.run(measure(url, pipeline, 1, 0.0, 1.0))  # both models loaded before anything counts
            asyncio.run(measure(url, in_turn, 1, 0.0, 1.0))
            print(f"{'client':<28} {'conc':>4} {'answers/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
            for concurrency in (int(item) for item in args.concurrency.split(",")):
                for label, call in (("pipeline (one call)", pipeline), ("both functions in turn", in_turn)):
                    row = asyncio.run(measure(url, call, concurrency, 1.0, args.seconds))
                    print(
                        f"{label:<28} {concurrency:>4} {row['answers_per_s']:>10.0f} "
                        f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} {row['errors']:>6}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
