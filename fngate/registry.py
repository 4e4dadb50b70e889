"""Redis records beside the queue: the registry (a mirror of an S3 repository that gateways and
runners read, so that gateways never need S3 and runners never list it), each runner's load state
of every model under a heartbeat, and the control stream (load, unload, deploy, remove) that
every runner reads."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from fngate import keys
from fngate.manifest import ManifestError
from fngate.queue.stored import text
from fngate.repository import (
    FolderRepository,
    FunctionRecord,
    Routing,
    decode_version,
    encode_version,
    is_remote,
    make_record,
    open_repository,
    repo_url,
)

log = logging.getLogger(__name__)

READY, LOADING, UNAVAILABLE = "READY", "LOADING", "UNAVAILABLE"
RELOAD_FAILED = "reload-failed"
"""The reason of a READY state whose changed files did not load: the files loaded before serve on."""
CONTROL_MAXLEN = 1000
CONTROL_OPS = ("load", "unload", "deploy", "remove")
Source = Callable[[], Awaitable[dict[str, FunctionRecord]]]


class FunctionSource:
    """Where a process learns the functions and their versions: an S3 repository through the
    registry (no S3 client needed, no listing of the bucket every few seconds), a folder by
    scanning it in a thread. Each function is read on its own: what cannot be read is left out
    (or served as it was read last) and named in `unreadable`."""

    def __init__(self, repo: str, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._registry = Registry(redis, repo_url(repo)) if is_remote(repo) else None
        self._folder = None if is_remote(repo) else open_repository(repo)

    async def __call__(self) -> dict[str, FunctionRecord]:
        if self._folder is not None:
            await self._read_overrides(self._folder)
            return await asyncio.to_thread(self._folder.scan)
        assert self._registry is not None
        return await self._registry.read()

    async def _read_overrides(self, folder: FolderRepository) -> None:
        """The configurations that load requests gave Triton models (gateway.control), read in place
        of their config.pbtxt, and those that Python models' auto_complete_config answered
        (runner.triton.complete); while Redis does not answer, those read last."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(keys.config_overrides())
                pipe.hgetall(keys.auto_completed())
                overrides, completed = await pipe.execute()
        except (RedisError, OSError) as exc:
            log.debug("configuration overrides not read: %s", exc)
            return
        folder.overrides = {text(name): text(config) for name, config in overrides.items()}
        folder.completed = {text(name): text(record) for name, record in completed.items()}

    @property
    def unreadable(self) -> dict[str, str]:
        """As of the last read: by function (a folder's name, or a registry entry's), why it could
        not be read."""
        if self._folder is not None:
            return self._folder.unreadable
        assert self._registry is not None
        return dict(self._registry.unreadable)


def function_source(repo: str, redis: aioredis.Redis) -> FunctionSource:
    return FunctionSource(repo, redis)


class Registry:
    """Hash field per function: its repository URL and every stored version's index document."""

    def __init__(self, redis: aioredis.Redis, repo_url: str) -> None:
        self._redis = redis
        self._repo = repo_url
        self._reported: set[str] = set()
        self.unreadable: dict[str, str] = {}
        """As of the last read: the entries that could not be read, with why."""
        self._decoded: dict[bytes, FunctionRecord | str | None] = {}
        """Records by their JSON (why not, for one that cannot be read; None for another
        repository's): a read every few seconds validates only what changed."""

    async def read(self) -> dict[str, FunctionRecord]:
        raw: Any = await self._redis.hgetall(keys.registry())
        decoded: dict[bytes, FunctionRecord | str | None] = {}
        for name, doc in raw.items():
            if doc in self._decoded:
                decoded[doc] = self._decoded[doc]
                continue
            try:
                decoded[doc] = self._decode(name.decode(), orjson.loads(doc))
            except Exception as exc:  # any error: this entry's alone, whatever it is
                problem = str(exc) if isinstance(exc, ManifestError) else f"{type(exc).__name__}: {exc}"
                self._report(name.decode(), problem)
                decoded[doc] = problem
        self._decoded = decoded
        problems = {name.decode(): decoded[doc] for name, doc in raw.items()}
        self.unreadable = {name: why for name, why in problems.items() if isinstance(why, str)}
        return {item.name: item for item in decoded.values() if isinstance(item, FunctionRecord)}

    async def put(self, record: FunctionRecord) -> None:
        """Record the function, and make sure its stream and runner group exist (`create_stream`)."""
        doc: dict[str, Any] = {
            "repo": self._repo,
            "versions": [encode_version(item) for item in record.versions.values()],
        }
        if record.routing is not None:
            doc["routing"] = record.routing.encode()
        await create_stream(self._redis, record.name, priorities_of(record))
        await self._redis.hset(keys.registry(), record.name, orjson.dumps(doc))

    async def remove(self, name: str) -> bool:
        return bool(await self._redis.hdel(keys.registry(), name))

    def _decode(self, name: str, doc: dict[str, Any]) -> FunctionRecord | None:
        if doc.get("repo") != self._repo:
            self._report(name, f"recorded for repository {doc.get('repo')}, not {self._repo}")
            return None
        versions = [
            decode_version(item, Path(), f"registry {name}/{item.get('version')}") for item in doc["versions"]
        ]
        routing = doc.get("routing")
        record = make_record(versions, Routing.decode(routing, f"registry {name}") if routing else None)
        if record.name != name:
            raise ValueError(f"holds function {record.name!r}")
        return record

    def _report(self, name: str, problem: str) -> None:
        if f"{name}: {problem}" not in self._reported:
            self._reported.add(f"{name}: {problem}")
            log.warning("registry entry %s skipped: %s", name, problem)


