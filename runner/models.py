"""Loaded models: each function version is loaded on first use (or when asked), once even when
asked concurrently, in worker threads; versions load beside each other; a failed load is
remembered for `retry_s`; `unload` drops a version and closes it once no batch uses it; a version
whose batch is stuck past its execution timeout gets no work until that batch returns. Under a
memory budget (runner.budget) loads run one at a time, each makes room by unloading idle models
least recently used first, and its cost is measured and remembered."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from fngate.errors import FunctionError, FunctionNotFound, Unavailable
from fngate.registry import LOADING, READY, RELOAD_FAILED, UNAVAILABLE, ModelState
from fngate.repository import FunctionRecord, FunctionVersion
from runner import budget, gpu
from runner.artifacts import Artifacts
from runner.backends import Backend, Load, load_instances
from runner.backends.providers import Acceleration
from runner.budget import Cost, Held, MemoryLimits
from runner.metrics import (
    CPU_DEVICES,
    MEMORY_EVICTIONS,
    MEMORY_REFUSALS,
    PYTHON_GPU,
    memory_budget,
    memory_used,
    model_loaded,
    model_unloaded,
)
from runner.rate_limiter import RateLimiter

log = logging.getLogger(__name__)

Key = tuple[str, str]
"""(function, version)"""
Report = Callable[[str, str, ModelState], Awaitable[None]]


@dataclasses.dataclass(slots=True)
class LoadedModel:
    function: FunctionVersion
    """The version as loaded: `directory` is the local folder its files were loaded from."""
    backend: Backend
    load_s: float
    last_used: float
    download_s: float = 0.0
    load_started_ms: int = 0
    ready_ms: int = 0
    """Wall clock (ms) when the load began and completed: invocations queued before it waited."""
    in_use: int = 0
    unloaded: bool = False
    stuck_since: float | None = None
    """time.monotonic() when a batch that is still running in a thread began, once it ran past
    the function's execution timeout; None otherwise."""
    cost: Cost = budget.NOTHING
    """What it took when it loaded (every instance), as the memory budget counts it."""

    def stuck_for_s(self) -> float:
        return 0.0 if self.stuck_since is None else time.monotonic() - self.stuck_since


async def _no_report(_function: str, _version: str, _state: ModelState) -> None:
    return None


