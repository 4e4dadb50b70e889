"""Scale from zero: know which runner pools have a live runner, and wake a pool that has none the
moment work arrives for it, instead of waiting for a scaler's poll.

The invocation itself waits in the queue until its deadline, and past it, under the loading rule
(docs/cold-start.md), while its model loads (`await_load`). A pool whose runner could not start
fails fast with 503 and Retry-After."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import clients, keys
from fngate.backoff import Backoff, Health, stop_if_cancelled
from fngate.errors import DeadlineExceeded, Unavailable
from fngate.kube import InCluster, KubeError, runner_deployment
from fngate.registry import LOADING, READY, ModelState
from fngate.repository import FunctionVersion

log = logging.getLogger(__name__)
T = TypeVar("T")
RELOADED = {"not-loaded", "idle-unloaded", "retired"}
"""States of a version that a runner loads again for its next invocation (not stuck or failed)."""
START_S = 15.0
"""A scaler that heard a pool's wake has a runner of it live within this long, or is not starting one."""
TAKE_UP_S = 3.0
"""A runner that serves a function takes up an invocation queued for it, and reports the load it
begins, within this long: after it has just become live, or after the invocation was queued."""
KUBE_WAKE_EVERY_S = 1.0
"""A pool's Deployment is asked to wake at most this often by one gateway process: one ask is
enough (the count goes to 1, and KEDA owns it from there); a later one is for a pool that KEDA
scaled down again meanwhile, or an API that failed."""
KUBE_SAID_EVERY_S = 60.0
"""A pool that cannot be woken through Kubernetes is logged at most this often by one process."""
REFRESH_TIMEOUT_S = 1.0
"""A refresh that takes longer counts as a failure: a Redis that is paused answers nothing at all."""


