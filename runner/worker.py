"""main(settings, stopping): one TaskGroup with the runner's loops (its functions' lifecycle:
runner.lifecycle; the heartbeat; idle shutdown; the status port), drained on `stopping`. The
composition root of the runner."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import clients, keys
from fngate.backoff import until_done
from fngate.config import RunnerSettings
from fngate.registry import ModelState, StateBoard, function_source
from runner import bls, budget, gpu, idle
from runner.artifacts import Artifacts
from runner.backends.providers import Acceleration
from runner.backends.python import prepare as prepare_function_processes
from runner.budget import MemoryLimits
from runner.lifecycle import Lifecycle
from runner.models import LoadedModels
from runner.status import StatusServer, redis_ready

log = logging.getLogger(__name__)


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def main(settings: RunnerSettings, stopping: asyncio.Event, started_ms: int | None = None) -> None:
    name = consumer_name()
    redis = clients.connect(settings.redis_url, socket_connect_timeout=5)
    control = clients.connect(settings.redis_url, socket_connect_timeout=5)
    board = StateBoard(redis, name, settings.pool, ttl_s=settings.heartbeat_s * 3)

    async def report(function: str, version: str, state: ModelState) -> None:
        try:
            await board.set(function, version, state)
            await board.heartbeat(_idle_times(models))  # what is loaded changed: say so now
        except RedisError as exc:
            log.warning("could not record the state of %s version %s: %s", function, version, exc)

    artifacts = await asyncio.to_thread(
        Artifacts, settings.repo, _artifact_dir(settings), settings.artifact_max_bytes
    )
    accel = Acceleration.from_settings(settings, artifacts.engine_store())
    threads = settings.intra_op_threads or min(usable_cpus(), 4)
    limits = await asyncio.to_thread(memory_limits, settings)
    try:
        await asyncio.to_thread(prepare_function_processes)
    except OSError as exc:
        log.warning("Python function processes cannot start here: %s", exc)
    models = LoadedModels(
        threads,
        artifacts,
        report,
        settings.load_retry_s,
        accel,
        started_ms,
        limits,
        settings.rate_limiter_resources,
    )
    async with redis, control:
        if not await until_done(redis.ping, (RedisError, OSError), "redis", stopping):
            log.info("runner %s stopped before Redis answered", name)
            return
        _, models.woken_ms = await asyncio.gather(board.heartbeat(), _woken_ms(redis, settings.pool))
        log.info("runner %s started (repository %s, %s)", name, settings.repo, describe_limits(limits))
        try:
            async with asyncio.TaskGroup() as tasks:
                source = function_source(settings.repo, redis)
                runner = Lifecycle(name, settings, redis, models, board, source, stopping, tasks)
                caller = bls.Caller(redis, name, lambda: runner.found)
                bls.install(caller)
                await runner.discover()
                runner.loops.append(tasks.create_task(runner.discover_loop(), name="discover"))
                runner.loops.append(tasks.create_task(_heartbeat_loop(runner), name="heartbeat"))
                runner.loops.append(tasks.create_task(runner.control_loop(control), name="control"))
                status = StatusServer(
                    settings.status_host, settings.status_port, redis_ready(redis, stopping)
                )
                serving = tasks.create_task(status.run(), name="status")
                runner.loops.append(
                    tasks.create_task(
                        idle.watch(models, lambda: runner.busy, stopping, settings.idle_shutdown_s),
                        name="idle",
                    )
                )
                await stopping.wait()
                log.info("runner %s draining (up to %.0f s)", name, settings.drain_timeout_s)
                await _drain(runner.loops, settings.drain_timeout_s)
                for task in [serving, *runner.background]:
                    task.cancel()
                bls.uninstall(caller)
                await caller.close()
        finally:
            models.close()
            with contextlib.suppress(RedisError, OSError):
                await board.close()
    log.info("runner %s stopped", name)


def memory_limits(settings: RunnerSettings) -> MemoryLimits | None:
    """The memory budget from the settings (runner.budget.runner_limits); None when it is off.
    Blocking (NVML): run it in a thread."""
    if not settings.memory_budget:
        return None
    return budget.runner_limits(
        True,
        settings.memory_budget_bytes,
        settings.gpu_memory_budget_bytes,
        settings.memory_budget_share,
        budget.rss_bytes(),
        gpu.find_device(settings.gpu_device),
        settings.gpu_device,
    )


def describe_limits(limits: MemoryLimits | None) -> str:
    if limits is None:
        return "no memory budget"
    parts = [f"memory budget {(limits.host_bytes or 0) / budget.MIB:.0f} MiB"]
    if limits.gpu_bytes is not None:
        parts.append(f"GPU {limits.gpu_index}: {limits.gpu_bytes / budget.MIB:.0f} MiB")
    return ", ".join(parts)


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may keep busy: its CPU affinity, bounded by its cgroup's (v2) CPU
    quota, which is how a container's CPU limit is set (Kubernetes, docker --cpus); a node's CPU
    count would oversubscribe a runner limited to a few."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = (cgroup / "cpu.max").read_text(encoding="ascii").split()
        limit = math.ceil(int(quota) / int(period))
    except (OSError, ValueError):  # no quota ("max"), no cgroup v2, or not in a container
        return cpus
    return max(1, min(cpus, limit))


def _artifact_dir(settings: RunnerSettings) -> Path:
    return Path(settings.artifact_dir).expanduser()


async def _heartbeat_loop(runner: Lifecycle) -> None:
    while not runner.stopping.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(runner.settings.heartbeat_s):
                await runner.stopping.wait()
        try:
            await runner.board.heartbeat(_idle_times(runner.models), _costs(runner))
        except (RedisError, OSError) as exc:
            log.warning("heartbeat failed: %s", exc)


def _costs(runner: Lifecycle) -> dict[str, tuple[float, float]]:
    found = {}
    for name, (consumer, _task) in runner.consumers.items():
        cost = consumer.cost()
        if cost is not None:
            found[name] = (round(cost[0], 1), round(cost[1], 2))
    return found


def _idle_times(models: LoadedModels) -> dict[str, float]:
    now = time.monotonic()
    return {
        f"{name}/{version}": round(now - model.last_used, 1)
        for (name, version), model in models.loaded.items()
    }


async def _woken_ms(redis: aioredis.Redis, pool: str) -> int | None:
    """When the earliest invocation a gateway woke this runner's pool for was queued, taken (the
    pool's first runner counts the waits from it; keys.woken); None without one, or without Redis
    (the waits then count from the runner's start)."""
    try:
        woken: Any = await redis.getdel(keys.woken(pool))
    except (RedisError, OSError):
        return None
    return int(woken) if woken else None


async def _drain(loops: list[asyncio.Task[None]], timeout_s: float) -> None:
    """Give the loops `timeout_s` to finish what they read; then cancel what is left."""
    _done, late = await asyncio.wait(loops, timeout=timeout_s)
    for task in late:
        log.warning("cancelling %s after the drain timeout", task.get_name())
        task.cancel()