class LoadedModels:
    def __init__(
        self,
        threads: int,
        artifacts: Artifacts | None = None,
        report: Report = _no_report,
        retry_s: float = 30.0,
        accel: Acceleration | None = None,
        started_ms: int | None = None,
        limits: MemoryLimits | None = None,
        slots: Mapping[str, int] | None = None,
    ) -> None:
        """`started_ms`: when this runner started (wall clock; by default now), for the loading rule
        (and `woken_ms`, set once the runner has read it).
        `limits`: the memory budget (runner.budget); None: none. `slots`: the device's execution
        slots (runner.rate_limiter), which batches hold while they run."""
        self._threads = threads
        self._started_ms = _now_ms() if started_ms is None else started_ms
        self.woken_ms: int | None = None
        """When the earliest invocation was queued for which a gateway woke this runner's pool and
        waits for its start (keys.woken): the invocations queued before the runner started count
        their wait for it from then, not from the start (None: from the start)."""
        self._loading_since: dict[Key, int] = {}
        self._accel = accel
        self._artifacts = artifacts or Artifacts("", Path(), 0)
        self._report = report
        self._retry_s = retry_s
        self._known: dict[str, FunctionRecord] = {}
        self._models: dict[Key, LoadedModel] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self._failures: dict[Key, tuple[float, Unavailable]] = {}
        self._stuck: set[asyncio.Task[None]] = set()
        self._limits = limits
        self.slots = RateLimiter(slots)
        self.costs = budget.Costs()
        self._admission = asyncio.Lock()
        """Under a budget, one load at a time: each load's measure is its own."""
        self._released = asyncio.Event()
        """Set when a model is released or unloaded: a load waiting for room looks again."""
        if limits is not None:
            memory_budget(limits)

    @property
    def loaded(self) -> dict[Key, LoadedModel]:
        return self._models

    @property
    def stuck(self) -> list[Key]:
        """Loaded versions with a batch stuck past its execution timeout: unhealthy until it returns."""
        return [key for key, model in self._models.items() if model.stuck_since is not None]

    def is_stuck(self, name: str) -> bool:
        """A version of function `name` has a batch stuck past its execution timeout."""
        return any(key[0] == name for key in self.stuck)

    @property
    def loading(self) -> bool:
        """A load is under way (a runner that is loading is never idle)."""
        return any(lock.locked() for lock in self._locks.values())

    def deadline_ms(self, name: str, version: str, deadline_ms: int, queued_ms: int, now_ms: int) -> int:
        """An invocation's deadline under the loading rule (`load_deadline_ms`), with this runner's
        load of its version: done at its `ready_ms`, or not yet (then it is still to wait for)."""
        key = (name, version)
        model = self._models.get(key)
        if model is not None and queued_ms >= model.ready_ms:
            return deadline_ms  # warm: the common case, decided without looking further
        record = self._known.get(name)
        function = record.versions.get(version) if record is not None else None
        if function is None:
            return deadline_ms
        if queued_ms < self._started_ms:
            # Queued before this runner started: its start was the wait, from when a gateway that
            # waits for the start woke the pool (keys.woken), else from the start itself.
            woken_ms = self.woken_ms
            began_ms = (
                self._started_ms if woken_ms is None else min(max(queued_ms, woken_ms), self._started_ms)
            )
        elif model is not None:
            began_ms = model.load_started_ms
        else:
            began_ms = self._loading_since.get(key, now_ms)
        ready_ms = model.ready_ms if model is not None else None
        load_timeout_ms = int(function.manifest.model.load_timeout_s * 1000)
        return load_deadline_ms(deadline_ms, queued_ms, began_ms, ready_ms, now_ms, load_timeout_ms)

    def offer(self, records: Mapping[str, FunctionRecord]) -> None:
        """The functions and versions this runner may load (every stored version of each)."""
        self._known = dict(records)

    def version(self, name: str, version: str) -> FunctionVersion:
        """The stored version; raises FunctionNotFound for a removed function or unknown version."""
        record = self._known.get(name)
        if record is None:
            raise FunctionNotFound(f"function '{name}' is not deployed (it may have been removed)")
        found = record.versions.get(version)
        if found is None:
            raise FunctionNotFound(f"function '{name}' has no version '{version}'")
        return found

    async def get(self, function: FunctionVersion) -> LoadedModel:
        """The loaded model of `function`, loading it in a thread on first use. Raises Unavailable
        at once while a recent load of it failed."""
        key = (function.name, function.version)
        model = self._models.get(key)
        if model is None:
            self.version(*key)
            async with self._locks.setdefault(key, asyncio.Lock()):
                model = self._models.get(key)
                if model is None:
                    failed = self._failures.get(key)
                    if failed is not None and time.monotonic() - failed[0] < self._retry_s:
                        raise failed[1]
                    model = await self._load(function, "")
        if model.stuck_since is not None:
            raise Unavailable(f"function '{key[0]}' version {key[1]}: {_stuck_reason(model)}")
        model.last_used = time.monotonic()
        return model

    async def prefetch(self, function: FunctionVersion) -> None:
        """Fetch a version's files into the artifact cache ahead of its first invocation; a failure
        is logged (the load will say it again)."""
        try:
            if await asyncio.to_thread(self._artifacts.prefetch, function):
                log.info("prefetched %s version %s", function.name, function.version)
        except (FunctionError, OSError) as exc:
            log.warning("prefetching %s version %s failed: %s", function.name, function.version, exc)

    async def acquire(self, function: FunctionVersion) -> LoadedModel:
        """`get`, and keep the model open (though it may be unloaded meanwhile) until `release`."""
        model = await self.get(function)
        model.in_use += 1
        return model

    async def release(self, model: LoadedModel) -> None:
        model.in_use -= 1
        model.last_used = time.monotonic()
        self._released.set()
        if model.unloaded and model.in_use == 0:
            await asyncio.to_thread(self._close, model)

    @contextlib.asynccontextmanager
    async def use(self, name: str, version: str) -> AsyncIterator[LoadedModel]:
        """The loaded model of a stored version, held open until exit."""
        model = await self.acquire(self.version(name, version))
        try:
            yield model
        finally:
            await self.release(model)

    async def load(self, function: FunctionVersion, request: str = "") -> LoadedModel | None:
        """Load now (a load request, a new version): forgets an earlier failure, never raises. A
        version loaded from files that have changed since (its digest) is loaded again (`_reload`)."""
        key = (function.name, function.version)
        async with self._locks.setdefault(key, asyncio.Lock()):
            self._failures.pop(key, None)
            model = self._models.get(key)
            if model is not None and function.digest and model.function.digest != function.digest:
                return await self._reload(model, function, request)
            if model is not None:
                await self._report(*key, _ready(model, request))
                return model
            with contextlib.suppress(FunctionError):
                return await self._load(function, request)
        return None

    async def _reload(self, old: LoadedModel, function: FunctionVersion, request: str) -> LoadedModel:
        """Make before break: the changed files load beside the model that serves, which serves on
        until the new one is ready, and for good if that load fails (READY, with the reason)."""
        key = (function.name, function.version)
        try:
            model = await self._build(function, _now_ms())
        except Exception as exc:
            detail = _detail(exc)
            log.error("reloading %s version %s failed (the loaded files serve on): %s", *key, detail)
            failed = dataclasses.replace(_ready(old, request), reason=f"{RELOAD_FAILED}: {detail}")
            await self._report(*key, failed)
            return old
        self._models[key] = model
        old.unloaded = True
        log.info("reloaded %s version %s (%s): load %.3f s", *key, function.digest[:12], model.load_s)
        await self._report(*key, _ready(model, request))
        if old.in_use == 0:
            await asyncio.to_thread(self._close, old)
        return model

    async def unload(self, key: Key, reason: str = "unloaded") -> bool:
        """Drop a version: new invocations load it again; batches using it finish first."""
        async with self._locks.setdefault(key, asyncio.Lock()):
            model = self._models.pop(key, None)
            self._failures.pop(key, None)
            if model is None:
                return False
            model.unloaded = True
            self._released.set()
            model_unloaded(*key, model.function.manifest.model.accelerator, model.backend, self._gpu_index)
            memory_used(self._limits, self._models.values())
            if model.stuck_since is not None:
                # The truth: its memory is held by a thread that cannot be stopped.
                reason = f"unloading: {_stuck_reason(model)}; it is freed when that batch returns"
            log.info("unloaded %s version %s (%s)", *key, reason)
            await self._report(*key, ModelState(UNAVAILABLE, reason, _now_ms()))
        if model.in_use == 0:
            await asyncio.to_thread(self._close, model)
        return True

    async def hold_stuck(self, model: LoadedModel, work: asyncio.Future[Any], started: float) -> None:
        """A batch of `model` that began at `started` (time.monotonic()) ran past its execution
        timeout in a thread that cannot be stopped: keep the model open for that thread, give the
        version no work and report it unavailable until `work` completes."""
        key = (model.function.name, model.function.version)
        model.in_use += 1
        model.stuck_since = started
        log.error("%s version %s: %s", *key, _stuck_reason(model))
        if not model.unloaded:
            await self._report(*key, ModelState(UNAVAILABLE, f"stuck: {_stuck_reason(model)}", _now_ms()))
        task = asyncio.get_running_loop().create_task(self._await_stuck(model, work))
        self._stuck.add(task)
        task.add_done_callback(self._stuck.discard)

    async def _await_stuck(self, model: LoadedModel, work: asyncio.Future[Any]) -> None:
        key = (model.function.name, model.function.version)
        with contextlib.suppress(Exception):
            await work
        log.warning("%s version %s: the stuck batch returned after %.1f s", *key, model.stuck_for_s())
        model.stuck_since = None
        await self.release(model)
        if self._models.get(key) is model:
            await self._report(*key, _ready(model, ""))
        elif key not in self._models:
            await self._report(*key, ModelState(UNAVAILABLE, "unloaded", _now_ms()))

    async def _load(self, function: FunctionVersion, request: str) -> LoadedModel:
        if self._limits is None:
            return await self._load_now(function, request)
        async with self._admission:
            await self._make_room(function, self._limits)
            model = await self._load_now(function, request)
            await self._settle(model, self._limits)
            return model

    def would_fit(self, function: FunctionVersion) -> bool:
        """Whether this runner should take invocations of `function` now: it is loaded here, or its
        load fits once idle models are unloaded, or it can never fit (its invocations are then
        answered unavailable, naming its size and the budget). False leaves them to other runners."""
        key = (function.name, function.version)
        if self._limits is None or key in self._models:
            return True
        need = self.costs.of(function)
        if budget.too_large(need, self._limits) is not None:
            return True
        return budget.make_room(need, self._limits, self._held()) is not None

    def _held(self, loaded: Key | None = None) -> list[Held]:
        """The loaded models for the planner; `loaded` (just loaded, not yet used) is never idle."""
        return [
            Held(key, model.cost, model.last_used, model.in_use == 0 and key != loaded)
            for key, model in self._models.items()
        ]

    async def _make_room(self, function: FunctionVersion, limits: MemoryLimits) -> None:
        """Unload idle models, least recently used first, until `function`'s cost fits; while the
        models in use leave too little, wait for one to be released, up to its load_timeout_s.
        Raises Unavailable when it can never fit, or did not within that time."""
        key = (function.name, function.version)
        need = self.costs.of(function)
        refusal = budget.too_large(need, limits)
        if refusal is not None:
            MEMORY_REFUSALS.labels(key[0], "too-large").inc()
            raise Unavailable(f"function '{key[0]}' version {key[1]} {refusal}")
        give_up = time.monotonic() + function.manifest.model.load_timeout_s
        while (plan := budget.make_room(need, limits, self._held())) is None:
            self._released.clear()
            try:
                async with asyncio.timeout(max(give_up - time.monotonic(), 0)):
                    await self._released.wait()
            except TimeoutError:
                MEMORY_REFUSALS.labels(key[0], "no-room").inc()
                raise Unavailable(
                    f"function '{key[0]}' version {key[1]} needs {need.host_bytes / budget.MIB:.0f} MiB "
                    f"and the models in use here leave less of this runner's memory budget"
                ) from None
        await self._evict(plan, f"evicted to make room for {key[0]} version {key[1]}")

    async def _evict(self, keys: list[Key], reason: str) -> None:
        for evicted in keys:
            if await self.unload(evicted, reason):
                MEMORY_EVICTIONS.labels(evicted[0]).inc()
        if keys:
            await asyncio.to_thread(budget.give_back_memory)

    async def _settle(self, model: LoadedModel, limits: MemoryLimits) -> None:
        """After a load, with its measured cost: unload more idle models if the measure came out
        over the estimate and the budget; a model that alone is over the budget is unloaded again
        and refused."""
        key = (model.function.name, model.function.version)
        plan = budget.make_room(budget.NOTHING, limits, self._held(loaded=key))
        if plan is not None:
            await self._evict(plan, f"evicted to make room for {key[0]} version {key[1]}")
            return
        refusal = budget.too_large(model.cost, limits)
        if refusal is None:
            log.warning("%s version %s: over the memory budget until a model in use is released", *key)
            return
        MEMORY_REFUSALS.labels(key[0], "too-large").inc()
        message = f"function '{key[0]}' version {key[1]} {refusal}"
        await self.unload(key, f"refused: {refusal}")
        await asyncio.to_thread(budget.give_back_memory)
        raise Unavailable(message)

    async def _load_now(self, function: FunctionVersion, request: str) -> LoadedModel:
        key = (function.name, function.version)
        await self._report(*key, ModelState(LOADING, "", _now_ms(), request))
        load_started_ms = self._loading_since[key] = _now_ms()
        try:
            model = await self._build(function, load_started_ms)
        except Exception as exc:
            detail = _detail(exc)
            log.error("loading %s version %s failed: %s", *key, detail)
            error = Unavailable(f"function '{key[0]}' version {key[1]} failed to load: {detail}")
            self._failures[key] = (time.monotonic(), error)
            await self._report(*key, ModelState(UNAVAILABLE, f"load-failed: {detail}", _now_ms(), request))
            raise error from exc
        finally:
            self._loading_since.pop(key, None)
        self.costs.remember(key, model.cost)
        self._models[key] = model
        loaded = model.function
        model_loaded(*key, loaded.manifest.model.accelerator, model.backend, self._gpu_index, model.cost)
        memory_used(self._limits, self._models.values())
        log.info(
            "loaded %s version %s (%s): download %.3f s, load %.3f s, %.0f MiB of host memory "
            "(%.0f MiB at the load's peak), %.0f MiB of GPU memory",
            *key,
            loaded.manifest.model.backend,
            model.download_s,
            model.load_s,
            model.cost.host_bytes / budget.MIB,
            model.cost.loading_host_bytes / budget.MIB,
            model.cost.gpu_bytes / budget.MIB,
        )
        await self._report(*key, _ready(model, request))
        return model

    async def _build(self, function: FunctionVersion, load_started_ms: int) -> LoadedModel:
        """Fetch the version's files and load its backend, in threads; raises what they raise."""
        materialized = await asyncio.to_thread(self._artifacts.materialize, function)
        loaded, download_s = materialized.function, materialized.download_s
        try:
            started = time.perf_counter()
            budget.reset_peak_rss()
            rss_before = budget.rss_bytes()
            load = Load(
                loaded.manifest,
                loaded.directory,
                self._threads,
                self._accel,
                materialized.model_bytes,
                loaded.version,
            )
            backend = await asyncio.to_thread(load_instances, load)
        except BaseException:
            self._artifacts.release(loaded)
            raise
        load_s = time.perf_counter() - started
        del materialized, load  # the file's bytes, when read into memory, are not the model's cost
        return LoadedModel(
            loaded,
            backend,
            load_s,
            time.monotonic(),
            download_s,
            load_started_ms,
            _now_ms(),
            cost=_measured(backend, rss_before),
        )

    @property
    def _gpu_index(self) -> int:
        return self._accel.device_index if self._accel is not None else 0

    def _close(self, model: LoadedModel) -> None:
        """Close the backend; one that ran in this process on a GPU has what it gave back logged
        (NVML, this process's memory before and after)."""
        in_process_gpu = getattr(model.backend, "device", "python") not in (*CPU_DEVICES, PYTHON_GPU)
        before = gpu.read_memory(self._gpu_index) if in_process_gpu else None
        try:
            model.backend.close()
        except Exception:
            log.exception("closing %s version %s failed", model.function.name, model.function.version)
        self._artifacts.release(model.function)
        after = gpu.read_memory(self._gpu_index) if before is not None else None
        if before is not None and after is not None:
            log.info(
                "closed %s version %s: %.0f MiB of GPU memory given back (this process: %s MiB)",
                model.function.name,
                model.function.version,
                gpu.freed_bytes(before, after) / gpu.MIB,
                "unknown" if after.process_bytes is None else f"{after.process_bytes / gpu.MIB:.0f}",
            )

    def close(self) -> None:
        for model in self._models.values():
            if model.stuck_since is None:  # a thread still runs in a stuck one: closing it would crash
                self._close(model)
        self._models.clear()


