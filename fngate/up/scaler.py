"""The local scaler of `fngate up`: the single-machine counterpart of KEDA.

It starts a runner the moment a gateway announces work for a pool with none (the wake channel),
adds runners while a pool's backlog grows (up to max_replicas), keeps min_replicas warm, and
records a runner that could not start so gateways can answer 503 at once. Runners stop on their
own when idle (FNGATE_IDLE_SHUTDOWN_S); the scaler only reaps them. With `standby`, one runner
process is kept started ahead of need (imports done, no pool, no model) for the next pool to wake."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import clients, keys
from fngate.backoff import Backoff, Health, backoff_s, stop_if_cancelled
from fngate.process import ends_with_parent, module_command, stop_processes
from fngate.registry import LOADING, read_runners

log = logging.getLogger("fngate.up.scaler")
TICK_TIMEOUT_S = 5.0
"""A scaling pass that takes longer failed: a paused Redis answers nothing at all."""
CRASH_BACKOFF_S = 0.5
MAX_CRASH_BACKOFF_S = 30.0
STABLE_S = 30.0
"""A runner that lived this long before it died resets its pool's backoff."""
IDLE_POLL_S = 2.0
"""Between scaling passes while no runner runs (a pool's wake is heard at once all the same)."""
STANDBY_SETTLE_S = 2.0
"""After a standby runner is handed a pool, its replacement waits this long at least, then until
the runner handed the pool reports a model and while any runner loads one: the replacement's
imports would take CPU from that cold start."""
STANDBY_SETTLE_MAX_S = 20.0
"""...but no longer than this for the handed runner's first report (its invocations may have gone
to another runner, and it would load nothing)."""


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    name: str
    functions: tuple[str, ...]
    min_replicas: int
    max_replicas: int
    rows_per_runner: int
    """Backlog one runner is expected to absorb before another is worth starting."""
    priorities: tuple[tuple[str, int], ...] = ()
    """(function, priority levels) of the functions that have more than one (batching.priorities)."""


@dataclasses.dataclass
class Started:
    process: subprocess.Popen[bytes]
    pool: str
    at: float
    warm: bool
    seen: bool = False


