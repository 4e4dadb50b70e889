"""main(settings, stopping): one TaskGroup with a consume loop per function, the discovery loop
(which also loads new versions beside old ones and retires old ones), the control loop and the
heartbeat. The composition root of the runner."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys
from fngate.config import RunnerSettings
from fngate.registry import ControlOp, ModelState, Source, StateBoard, decode_control, function_source
from fngate.repository import FunctionRecord
from runner import idle
from runner.backends.providers import Acceleration
from runner.consumer import FunctionConsumer
from runner.pool import Key, ModelPool
from runner.status import StatusServer, redis_ready
from runner.store import Store

log = logging.getLogger(__name__)

REPLAY_MS = 600_000
"""Load requests this recent are carried out by a runner that starts after them."""


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclasses.dataclass
class Runner:
    """What the loops share."""

    name: str
    settings: RunnerSettings
    redis: aioredis.Redis
    pool: ModelPool
    board: StateBoard
    source: Source
    stopping: asyncio.Event
    tasks: asyncio.TaskGroup
    records: dict[str, FunctionRecord] = dataclasses.field(default_factory=dict)
    consumers: dict[str, tuple[FunctionConsumer, asyncio.Task[None]]] = dataclasses.field(
        default_factory=dict
    )
    loops: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)
    """What draining waits for: the consume loops and the runner's own loops."""
    background: set[asyncio.Task[Any]] = dataclasses.field(default_factory=set)
    """Loads asked for by a load request or a new version; cancelled, not awaited, at shutdown."""
    preloading: set[Key] = dataclasses.field(default_factory=set)

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> None:
        task = self.tasks.create_task(work, name=name)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


async def main(settings: RunnerSettings, stopping: asyncio.Event) -> None:
    name = consumer_name()
    redis = aioredis.from_url(settings.redis_url, socket_connect_timeout=5)
    control = aioredis.from_url(settings.redis_url, socket_connect_timeout=5)
    board = StateBoard(redis, name, settings.pool, ttl_s=settings.heartbeat_s * 3)

    async def report(function: str, version: str, state: ModelState) -> None:
        try:
            await board.set(function, version, state)
            await board.heartbeat(_idle_times(pool))  # what is loaded changed: say so now
        except RedisError as exc:
            log.warning("could not record the state of %s version %s: %s", function, version, exc)

    store = await asyncio.to_thread(
        Store, settings.repo, _artifact_dir(settings), settings.artifact_max_bytes
    )
    accel = Acceleration.from_settings(settings, store.engine_store())
    threads = settings.intra_op_threads or min(os.cpu_count() or 1, 4)
    pool = ModelPool(threads, store, report, settings.load_retry_s, accel)
    async with redis, control:
        await redis.ping()
        await board.heartbeat()
        log.info("runner %s started (repository %s)", name, settings.repo)
        try:
            async with asyncio.TaskGroup() as tasks:
                source = function_source(settings.repo, redis)
                runner = Runner(name, settings, redis, pool, board, source, stopping, tasks)
                await discover(runner)
                runner.loops.append(tasks.create_task(_discover_loop(runner), name="discover"))
                runner.loops.append(tasks.create_task(_heartbeat_loop(runner), name="heartbeat"))
                runner.loops.append(tasks.create_task(_control_loop(runner, control), name="control"))
                status = StatusServer(
                    settings.status_host, settings.status_port, redis_ready(redis, stopping)
                )
                serving = tasks.create_task(status.run(), name="status")
                runner.loops.append(
                    tasks.create_task(
                        idle.watch(pool, lambda: _busy(runner), stopping, settings.idle_shutdown_s),
                        name="idle",
                    )
                )
                await stopping.wait()
                log.info("runner %s draining (up to %.0f s)", name, settings.drain_timeout_s)
                await _drain(runner.loops, settings.drain_timeout_s)
                for task in [serving, *runner.background]:
                    task.cancel()
        finally:
            pool.close()
            with contextlib.suppress(RedisError, OSError):
                await board.close()
    log.info("runner %s stopped", name)


def _busy(runner: Runner) -> bool:
    return any(consumer.pending for consumer, _task in runner.consumers.values())


def _artifact_dir(settings: RunnerSettings) -> Path:
    return Path(settings.artifact_dir).expanduser()


async def discover(runner: Runner) -> None:
    """One pass: consume every function of our pool, load new served versions of warm functions,
    retire versions no longer served, forget removed functions."""
    settings = runner.settings
    try:
        found = await runner.source()
    except (OSError, RedisError) as exc:
        log.warning("discovery failed (%s); keeping the functions known so far", exc)
        return
    wanted = set(settings.functions)
    records = {
        name: record
        for name, record in found.items()
        if (name in wanted if wanted else _pool_of(record) == settings.pool)
    }
    gone = runner.records.keys() - records.keys()
    runner.records = records
    runner.pool.offer(records)
    for name in gone:
        await _forget(runner, name, "removed" if name not in found else "moved to another pool")
        if name in found:  # its invocations are for another pool's runners now
            _stop_consuming(runner, name)
    for record in records.values():
        _consume(runner, record)
        _preload(runner, record)
    await _retire(runner)


def _consume(runner: Runner, record: FunctionRecord) -> None:
    """A consume loop per function; its `function` (batching policy) is the newest served version."""
    default = record.default
    if default is None:
        return
    entry = runner.consumers.get(record.name)
    if entry is None:
        consumer = FunctionConsumer(
            runner.redis, default, runner.pool, runner.settings, runner.name, runner.stopping
        )
        task = runner.tasks.create_task(consumer.run(), name=f"consume {record.name}")
        runner.consumers[record.name] = (consumer, task)
        runner.loops.append(task)
        log.info("consuming %s (serving versions %s)", record.name, ", ".join(record.served))
    elif entry[0].function != default:
        log.info("%s now serves versions %s", record.name, ", ".join(record.served))
        entry[0].function = default