def load_deadline_ms(
    deadline_ms: int, queued_ms: int, began_ms: int, ready_ms: int | None, now_ms: int, load_timeout_ms: int
) -> int:
    """The loading rule: an invocation queued at `queued_ms` before its model was ready (at
    `ready_ms`; None while it is still to load, that is until `now_ms` at least) does not spend its
    deadline on that wait: the deadline moves by the time waited, at most `load_timeout_ms`. Only
    if the wait began (`began_ms`: the runner's start, or the load's) before the deadline passed:
    an invocation already past it was answered 504 and stays unrun."""
    waited_ms = (now_ms if ready_ms is None else ready_ms) - queued_ms
    if waited_ms <= 0 or began_ms >= deadline_ms:
        return deadline_ms
    return deadline_ms + min(waited_ms, load_timeout_ms)


def _measured(backend: Backend, rss_before: int) -> Cost:
    """What a load took: the runner's growth in resident memory (after it, and at its peak), the
    model's own processes (a python function's), and the GPU memory the backend measured through
    NVML."""
    own_processes = getattr(backend, "rss_bytes", None)
    processes = int(own_processes()) if own_processes else 0
    host = max(budget.rss_bytes() - rss_before, 0) + processes
    peak = max(budget.peak_rss_bytes() - rss_before, 0) + processes
    return Cost(host, int(getattr(backend, "device_memory_bytes", 0)), True, peak)


def _ready(model: LoadedModel, request: str) -> ModelState:
    return ModelState(
        READY,
        "",
        _now_ms(),
        request,
        round(model.download_s, 4),
        round(model.load_s, 4),
        model.function.digest,
    )


def _detail(exc: BaseException) -> str:
    return exc.message if isinstance(exc, FunctionError) else f"{type(exc).__name__}: {exc}"


def _stuck_reason(model: LoadedModel) -> str:
    timeout_ms = model.function.manifest.execution_timeout_s * 1000
    return (
        f"a batch has run for {model.stuck_for_s():.1f} s, past its execution timeout of "
        f"{timeout_ms:.0f} ms, and this runner gives the function no work until it returns"
    )


def _now_ms() -> int:
    return int(time.time() * 1000)