class LocalScaler:
    def __init__(
        self,
        redis: aioredis.Redis,
        pools: Callable[[], Awaitable[dict[str, PoolSpec]]],
        env: dict[str, str],
        idle_shutdown_s: float,
        logs: Path | None = None,
        poll_s: float = 0.5,
        cooldown_s: float = 1.0,
        standby: bool = False,
        python: str = "",
    ) -> None:
        self._redis = redis
        self._python = python
        """The interpreter runners start with ('': this one's; `fngate up --runner-python`)."""
        self._pools = pools
        self._env = env
        self._idle_shutdown_s = idle_shutdown_s
        self._logs = logs
        self._poll_s = poll_s
        self._cooldown_s = cooldown_s
        self._keep_standby = standby
        self._standby: subprocess.Popen[bytes] | None = None
        """A runner started ahead of need, waiting on its stdin for the pool it is to serve."""
        self._spawned = 0
        self._standby_not_before = 0.0
        self._handed: tuple[subprocess.Popen[bytes], float] | None = None
        """The runner last handed the standby's place, and until when its replacement waits for it
        to report a model (its load starting)."""
        self._started: list[Started] = []
        self._last_start: dict[str, float] = {}
        self._specs: dict[str, PoolSpec] = {}
        self._beating: set[int] = set()
        self._crashes: dict[str, int] = {}
        self._not_before: dict[str, float] = {}
        """Per pool: runners that died in a row, and when the next may start (backoff)."""
        self.health = Health("redis")
        self.timeline: list[tuple[float, str, int]] = []
        """(time, pool, live runners) at each change, for the scale-up/scale-down story."""

    @property
    def standby_pid(self) -> int | None:
        """The process id of the standby runner while one waits for a pool."""
        standby = self._standby
        return standby.pid if standby is not None and standby.poll() is None else None

    async def run(self, stopping: asyncio.Event) -> None:
        """Scale until `stopping` is set; then stop every runner (they drain). While Redis fails or
        does not answer, retry with backoff; the runners already started go on."""
        backoff = Backoff(base_s=0.1, cap_s=1.0)
        try:
            while not stopping.is_set():
                try:
                    await self._scale(stopping, backoff)
                except (RedisError, OSError) as exc:  # OSError covers TimeoutError
                    stop_if_cancelled(exc)
                    self.health.failed("scaler", exc)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(backoff.failed()):
                            await stopping.wait()
        finally:
            await asyncio.to_thread(self.stop_all)

    async def _scale(self, stopping: asyncio.Event, backoff: Backoff) -> None:
        pubsub = self._redis.pubsub()
        try:
            async with asyncio.timeout(TICK_TIMEOUT_S):
                await clients.subscribe(pubsub, keys.wake_channel())
            while not stopping.is_set():
                async with asyncio.timeout(TICK_TIMEOUT_S):
                    await self._tick()
                backoff.succeeded()
                self.health.succeeded()
                # With no runner, a wake (a message) is what starts one: a quiet machine ticks slowly.
                poll_s = self._poll_s if self._started else max(self._poll_s, IDLE_POLL_S)
                message = await clients.next_message(pubsub, poll_s)
                while message is not None:  # every pool woken meanwhile, then one tick for all
                    async with asyncio.timeout(TICK_TIMEOUT_S):
                        await self._wake(message["data"].decode())
                    message = await clients.next_message(pubsub, 0)
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _wake(self, pool: str) -> None:
        if pool not in self._specs:
            self._specs = await self._pools()
        self._beating = await self._heartbeats()
        if pool in self._specs and not self._live(pool):
            log.info("pool %s woken with no runner: starting one", pool)
            self._start(pool)

    async def _tick(self) -> None:
        self._specs = await self._pools()
        heartbeats = await self._heartbeats()
        self._beating = heartbeats
        await self._reap(heartbeats)
        backlog = await self._backlog()
        now = time.monotonic()
        for pool, spec in self._specs.items():
            starting = any(item.pool == pool and not item.seen for item in self._started)
            since = now - self._last_start.get(pool, float("-inf"))
            for _ in range(
                to_start(spec, self._live(pool), starting, backlog.get(pool, 0), since, self._cooldown_s)
            ):
                self._start(pool)
        await self._replenish_standby()

    async def _replenish_standby(self) -> None:
        """Start the next standby runner once no runner is starting or loading a model (its
        imports would slow that cold start down: a large model's load is CPU-bound)."""
        if not self._keep_standby or any(not item.seen for item in self._started):
            return
        standby = self._standby
        if standby is not None and standby.poll() is None:
            return
        now = time.monotonic()
        if standby is not None and standby.returncode != 0:  # it died waiting: not again at once
            log.error("the standby runner %d died (code %s)", standby.pid, standby.returncode)
            self._standby, self._standby_not_before = None, now + MAX_CRASH_BACKOFF_S
        if now >= self._standby_not_before and not await self._loading(now):
            self._standby = self._spawn(["--standby"], self._env, "standby")

    async def _loading(self, now: float) -> bool:
        """Whether a live runner reports a model LOADING, or the runner last handed the standby's
        place is about to: alive, and no model reported yet (for STANDBY_SETTLE_MAX_S at most)."""
        runners = await read_runners(self._redis)
        if any(state.state == LOADING for view in runners for state in view.models.values()):
            return True
        if self._handed is not None:
            handed, until = self._handed
            reported = any(runner_pid(view.name) == handed.pid and view.models for view in runners)
            if not reported and handed.poll() is None and now < until:
                return True
            self._handed = None
        return False

    def _live(self, pool: str) -> int:
        """Runners of the pool that are starting or serving: one that was seen and has dropped its
        heartbeat is on its way out (draining) and no longer counts."""
        return sum(
            1
            for item in self._started
            if item.pool == pool
            and item.process.poll() is None
            and not (item.seen and item.process.pid not in self._beating)
        )

    def _start(self, pool: str) -> None:
        if time.monotonic() < self._not_before.get(pool, float("-inf")):
            return  # its last runner died: wait out the backoff
        spec = self._specs.get(pool)
        warm = (
            spec is not None
            and sum(1 for i in self._started if i.pool == pool and i.warm) < spec.min_replicas
        )
        assigned = {
            "FNGATE_POOL": pool,
            "FNGATE_STATUS_PORT": "0",
            "FNGATE_IDLE_SHUTDOWN_S": "0" if warm else str(self._idle_shutdown_s),
        }
        process = self._take_standby(assigned) or self._spawn([], {**self._env, **assigned}, pool)
        now = time.monotonic()
        self._started.append(Started(process, pool, now, warm))
        self._last_start[pool] = now
        self._note(pool)

    def _spawn(self, args: list[str], env: dict[str, str], label: str) -> subprocess.Popen[bytes]:
        output: Any = None  # without a log folder, runners write where `fngate up` writes
        if self._logs is not None:
            output = open(self._logs / f"runner-{label}-{self._spawned}.log", "ab")  # noqa: SIM115
        self._spawned += 1
        process = subprocess.Popen(
            module_command("runner", *args, python=self._python),
            env=env,
            stdin=subprocess.PIPE if args else None,
            stdout=output,
            stderr=subprocess.STDOUT if output is not None else None,
            start_new_session=True,
            preexec_fn=ends_with_parent(signal.SIGTERM),  # noqa: PLW1509 (a prctl only)
        )
        if output is not None:
            output.close()
        return process

    def _take_standby(self, assigned: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """The standby runner, told its settings, if one is alive."""
        standby, self._standby = self._standby, None
        if standby is None or standby.poll() is not None or standby.stdin is None:
            return None
        try:
            handed = {**assigned, "assigned_ms": int(time.time() * 1000)}
            standby.stdin.write(json.dumps(handed).encode() + b"\n")
            standby.stdin.close()
        except OSError:  # it died meanwhile
            return None
        log.info("pool %s: the standby runner %d serves it", assigned["FNGATE_POOL"], standby.pid)
        now = time.monotonic()
        self._standby_not_before = now + STANDBY_SETTLE_S
        self._handed = (standby, now + STANDBY_SETTLE_MAX_S)
        return standby

    async def _reap(self, heartbeats: set[int]) -> None:
        """Forget runners that exited; one that died before its first heartbeat failed to start."""
        for item in list(self._started):
            if item.process.pid in heartbeats and not item.seen:
                item.seen = True
                with contextlib.suppress(RedisError):
                    await self._redis.hdel(keys.start_failures(), item.pool)
            code = item.process.poll()
            if code is None:
                continue
            self._started.remove(item)
            if code != 0:
                self._crashed(item, code)
            else:
                log.info("pool %s: runner %d stopped (code %s)", item.pool, item.process.pid, code)
            if not item.seen and code != 0:
                reason = f"runner exited with code {code} before it was ready"
                with contextlib.suppress(RedisError):
                    await self._redis.hset(keys.start_failures(), item.pool, reason)
            self._note(item.pool)

    def _crashed(self, item: Started, code: int) -> None:
        """A runner died unasked: the pool's next start waits a delay that grows while runners keep
        dying young (work waiting for the pool starts a new one after it; nothing is lost)."""
        now = time.monotonic()
        lived_s = now - item.at
        failures = 1 if lived_s >= STABLE_S else self._crashes.get(item.pool, 0) + 1
        self._crashes[item.pool] = failures
        wait_s = backoff_s(failures, CRASH_BACKOFF_S, MAX_CRASH_BACKOFF_S)
        self._not_before[item.pool] = now + wait_s
        how = f"signal {-code}" if code < 0 else f"code {code}"
        ready = "after it was ready" if item.seen else "before it was ready"
        log.error(
            "pool %s: runner %d died (%s) %s, %.0f s after its start; the next start waits %.1f s",
            item.pool, item.process.pid, how, ready, lived_s, wait_s,
        )  # fmt: skip

    def _note(self, pool: str) -> None:
        self.timeline.append((time.time(), pool, self._live(pool)))

    async def _heartbeats(self) -> set[int]:
        """Process ids of runners with a live heartbeat (runner names end in -{pid}-{suffix})."""
        names: Any = await self._redis.zrangebyscore(keys.runners(), int(time.time() * 1000), "+inf")
        return {pid for name in names if (pid := runner_pid(name.decode())) is not None}

    async def _backlog(self) -> dict[str, int]:
        """Invocations queued or in flight, per pool, at every priority level."""
        streams = [
            (pool, stream)
            for pool, spec in self._specs.items()
            for function in spec.functions
            for stream in keys.levels(function, dict(spec.priorities).get(function, 1))
        ]
        async with self._redis.pipeline(transaction=False) as pipe:
            for _pool, stream in streams:
                pipe.xlen(stream)
            try:
                lengths: list[Any] = await pipe.execute()
            except RedisError:
                return {}
        backlog: dict[str, int] = {}
        for (pool, _function), length in zip(streams, lengths, strict=True):
            backlog[pool] = backlog.get(pool, 0) + int(length or 0)
        return backlog

    def stop_all(self, timeout_s: float = 35) -> None:
        standby, self._standby = self._standby, None
        if standby is not None and standby.stdin is not None:
            with contextlib.suppress(OSError):
                standby.stdin.close()  # end of input: it exits
        stop_processes([item.process for item in self._started] + ([standby] if standby else []), timeout_s)
        self._started.clear()


def to_start(
    spec: PoolSpec, live: int, starting: bool, backlog: int, since_start_s: float, cooldown_s: float
) -> int:
    """How many runners to start now: up to min_replicas at once; one for work at zero; one more
    while the backlog is over what the live runners absorb, one start at a time, up to max."""
    if live < spec.min_replicas:
        return spec.min_replicas - live
    if backlog > 0 and live == 0:
        return 1
    growing = backlog > live * spec.rows_per_runner
    if growing and live < spec.max_replicas and not starting and since_start_s >= cooldown_s:
        return 1
    return 0


def pool_specs(functions: dict[str, Any]) -> dict[str, PoolSpec]:
    """Pools from the served functions' manifests (each value has .newest().manifest)."""
    grouped: dict[str, list[Any]] = {}
    for record in functions.values():
        manifest = record.newest().manifest
        grouped.setdefault(manifest.scaling.pool, []).append(manifest)
    return {
        pool: PoolSpec(
            name=pool,
            functions=tuple(sorted(manifest.name for manifest in manifests)),
            min_replicas=max(manifest.scaling.min_replicas for manifest in manifests),
            max_replicas=max(manifest.scaling.max_replicas for manifest in manifests),
            rows_per_runner=max(
                2 * max(manifest.batching.max_batch_size, 1) * manifest.instances for manifest in manifests
            ),
            priorities=tuple(
                (manifest.name, manifest.batching.priorities)
                for manifest in sorted(manifests, key=lambda manifest: manifest.name)
                if manifest.batching.priorities > 1
            ),
        )
        for pool, manifests in grouped.items()
    }


def runner_pid(name: str) -> int | None:
    """The process id in a runner's name (runner names end in -{pid}-{suffix})."""
    try:
        return int(name.rsplit("-", 2)[-2])
    except (ValueError, IndexError):
        return None
