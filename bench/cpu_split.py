"""Where one invocation's CPU goes: a private redis-server, one gateway process and one runner (as
the benchmark runs them), driven by the bench's closed-loop load generator over HTTP with one-row
tiny invocations, V2 JSON and then binary, at 16 clients. For each: requests per second; user and
system CPU microseconds per request of the gateway, the runner, Redis and this client (from /proc);
the batches the runner ran (the function's Triton statistics: execution_count) and the runner's and
Redis's CPU per batch, which tell a cost paid per batch from one paid per invocation; and Redis's
commands per request with their microseconds (INFO commandstats: a script's time includes the
commands it calls, which are also counted under their own names).

  python -m bench.cpu_split [--measure-s S] [--clients N] [--one-entry-each] [--server hypercorn]
                            [--profile DIR]

--one-entry-each runs the gateway with FNGATE_GROUP_INVOCATIONS=false: each invocation its own
stream entry, as before a turn's invocations shared one (for the comparison, in one sitting);
--server hypercorn serves HTTP with Hypercorn (the invocation routes through ASGI); --profile DIR
starts the gateway and the runner under cProfile, writes DIR/gateway-0.prof and DIR/runner-0.prof,
and prints for each the functions with most time under them as shares of the process's profiled
time (the profiler about doubles every CPU figure above; the shares are what it tells; more with
`python -m pstats DIR/gateway-0.prof`).

Loopback only; it stops by itself. Figures move with the machine's load: compare runs of one sitting."""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bench import loadgen
from bench.__main__ import requests_for
from bench.deployment import Deployment, deployment, redis_pid
from bench.models import build_repository
from fngate import keys

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


MODEL = "tiny"


def executions(client: redis.Redis, function: str) -> int:
    """The batches run so far of every version of `function` (Triton's execution_count)."""
    total = 0
    for key in client.scan_iter(match=keys.statistics(function, "*")):
        total += int(client.hget(key, "execution_count") or 0)
    return total


def user_system_s(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def client_s() -> tuple[float, float]:
    times = os.times()
    return times.user, times.system


def split(deployed: Deployment, port: int, binary: bool, clients: int, measure_s: float) -> None:
    requests, _ = requests_for(MODEL, 16, 2000, binary, seed=5)
    asyncio.run(loadgen.run("127.0.0.1", port, requests, clients, 3.0, 2.0))  # warm
    readers: dict[str, Callable[[], tuple[float, float]]] = {
        "gateway": lambda: user_system_s(deployed.gateways[0][0].pid),
        "runner": lambda: user_system_s(deployed.runners[0].pid),
        "redis": lambda: user_system_s(redis_pid(deployed.redis_url)),
        "client": client_s,
    }
    with redis.Redis.from_url(deployed.redis_url) as client:
        client.config_resetstat()
        batches_before = executions(client, MODEL)
        before = {name: read() for name, read in readers.items()}
        result = asyncio.run(loadgen.run("127.0.0.1", port, requests, clients, 0.0, measure_s))
        after = {name: read() for name, read in readers.items()}
        batches = executions(client, MODEL) - batches_before
        stats: dict[str, Any] = client.info("commandstats")
    count = len(result.latencies_ns)
    print(f"{'binary' if binary else 'V2 JSON'}: {count / measure_s:,.0f} req/s, {result.errors} errors")
    print(f"  batches  {batches:,} ({count / max(batches, 1):.1f} invocations a batch)")
    for name in readers:
        user = (after[name][0] - before[name][0]) / count * 1e6
        system = (after[name][1] - before[name][1]) / count * 1e6
        per_batch = ""
        if name in ("runner", "redis") and batches:
            spent = sum(after[name]) - sum(before[name])
            per_batch = f"  user + system {spent / batches * 1e6:6.1f} µs/batch"
        print(f"  {name:8} user {user:6.1f} µs/req  system {system:5.1f} µs/req{per_batch}")
    print("  Redis commands (calls and µs per request):")
    for command, stat in sorted(stats.items(), key=lambda item: -item[1]["usec"])[:8]:
        name = command.removeprefix("cmdstat_")
        print(f"    {name:12} {stat['calls'] / count:5.2f} calls  {stat['usec'] / count:6.2f} µs")


def profile_shares(path: Path, top: int = 14) -> None:
    """The `top` functions with most time under them in a cProfile file, each as a share of the
    process's whole profiled time, with its own share and its calls; those with nearly all of it
    under them (the event loop, the process's main) are left out: they tell nothing."""
    table = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    total = sum(own for _, _, own, _, _ in table.values()) or 1.0
    print(f"{path.name}: {total:.1f} s profiled; under each function, as shares of it:")
    print(f"  {'under':>6}  {'own':>6}  {'calls':>9}  function")
    shown = 0
    for (file, line, name), (_, calls, own, under, _) in sorted(table.items(), key=lambda item: -item[1][3]):
        if under >= 0.9 * total:
            continue
        where = file.split("site-packages/")[-1].removeprefix(f"{Path.cwd()}/")
        print(f"  {under / total:6.1%}  {own / total:6.1%}  {calls:9,}  {where}:{line} {name}")
        shown += 1
        if shown == top:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_split", description=__doc__)
    parser.add_argument("--measure-s", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--one-entry-each", action="store_true", help="FNGATE_GROUP_INVOCATIONS=false")
    parser.add_argument("--server", choices=("uvicorn", "hypercorn"), default="uvicorn", help="the gateway's")
    parser.add_argument(
        "--profile", type=Path, metavar="DIR", help="run the gateway and runner under cProfile"
    )
    args = parser.parse_args(argv)
    profiles = args.profile.resolve() if args.profile is not None else None
    with tempfile.TemporaryDirectory(prefix="fngate-cpu-split-") as folder:
        repo = Path(folder) / "repo"
        repo.mkdir()
        build_repository(repo)
        with deployment(repo, Path(folder) / "logs", profiles) as deployed:
            grouping = {"FNGATE_GROUP_INVOCATIONS": "false"} if args.one_entry_each else {}
            url = deployed.start_gateway(workers=1, FNGATE_SERVER=args.server, **grouping)
            deployed.start_runner()
            port = int(url.rsplit(":", 1)[1])
            for binary in (False, True):
                split(deployed, port, binary, args.clients, args.measure_s)
    if profiles is not None:  # written as the processes exited, with the deployment
        print("under cProfile: every CPU figure above is about doubled")
        for name in ("gateway-0.prof", "runner-0.prof"):
            profile_shares(profiles / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
