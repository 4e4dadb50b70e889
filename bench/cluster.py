"""Scenario C (`python -m bench --only C`): what Redis spends per invocation on one Redis and on a
Redis Cluster on loopback (3 primaries with a replica each), and how the invocations of 8 functions
spread over the primaries. Eight copies of `tiny`, invoked in turn at c=16 through one gateway (its
workers), one runner serving them all; the same load on each.

On a machine with few cores the cluster cannot serve more (every process shares them); what it
shows is each primary's share of the work, from which the note projects what each primary, on a
core of its own, would carry."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import redis

from bench import loadgen
from bench.deployment import Deployment, cpu_seconds, redis_pid
from bench.models import tiny, write_function
from fngate import keys
from fngate.up.redis_cluster import LocalCluster, running
from fngate.up.supervisor import private_redis

FUNCTIONS = [f"tiny-{index}" for index in range(8)]
CONCURRENCY = 16
Row = dict[str, Any]
Requests = Callable[[str, int, int, bool, int], tuple[list[loadgen.Outgoing], np.ndarray]]
Record = Callable[[Row], None]


def build_repository(repo: Path) -> None:
    model = tiny()
    for name in FUNCTIONS:
        write_function(repo, name, model, 16, max_batch_size=64, max_queue_delay_us=0)


def run(folder: Path, requests_for: Requests, measure_s: float, record: Record) -> None:
    """Both deployments, one after the other, each on a repository of the 8 functions."""
    print("C  Redis CPU per invocation: one Redis, then a cluster of 3 primaries", flush=True)
    repo = folder / "cluster-repo"
    build_repository(repo)
    requests, inputs = interleaved(requests_for)
    with private_redis() as url, started(Deployment(url, repo, folder / "logs-one")) as deployed:
        pid, node = redis_pid(url), redis.Redis.from_url(url)
        row = measure(deployed, requests, inputs, measure_s, lambda: {"redis": cpu_seconds(pid)}, [node])
        record({"scenario": "C", "redis": "one", **row})
    with running(folder / "cluster", primaries=3, replicas=1) as cluster:
        deployed = Deployment(cluster.url, repo, folder / "logs-cluster")
        primaries = [cluster.node(port) for port in cluster.primaries()]
        with started(deployed):
            row = measure(deployed, requests, inputs, measure_s, lambda: node_cpu(cluster), primaries)
        record({"scenario": "C", "redis": "cluster", **row, **spread(cluster)})


def interleaved(requests_for: Requests) -> tuple[list[loadgen.Outgoing], np.ndarray]:
    """Requests of each function in turn, 2,000 of each, with inputs of their own."""
    made = [requests_for(name, 16, 2000, True, index) for index, name in enumerate(FUNCTIONS)]
    turns = zip(*(found for found, _ in made), strict=True)
    rows = zip(*(found for _, found in made), strict=True)
    return [request for turn in turns for request in turn], np.stack([row for turn in rows for row in turn])


@contextlib.contextmanager
def started(deployed: Deployment) -> Iterator[Deployment]:
    deployed.logs.mkdir(parents=True, exist_ok=True)
    try:
        deployed.start_gateway()
        deployed.start_runner()
        yield deployed
    finally:
        deployed.stop()


def measure(
    deployed: Deployment,
    requests: list[loadgen.Outgoing],
    inputs: np.ndarray,
    measure_s: float,
    cpu: Callable[[], dict[str, float]],
    primaries: list[redis.Redis],
) -> Row:
    """Redis CPU over a run of `measure_s` (after a run that loads the 8 models), per invocation;
    and what the primaries ran for it (INFO commandstats): script calls and the commands' own time
    per invocation."""
    port = int(deployed.urls()[0].rsplit(":", 1)[1])

    def check(index: int, status: int, body: bytes) -> str | None:
        got = np.frombuffer(body[-64:], dtype=np.float32)  # the binary output: 16 FP32 values
        return None if np.allclose(got, inputs[index % len(inputs)].ravel() * 2) else "wrong answer"

    warm = asyncio.run(loadgen.run("127.0.0.1", port, requests, CONCURRENCY, 0.0, 2.0, max_requests=400))
    if warm.errors:
        raise RuntimeError(f"the warm-up had {warm.errors} errors: {warm.error_sample}")
    for node in primaries:
        node.config_resetstat()
    before = cpu()
    limit = len(requests)
    result = asyncio.run(
        loadgen.run("127.0.0.1", port, requests, CONCURRENCY, 0.0, measure_s, check, max_requests=limit)
    )
    after = cpu()
    commands = [node.info("commandstats") for node in primaries]
    used = {name: after[name] - before[name] for name in before}
    completed = max(result.completed, 1)
    row: Row = {
        "functions": len(FUNCTIONS),
        "concurrency": CONCURRENCY,
        "req_per_s": result.throughput,
        "p50_ms": result.percentile_ms(50),
        "p99_ms": result.percentile_ms(99),
        "errors": result.errors,
        "checked": result.checked,
        "cpu_us_redis": sum(used.values()) / completed * 1e6,
        "scripts_per_invocation": sum(stats.get("cmdstat_evalsha", {}).get("calls", 0) for stats in commands)
        / completed,
        "command_us_per_invocation": sum(entry["usec"] for stats in commands for entry in stats.values())
        / completed,
    }
    for name, seconds in used.items():
        row[f"cpu_us_{name}"] = seconds / completed * 1e6
        row[f"cores_{name}"] = seconds / result.duration_s
    return row


def node_cpu(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds of each node, named by role and port ('primary-7000', 'replica-7003')."""
    primaries = cluster.primaries()
    return {
        f"{'primary' if port in primaries else 'replica'}-{port}": cpu_seconds(process.pid)
        for port, process in cluster.processes.items()
    }


def spread(cluster: LocalCluster) -> Row:
    """Which primary holds each function's slot, and how many functions each holds."""
    holders = {name: cluster.primary_of(keys.invocations(name)) for name in FUNCTIONS}
    counts = collections.Counter(holders.values())
    primaries = sorted(cluster.primaries())
    return {
        "functions_per_primary": ",".join(f"{port}:{counts.get(port, 0)}" for port in primaries),
        "slots": ",".join(f"{name}:{keys.slot(keys.invocations(name))}" for name in FUNCTIONS),
    }