def priorities_of(record: FunctionRecord) -> int:
    """The most priority levels any stored version of the function has: streams for all of them."""
    return max(version.manifest.batching.priorities for version in record.versions.values())


async def create_stream(redis: aioredis.Redis, function: str, priorities: int = 1) -> None:
    """The function's invocation stream and its runner group, made when the function is deployed
    (idempotent), so that the gateways' and runners' stream commands and KEDA's lag query
    (XINFO GROUPS) meet one group from the start. Id 0, as the runners use: anything queued before
    the group existed is still delivered."""
    for stream in keys.levels(function, priorities):  # every priority level's stream
        try:
            await redis.xgroup_create(stream, keys.RUNNER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


@dataclasses.dataclass(frozen=True, slots=True)
class ModelState:
    state: str
    """READY, LOADING or UNAVAILABLE."""
    reason: str = ""
    """Why UNAVAILABLE: not-loaded, unloaded, idle-unloaded, retired, load-failed: <message>."""
    at_ms: int = 0
    request: str = ""
    """The control entry (a load request) that this state answers, if any."""
    download_s: float | None = None
    load_s: float | None = None
    digest: str = ""
    """Of the files loaded (READY): which files of a version a runner serves, when they change."""

    def encode(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> ModelState:
        doc = orjson.loads(raw)
        return cls(**{field.name: doc[field.name] for field in dataclasses.fields(cls) if field.name in doc})


NOT_LOADED = ModelState(UNAVAILABLE, "not-loaded")


@dataclasses.dataclass(frozen=True, slots=True)
class RunnerView:
    name: str
    pool: str
    control: str
    """The last control entry this runner has acted on."""
    models: dict[tuple[str, str], ModelState]
    idle_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds since each loaded model ("function/version") last ran a batch, as of the heartbeat."""
    costs: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """Per function this runner has run: its batch cost (fixed µs a batch, µs a row), as measured."""


def model_field(function: str, version: str) -> str:
    return f"{function}/{version}"


class StateBoard:
    """One runner's model states, in a hash that lives as long as the runner's heartbeat."""

    def __init__(self, redis: aioredis.Redis, runner: str, pool: str, ttl_s: float) -> None:
        self._redis = redis
        self._key = keys.runner_models(runner)
        self._runner = runner
        self._pool = pool
        self._ttl_ms = int(ttl_s * 1000)

    async def set(self, function: str, version: str, state: ModelState) -> None:
        await self._redis.hset(self._key, model_field(function, version), state.encode())

    async def forget(self, function: str) -> None:
        """Drop the states of every version of a removed function."""
        fields: Any = await self._redis.hkeys(self._key)
        mine = [field for field in fields if field.startswith(f"{function}/".encode())]
        if mine:
            await self._redis.hdel(self._key, *mine)

    async def acknowledge(self, control_id: str) -> None:
        await self._redis.hset(self._key, "_control", control_id)

    async def heartbeat(
        self, idle_s: dict[str, float] | None = None, costs: dict[str, tuple[float, float]] | None = None
    ) -> None:
        now_ms = int(time.time() * 1000)
        idle, cost = orjson.dumps(idle_s or {}), orjson.dumps(costs or {})
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(self._key, mapping={"_pool": self._pool, "_idle": idle, "_cost": cost})
            pipe.pexpire(self._key, self._ttl_ms)
            pipe.zadd(keys.runners(), {self._runner: now_ms + self._ttl_ms})
            pipe.zremrangebyscore(keys.runners(), "-inf", now_ms)
            await pipe.execute()

    async def close(self) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.delete(self._key)
            pipe.zrem(keys.runners(), self._runner)
            await pipe.execute()


async def read_runners(redis: aioredis.Redis) -> list[RunnerView]:
    """Every runner whose heartbeat has not expired, with its model states."""
    names: Any = await redis.zrangebyscore(keys.runners(), int(time.time() * 1000), "+inf")
    if not names:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.runner_models(name.decode()))
        hashes: list[dict[bytes, bytes]] = await pipe.execute()
    views = []
    for name, fields in zip(names, hashes, strict=True):
        models = {}
        for field, raw in fields.items():
            if field.startswith(b"_") or b"/" not in field:
                continue
            function, version = field.decode().rsplit("/", 1)
            models[(function, version)] = ModelState.decode(raw)
        pool = fields.get(b"_pool", b"").decode()
        control = fields.get(b"_control", b"0-0").decode()
        idle = orjson.loads(fields.get(b"_idle", b"{}"))
        costs = {
            function: (float(cost[0]), float(cost[1]))
            for function, cost in orjson.loads(fields.get(b"_cost", b"{}")).items()
            if isinstance(cost, list) and len(cost) == 2
        }
        views.append(RunnerView(name.decode(), pool, control, models, idle, costs))
    return views


def summarize(runners: Iterable[RunnerView], function: str, version: str) -> ModelState:
    """One state for a version across runners: READY if any has it, else LOADING if any loads it,
    else the latest reason it is unavailable."""
    states = [view.models[(function, version)] for view in runners if (function, version) in view.models]
    for wanted in (READY, LOADING):
        found = [state for state in states if state.state == wanted]
        if found:
            return max(found, key=lambda state: state.at_ms)
    return max(states, key=lambda state: state.at_ms, default=NOT_LOADED)


@dataclasses.dataclass(frozen=True, slots=True)
class ControlOp:
    op: str
    function: str
    versions: tuple[str, ...] = ()
    id: str = ""


async def send_control(redis: aioredis.Redis, op: ControlOp) -> str:
    """Append an operation for every runner; returns its entry id."""
    fields = {"op": op.op, "fn": op.function, "ver": ",".join(op.versions)}
    entry_id: Any = await redis.xadd(keys.control(), fields, maxlen=CONTROL_MAXLEN, approximate=True)  # type: ignore[arg-type]
    return str(entry_id.decode())


async def control_tail(redis: aioredis.Redis) -> str:
    """The newest entry's id on the control stream ("0-0" while empty): where a reader starts, so
    that what is added after (even between two of its reads) is read; "$" would skip that."""
    newest: Any = await redis.xrevrange(keys.control(), count=1)
    return str(newest[0][0].decode()) if newest else "0-0"


def decode_control(entry_id: bytes, fields: dict[bytes, bytes]) -> ControlOp | None:
    op = fields.get(b"op", b"").decode()
    if op not in CONTROL_OPS:
        return None
    versions = tuple(item for item in fields.get(b"ver", b"").decode().split(",") if item)
    return ControlOp(op, fields.get(b"fn", b"").decode(), versions, entry_id.decode())


def id_order(entry_id: str) -> tuple[int, int]:
    """Stream ids compare as (milliseconds, sequence)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def set_unloaded(redis: aioredis.Redis, function: str, unloaded: bool) -> None:
    """Record an explicit unload (the function answers 503 until a load) or clear it."""
    if unloaded:
        await redis.hset(keys.unloaded(), function, int(time.time() * 1000))
    else:
        await redis.hdel(keys.unloaded(), function)


async def read_unloaded(redis: aioredis.Redis) -> frozenset[str]:
    """The functions explicitly unloaded and not loaded since."""
    names: Any = await redis.hkeys(keys.unloaded())
    return frozenset(name.decode() for name in names)