def _pool_of(record: FunctionRecord) -> str:
    return record.newest().manifest.scaling.pool


def _preload(runner: Runner, record: FunctionRecord) -> None:
    """Make before break: a function loaded here gets its newly served versions loaded beside."""
    if not any(key[0] == record.name for key in runner.pool.loaded):
        return
    for version in record.served:
        key = (record.name, version)
        if key not in runner.pool.loaded and key not in runner.preloading:
            runner.preloading.add(key)
            runner.spawn(_preload_one(runner, key), f"preload {key}")


async def _preload_one(runner: Runner, key: Key) -> None:
    try:
        with contextlib.suppress(Exception):  # the failure is recorded as the version's state
            await runner.pool.get(runner.pool.version(*key))
    finally:
        runner.preloading.discard(key)


async def _retire(runner: Runner) -> None:
    """Unload versions the policy stopped serving once a newer served one is loaded here and they
    have been idle for retire_after_s (gateways move traffic when they see the newer one ready)."""
    now = time.monotonic()
    for key, model in list(runner.pool.loaded.items()):
        record = runner.records.get(key[0])
        if record is None or key[1] in record.served:
            continue
        newer = any(
            int(version) > int(key[1]) and (key[0], version) in runner.pool.loaded
            for version in record.served
        )
        if newer and model.in_use == 0 and now - model.last_used >= runner.settings.retire_after_s:
            await runner.pool.unload(key, "retired")


def _stop_consuming(runner: Runner, name: str) -> None:
    """What the loop read and did not answer stays pending for other runners to claim. (A removed
    function's loop keeps running: it answers invocations that gateways still queue not_found.)"""
    entry = runner.consumers.pop(name, None)
    if entry is not None:
        entry[1].cancel()
        log.info("no longer consuming %s: it moved to another pool", name)


async def _forget(runner: Runner, name: str, reason: str) -> None:
    for key in [key for key in runner.pool.loaded if key[0] == name]:
        await runner.pool.unload(key, reason)
    with contextlib.suppress(RedisError):
        await runner.board.forget(name)


async def _discover_loop(runner: Runner) -> None:
    """Every rescan_s; a deploy or removal on the control stream triggers a pass at once too."""
    while not runner.stopping.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(runner.settings.rescan_s):
                await runner.stopping.wait()
        if not runner.stopping.is_set():
            await discover(runner)


async def _heartbeat_loop(runner: Runner) -> None:
    while not runner.stopping.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(runner.settings.heartbeat_s):
                await runner.stopping.wait()
        try:
            await runner.board.heartbeat(_idle_times(runner.pool))
        except (RedisError, OSError) as exc:
            log.warning("heartbeat failed: %s", exc)


def _idle_times(pool: ModelPool) -> dict[str, float]:
    now = time.monotonic()
    return {
        f"{name}/{version}": round(now - model.last_used, 1) for (name, version), model in pool.loaded.items()
    }


async def _control_loop(runner: Runner, control: aioredis.Redis) -> None:
    """Carry out load requests of the last REPLAY_MS, then every operation as it arrives."""
    last = ""
    while not runner.stopping.is_set():
        try:
            if not last:
                last = await _replay(runner, control)
            block_ms = min(runner.settings.read_block_ms, 1000)
            response: Any = await control.xread({keys.control(): last}, count=100, block=block_ms)
            for _stream, entries in response or ():
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    op = decode_control(entry_id, fields)
                    if op is not None:
                        await _apply(runner, op)
                    await runner.board.acknowledge(last)
        except (RedisError, OSError) as exc:
            log.warning("control loop: redis unavailable (%s); retrying in 1 s", exc)
            await asyncio.sleep(1)


async def _replay(runner: Runner, control: aioredis.Redis) -> str:
    newest: Any = await control.xrevrange(keys.control(), count=1)
    if not newest:
        return "0-0"
    last: str = newest[0][0].decode()
    since = int(time.time() * 1000) - REPLAY_MS
    entries: Any = await control.xrange(keys.control(), min=f"{since}-0", max=last)
    wanted: dict[str, ControlOp] = {}
    for entry_id, fields in entries:
        op = decode_control(entry_id, fields)
        if op is None:
            continue
        if op.op == "load":
            wanted[op.function] = op
        elif op.op in ("unload", "remove"):
            wanted.pop(op.function, None)
    for op in wanted.values():
        await _apply(runner, op)
    await runner.board.acknowledge(last)
    return last


async def _apply(runner: Runner, op: ControlOp) -> None:
    record = runner.records.get(op.function)
    unknown = record is None or any(version not in record.versions for version in op.versions)
    if op.op in ("deploy", "remove") or (op.op == "load" and unknown):
        await discover(runner)  # the operation may name what the last pass did not see yet
        record = runner.records.get(op.function)
    if op.op == "load" and record is not None:
        for version in op.versions or record.served:
            if version in record.versions:
                runner.spawn(runner.pool.load(record.versions[version], op.id), f"load {op.function}")
    elif op.op == "unload":
        loaded = {version for function, version in runner.pool.loaded if function == op.function}
        for version in sorted(set(op.versions) | loaded):
            await runner.pool.unload((op.function, version), "unloaded")  # waits for a load under way
    elif op.op == "remove":
        await _forget(runner, op.function, "removed")


async def _drain(loops: list[asyncio.Task[None]], timeout_s: float) -> None:
    """Give the loops `timeout_s` to finish what they read; then cancel what is left."""
    _done, late = await asyncio.wait(loops, timeout=timeout_s)
    for task in late:
        log.warning("cancelling %s after the drain timeout", task.get_name())
        task.cancel()