class Activator:
    def __init__(
        self,
        redis: aioredis.Redis,
        refresh_s: float = 0.25,
        health: Health | None = None,
        kube: InCluster | None = None,
    ) -> None:
        self._redis = redis
        self._kube = kube
        """Where the gateway runs in Kubernetes with push activation (FNGATE_KUBERNETES_WAKE): a
        wake also sets the pool's Deployment from 0 to 1 replica."""
        self._kube_asked: dict[str, float] = {}
        self._kube_said: dict[str, float] = {}
        self._refresh_s = refresh_s
        self.health = health or Health("redis")
        self._live_pools: set[str] = set()
        self._live_since: dict[str, float] = {}
        """When each live pool was first seen live (time.monotonic())."""
        self._states: dict[tuple[str, str], ModelState] = {}
        """Per (function, version) on live runners: READY if any has it, else LOADING if any loads
        it, else the latest state."""
        self._failures: dict[str, str] = {}
        self._woken: dict[str, float] = {}
        self._heard: dict[str, float] = {}
        """When a wake of the pool last reached a scaler (time.monotonic())."""
        self._waking: set[asyncio.Task[None]] = set()

    def check(self, pool: str) -> None:
        """Before an invocation is queued: a pool with no runner whose last start failed is 503."""
        failure = self._failures.get(pool)
        if failure and pool not in self._live_pools:
            self._woken.pop(pool, None)
            raise Unavailable(f"no runner could start for pool '{pool}' ({failure}); retrying the start")

    def is_loading(self, function: FunctionVersion, since_ms: int) -> bool:
        """The version's model is on its way for an invocation queued at `since_ms` (wall clock): a
        live runner of its pool loads it, or will when it takes the invocation up (it never had it,
        or unloaded it idle before), or none is live yet and a scaler heard the pool's wake (within
        START_S, and no start of it failed since)."""
        state = self._states.get((function.name, function.version))
        if state is not None and state.state in (READY, LOADING):
            return state.state == LOADING
        pool = function.manifest.scaling.pool
        if pool in self._live_pools:  # it loads the version when it takes the invocation up
            if state is None:  # nothing reported: a runner just started, or Redis lost the states
                return time.monotonic() - self._live_since.get(pool, 0.0) < TAKE_UP_S
            # A runner reported it unloaded before the invocation came: it loads the version when it
            # takes the invocation up, and says so (LOADING) at once. One that has not within
            # TAKE_UP_S is not going to (it serves other functions, or it has just died).
            waited_ms = time.time() * 1000 - since_ms
            return state.reason in RELOADED and state.at_ms < since_ms and waited_ms < TAKE_UP_S * 1000
        if self._failures.get(pool):
            return False
        heard = self._heard.get(pool, float("-inf"))
        return time.monotonic() - heard < min(START_S, function.manifest.model.load_timeout_s)

    async def on_the_way(self, function: FunctionVersion, since_ms: int) -> bool:
        """`is_loading`, at an invocation's deadline; a pool with no runner whose wake no scaler has
        heard yet (it may have subscribed since, or started one from the backlog) is woken again."""
        if self.is_loading(function, since_ms):
            return True
        pool = function.manifest.scaling.pool
        if pool in self._live_pools or self._failures.get(pool):
            return False
        self._woken[pool] = now = time.monotonic()
        await self._publish_wake(pool, now, since_ms)  # past the deadline: this wait is the caller's own
        return self.is_loading(function, since_ms)

    async def await_load(
        self, function: FunctionVersion, answer: asyncio.Future[T], since_ms: int, timeout_ms: int
    ) -> T:
        """The loading rule, past an invocation's deadline while its model loads: wait for `answer`
        until `timeout_ms` after the model is ready, at most load_timeout_s for the load. Raises
        DeadlineExceeded when the wait ends without it."""
        name, limit_s = function.name, function.manifest.model.load_timeout_s
        started = time.monotonic()
        ready_at: float | None = None
        while True:
            done, _ = await asyncio.wait({answer}, timeout=self._refresh_s)
            if done:
                return answer.result()
            now = time.monotonic()
            state = self._states.get((function.name, function.version))
            if ready_at is None and state is not None and state.state == READY:
                ready_at = now
            if ready_at is not None and now - ready_at >= timeout_ms / 1000:
                raise DeadlineExceeded(f"function '{name}' did not answer within {timeout_ms} ms of its load")
            if ready_at is None and now - started >= limit_s:
                raise DeadlineExceeded(
                    f"function '{name}' did not load within its load_timeout_s ({limit_s:g} s) and "
                    f"{timeout_ms} ms"
                )
            if ready_at is None and not self.is_loading(function, since_ms):
                failure = self._failures.get(function.manifest.scaling.pool)
                cause = f"no runner could start ({failure})" if failure else "its model stopped loading"
                raise DeadlineExceeded(f"function '{name}' did not answer within {timeout_ms} ms: {cause}")

    def wake(self, pool: str, queued_ms: int) -> None:
        """After an invocation queued at `queued_ms` (wall clock): wake the pool if nothing serves
        it. The PUBLISH runs in the background: the invocation does not wait for it, and no redis-py
        call runs inside an invocation's deadline (a cancellation that reaches redis-py during a
        command can be lost, and the deadline with it)."""
        if pool in self._live_pools:
            return
        now = time.monotonic()
        if now - self._woken.get(pool, float("-inf")) < self._refresh_s:
            return  # asked already; the scaler starts one runner however many ask
        self._woken[pool] = now
        task = asyncio.get_running_loop().create_task(self._publish_wake(pool, now, queued_ms))
        self._waking.add(task)
        task.add_done_callback(self._waking.discard)

    async def _publish_wake(self, pool: str, at: float, queued_ms: int) -> None:
        """A wake a scaler heard: this gateway waits past the invocation's deadline for the start
        (`is_loading`), and says so in Redis (keys.woken): the runner started for it counts the
        invocation's wait from its queueing, not from the runner's own start, however late the
        scaler was to start it."""
        if self._kube is not None:
            await self._kube_wake(self._kube, pool, at)
        try:
            if await clients.publish(self._redis, keys.wake_channel(), pool):
                self._heard[pool] = at  # a scaler listens: a runner is on its way
                await self._redis.set(keys.woken(pool), queued_ms, nx=True, ex=int(START_S))
        except RedisError as exc:
            log.warning("could not wake pool %s: %s", pool, exc)

    async def _kube_wake(self, kube: InCluster, pool: str, at: float) -> None:
        if at - self._kube_asked.get(pool, float("-inf")) < KUBE_WAKE_EVERY_S:
            return
        self._kube_asked[pool] = at
        try:
            woke = await asyncio.to_thread(kube.wake, pool)
        except KubeError as exc:  # KEDA's poll still wakes it
            said = self._kube_said.get(pool, float("-inf"))
            if at - said >= KUBE_SAID_EVERY_S:  # a refusal (a pool with no Role) lasts: said once a minute
                self._kube_said[pool] = at
                log.warning("could not wake pool %s through Kubernetes: %s", pool, exc)
            return
        self._heard[pool] = at  # set to 1 now, or above 0 already: a runner is on its way
        if woke:
            log.info("woke pool %s: %s set from 0 to 1 replica", pool, runner_deployment(pool))

    async def run(self) -> None:
        """Refresh the live pools and start failures every refresh_s, until cancelled. While Redis
        fails or does not answer, retry with backoff and report it in `health`; keep the last view."""
        backoff = Backoff()
        while True:
            try:
                async with asyncio.timeout(REFRESH_TIMEOUT_S):
                    await self.refresh()
            except (RedisError, OSError) as exc:  # OSError covers TimeoutError
                stop_if_cancelled(exc)
                self.health.failed("activator", exc)
                await asyncio.sleep(backoff.failed())
                continue
            backoff.succeeded()
            self.health.succeeded()
            await asyncio.sleep(self._refresh_s)

    async def refresh(self) -> None:
        runners: Any = await self._redis.zrangebyscore(keys.runners(), int(time.time() * 1000), "+inf")
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in runners:
                pipe.hgetall(keys.runner_models(name.decode()))
            pipe.hgetall(keys.start_failures())
            results: list[Any] = await pipe.execute()
        self._live_pools = {fields[b"_pool"].decode() for fields in results[:-1] if fields.get(b"_pool")}
        now = time.monotonic()
        self._live_since = {pool: self._live_since.get(pool, now) for pool in self._live_pools}
        states: dict[tuple[str, str], ModelState] = {}
        for fields in results[:-1]:
            for field, raw in fields.items():
                if field.startswith(b"_") or b"/" not in field:
                    continue
                function, version = field.decode().rsplit("/", 1)
                state, known = ModelState.decode(raw), states.get((function, version))
                if known is None or _rank(state) > _rank(known):
                    states[(function, version)] = state
        self._states = states
        self._failures = {pool.decode(): reason.decode() for pool, reason in results[-1].items()}


def _rank(state: ModelState) -> tuple[int, int]:
    """READY over LOADING over the rest; the latest among equals."""
    return ({READY: 2, LOADING: 1}.get(state.state, 0), state.at_ms)
