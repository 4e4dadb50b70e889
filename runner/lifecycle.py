"""The runner's functions over their lifetime: which it consumes (discovery, every rescan_s and on
deploys), which versions it loads beside the old ones and retires, and the model-control operations
(load, unload, remove) every runner carries out from the control stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys
from fngate.backoff import stop_if_cancelled
from fngate.config import RunnerSettings
from fngate.registry import ControlOp, Source, StateBoard, control_tail, decode_control
from fngate.repository import FunctionRecord
from runner.consumer import FunctionConsumer
from runner.models import Key, LoadedModels

log = logging.getLogger(__name__)

PREFETCH_MIN_BYTES = 8 * 1024 * 1024
"""Smaller versions download in a few round trips: fetched when first invoked, not ahead."""
REPLAY_MS = 600_000
"""Load requests this recent are carried out by a runner that starts after them."""


class Lifecycle:
    def __init__(
        self,
        name: str,
        settings: RunnerSettings,
        redis: aioredis.Redis,
        models: LoadedModels,
        board: StateBoard,
        source: Source,
        stopping: asyncio.Event,
        tasks: asyncio.TaskGroup,
    ) -> None:
        self.name = name
        self.settings = settings
        self.redis = redis
        self.models = models
        self.board = board
        self.source = source
        self.stopping = stopping
        self.tasks = tasks
        self.records: dict[str, FunctionRecord] = {}
        self.found: dict[str, FunctionRecord] = {}
        """Every function of the repository (its models' calls may name one of another pool)."""
        self.consumers: dict[str, tuple[FunctionConsumer, asyncio.Task[None]]] = {}
        self.loops: list[asyncio.Task[None]] = []
        """What draining waits for: the consume loops and the runner's own loops."""
        self.background: set[asyncio.Task[Any]] = set()
        """Loads asked for by a load request or a new version; cancelled, not awaited, at shutdown."""
        self.preloading: dict[Key, asyncio.Task[Any]] = {}
        self.unloading: set[str] = set()
        """Functions an unload request is unloading: no preload starts for them meanwhile."""
        self.discovered = False
        """A first discovery pass is done: versions seen after it were deployed while we ran."""

    @property
    def busy(self) -> bool:
        """Some consumer holds invocations it has not answered."""
        return any(consumer.pending for consumer, _task in self.consumers.values())

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = self.tasks.create_task(work, name=name)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def discover(self) -> None:
        """One pass: consume every function of our pool, load new served versions of warm functions,
        retire versions no longer served, forget removed functions."""
        settings = self.settings
        try:
            found = await self.source()
        except (OSError, RedisError) as exc:
            log.warning("discovery failed (%s); keeping the functions known so far", exc)
            return
        self.found = found
        wanted = set(settings.functions)
        records = {
            name: record
            for name, record in found.items()
            if (name in wanted if wanted else _pool_of(record) == settings.pool)
        }
        gone = self.records.keys() - records.keys()
        known = {(name, version) for name, record in self.records.items() for version in record.versions}
        self.records = records
        self.models.offer(records)
        for name in gone:
            await self._forget(name, "removed" if name not in found else "moved to another pool")
            if name in found:  # its invocations are for another pool's runners now
                self._stop_consuming(name)
        for record in records.values():
            self._consume(record)
            self._preload(record)
            if self.discovered:
                self._prefetch(record, known)
        self.discovered = True
        await self._retire()

    def _consume(self, record: FunctionRecord) -> None:
        """A consume loop per function; its `function` (batching policy) is the newest served version."""
        default = record.default
        if default is None or default.manifest.pipeline is not None:  # its steps use their functions' streams
            return
        entry = self.consumers.get(record.name)
        if entry is None:
            consumer = FunctionConsumer(
                self.redis, default, self.models, self.settings, self.name, self.stopping
            )
            task = self.tasks.create_task(consumer.run(), name=f"consume {record.name}")
            self.consumers[record.name] = (consumer, task)
            self.loops.append(task)
            log.info("consuming %s (serving versions %s)", record.name, ", ".join(record.served))
        elif entry[0].function != default:
            log.info("%s now serves versions %s", record.name, ", ".join(record.served))
            entry[0].function = default

    def _preload(self, record: FunctionRecord) -> None:
        """Make before break: a function loaded here gets its newly served versions loaded beside."""
        if record.name in self.unloading or not any(key[0] == record.name for key in self.models.loaded):
            return
        for version in record.served:
            key = (record.name, version)
            if key not in self.models.loaded and key not in self.preloading:
                self.preloading[key] = self.spawn(self._preload_one(key), f"preload {key}")

    def _prefetch(self, record: FunctionRecord, known: set[Key]) -> None:
        """A version deployed while we run, of a function not loaded here, is fetched into the
        artifact cache now, so that its first invocation finds its files on disk: when it is large
        enough (PREFETCH_MIN_BYTES) for its download to be a noticeable part of a cold start."""
        default = record.default
        if default is None or (record.name, default.version) in known:
            return
        if sum(item.size for item in default.files) < PREFETCH_MIN_BYTES:
            return
        if any(key[0] == record.name for key in self.models.loaded):
            return  # _preload loads it beside the loaded one
        self.spawn(self.models.prefetch(default), f"prefetch {record.name}")

    async def _preload_one(self, key: Key) -> None:
        try:
            with contextlib.suppress(Exception):  # the failure is recorded as the version's state
                await self.models.get(self.models.version(*key))
        finally:
            self.preloading.pop(key, None)

    async def _retire(self) -> None:
        """Unload versions no longer served once a served one is loaded here (a newer one, or an
        older one after a rollback) and they have been idle for retire_after_s (gateways move
        traffic when they see the served one ready)."""
        now = time.monotonic()
        for key, model in list(self.models.loaded.items()):
            record = self.records.get(key[0])
            if record is None or key[1] in record.served:
                continue
            replaced = any((key[0], version) in self.models.loaded for version in record.served)
            if replaced and model.in_use == 0 and now - model.last_used >= self.settings.retire_after_s:
                await self.models.unload(key, "retired")

    def _stop_consuming(self, name: str) -> None:
        """What the loop read and did not answer stays pending for other runners to claim. (A removed
        function's loop keeps running: it answers invocations that gateways still queue not_found.)"""
        entry = self.consumers.pop(name, None)
        if entry is not None:
            entry[1].cancel()
            log.info("no longer consuming %s: it moved to another pool", name)

    async def _forget(self, name: str, reason: str) -> None:
        for key in [key for key in self.models.loaded if key[0] == name]:
            await self.models.unload(key, reason)
        with contextlib.suppress(RedisError):
            await self.board.forget(name)

    async def discover_loop(self) -> None:
        """Every rescan_s; a deploy or removal on the control stream triggers a pass at once too."""
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.rescan_s):
                    await self.stopping.wait()
            if not self.stopping.is_set():
                await self.discover()

    async def control_loop(self, control: aioredis.Redis) -> None:
        """Carry out load requests of the last REPLAY_MS, then every operation as it arrives."""
        last = ""
        while not self.stopping.is_set():
            try:
                if not last:
                    last = await self._replay(control)
                block_ms = min(self.settings.read_block_ms, 1000)
                response: Any = await control.xread({keys.control(): last}, count=100, block=block_ms)
                for _stream, entries in response or ():
                    for entry_id, fields in entries:
                        last = entry_id.decode()
                        op = decode_control(entry_id, fields)
                        if op is not None:
                            await self._apply(op)
                        await self.board.acknowledge(last)
            except (RedisError, OSError) as exc:
                stop_if_cancelled(exc)
                log.warning("control loop: redis unavailable (%s); retrying in 1 s", exc)
                await asyncio.sleep(1)

    async def _replay(self, control: aioredis.Redis) -> str:
        last = await control_tail(control)
        if last == "0-0":
            return last
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
            await self._apply(op)
        await self.board.acknowledge(last)
        return last

    async def _apply(self, op: ControlOp) -> None:
        record = self.records.get(op.function)
        if op.op in ("deploy", "remove", "load"):
            # The operation may name what the last pass did not see yet, or files changed since.
            await self.discover()
            record = self.records.get(op.function)
        if op.op == "load" and record is not None:
            for version in op.versions or record.served:
                if version in record.versions:
                    self.spawn(self.models.load(record.versions[version], op.id), f"load {op.function}")
        elif op.op == "unload":
            await self._unload(op.function, op.versions)
        elif op.op == "remove":
            await self._forget(op.function, "removed")

    async def _unload(self, function: str, versions: tuple[str, ...]) -> None:
        """Every version of the function, none loaded again before the last is gone: a discovery
        pass between two versions' unloads would otherwise preload the first again beside the
        second (make before break), and the unload would be confirmed with it loading."""
        self.unloading.add(function)
        try:
            under_way = [task for key, task in self.preloading.items() if key[0] == function]
            await asyncio.gather(*under_way, return_exceptions=True)
            loaded = {version for name, version in self.models.loaded if name == function}
            for version in sorted(set(versions) | loaded):
                await self.models.unload((function, version), "unloaded")  # waits for a load under way
        finally:
            self.unloading.discard(function)


def _pool_of(record: FunctionRecord) -> str:
    return record.newest().manifest.scaling.pool
