"""The memory budget (docs/memory.md) with real runner processes: a budget smaller than two models
makes the second load evict the first and both keep answering; a model larger than the budget is
refused with 503 naming its size and the budget; a python function's two instances run two
invocations at once, /config reports the instance group; while they hold the budget, another
function's invocation is left for a second runner; execution slots make a third heavy invocation
wait for one of the first two; the runner's metrics count it all."""

from __future__ import annotations

import asyncio
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
import yaml

from bench.memory import write_weights_function
from fngate.registry import READY, read_runners
from runner.budget import MIB
from tests.conftest import free_port

BUDGET_BYTES = 256 * MIB
"""Each weights model: 100 MB of files (estimated at 143 MiB held and 238 MiB at its load's peak,
about 105 and 200 measured); one always fits, a second's load never fits beside it. The pair's two
processes take about 180 MiB, twice its estimate: measured, they leave room for nothing else."""
WEIGHT_BYTES = 100_000_000
ROW = [1.0, 2.0, 3.0, 4.0]

PAIR = """
import time

import numpy as np


class Model:
    def __init__(self, folder):
        self.held = np.ones(60 * 2**20, dtype=np.uint8)  # each instance's process holds 60 MiB more

    def infer(self, inputs):
        started = time.time()
        time.sleep(float(inputs["x"][0, 0]))
        return {"y": np.array([[started, time.time()]] * len(inputs["x"]), dtype=np.float64)}
"""


SLEEPER = PAIR.replace("self.held = np.ones(60 * 2**20, dtype=np.uint8)", "self.held = None")


def python_function(folder: Path, name: str, source: str, **model: Any) -> None:
    target = folder / name
    target.mkdir(parents=True)
    (target / "model.py").write_text(textwrap.dedent(source), encoding="utf-8")
    manifest = {
        "name": name,
        "model": {"backend": "python", "path": "model.py", **model},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 1]}],
        "outputs": [{"name": "y", "datatype": "FP64", "shape": [-1, 2]}],
        "batching": {"max_batch_size": 1, "timeout_ms": 30_000},
    }
    (target / "function.yaml").write_text(yaml.safe_dump(manifest), encoding="utf-8")


@pytest.fixture(scope="module")
def budget_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("budget-repo")
    write_weights_function(folder, "weights-a", WEIGHT_BYTES)
    write_weights_function(folder, "weights-b", WEIGHT_BYTES)
    python_function(folder, "pair", PAIR, instances=2)
    python_function(folder, "too-big", PAIR, memory_limit_mb=300)
    # Three instances, each batch holding 4 of the runner's 8 slots: two run at once.
    heavy = {"instances": 3, "memory_limit_mb": 40, "rate_limiter": {"resources": {"GPU_EXEC_SLOTS": 4}}}
    python_function(folder, "heavy", SLEEPER, **heavy)
    return folder


async def loaded_on(redis: aioredis.Redis, pid: int) -> set[str]:
    """The functions the runner with this process id reports ready (its name ends -{pid}-{suffix})."""
    return {
        key[0]
        for view in await read_runners(redis)
        if view.name.rsplit("-", 2)[-2] == str(pid)
        for key, state in view.models.items()
        if state.state == READY
    }


async def loaded(redis: aioredis.Redis) -> set[str]:
    """The functions some runner reports ready."""
    return {
        key[0]
        for view in await read_runners(redis)
        for key, state in view.models.items()
        if state.state == READY
    }


async def test_a_budget_for_one_model_evicts_the_idle_one_refuses_the_too_large_and_runs_instances(
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., subprocess.Popen[bytes]],
    budget_repo: Path,
    redis: aioredis.Redis,
) -> None:
    base = await serve_gateway(repo=str(budget_repo))
    port = free_port()
    budgeted = runner_process(
        FNGATE_REPO=str(budget_repo),
        FNGATE_MEMORY_BUDGET_BYTES=str(BUDGET_BYTES),
        FNGATE_STATUS_PORT=str(port),
        FNGATE_RATE_LIMITER_RESOURCES='{"GPU_EXEC_SLOTS": 8}',
    )
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        async def invoke(name: str, x: Any) -> httpx.Response:
            return await client.post(f"/v1/functions/{name}", json={"inputs": {"x": x}})

        for name, others in [
            ("weights-a", set()),
            ("weights-b", {"weights-a"}),
            ("weights-a", {"weights-b"}),
        ]:
            response = await invoke(name, [ROW])
            assert response.status_code == 200, response.text
            assert response.json()["outputs"]["y"] == [ROW]
            assert name in await loaded(redis)
            assert not others & await loaded(redis), f"{others} still loaded beside {name}"

        refused = await invoke("too-big", [[0.0]])
        assert refused.status_code == 503, refused.text
        assert refused.json()["code"] == "unavailable"
        message = refused.json()["error"]
        assert "needs 300 MiB of host memory" in message
        assert "budget of 256 MiB" in message

        # Two instances: two invocations of half a second each run at once, each on its own.
        one, other = await asyncio.gather(invoke("pair", [[0.5]]), invoke("pair", [[0.5]]))
        assert one.status_code == other.status_code == 200, (one.text, other.text)
        (start_1, end_1), (start_2, end_2) = one.json()["outputs"]["y"][0], other.json()["outputs"]["y"][0]
        assert max(start_1, start_2) < min(end_1, end_2), "the two invocations ran one after the other"
        assert "weights-a" not in await loaded(redis)  # evicted once the pair's processes were measured

        config = (await client.get("/v2/models/pair/config")).json()
        assert [group["count"] for group in config["instance_group"]] == [2]

        # While the pair runs, weights-b cannot fit beside it: the first runner leaves its
        # invocation in the stream, and a second runner, started after it was queued, answers
        # it before the pair is done (had the first runner taken it, it would wait for the pair).
        busy = asyncio.create_task(invoke("pair", [[5.0]]))
        await asyncio.sleep(0.5)
        waiting = asyncio.create_task(invoke("weights-b", [ROW]))
        await asyncio.sleep(1.0)
        spare = runner_process(FNGATE_REPO=str(budget_repo), FNGATE_FUNCTIONS='["weights-b"]')
        response = await waiting
        assert response.status_code == 200, response.text
        assert not busy.done(), "weights-b waited for the pair"
        assert await loaded_on(redis, budgeted.pid) == {"pair"}
        assert "weights-b" in await loaded_on(redis, spare.pid)
        assert (await busy).status_code == 200

        calls = await asyncio.gather(*(invoke("heavy", [[0.5]]) for _ in range(3)))
        assert [call.status_code for call in calls] == [200] * 3, [call.text for call in calls]
        spans = sorted(tuple(call.json()["outputs"]["y"][0]) for call in calls)
        assert spans[1][0] < spans[0][1], "the first two ran one after the other"
        assert spans[2][0] >= min(spans[0][1], spans[1][1]), "the third ran beside the first two"

        metrics = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    assert 'fngate_memory_budget_bytes{memory="host"} 2.68435456e+08' in metrics
    assert 'fngate_memory_evictions_total{function="weights-a"} 2.0' in metrics
    assert 'fngate_memory_evictions_total{function="weights-b"} 1.0' in metrics
    assert 'fngate_memory_refusals_total{function="too-big",reason="too-large"} 1.0' in metrics
    assert 'fngate_memory_refusals_total{function="weights-b",reason="no-room"}' in metrics
