"""The functions this gateway knows, their versions and load states, refreshed every few seconds
from the repository (a folder) or the registry (an S3 repository); which version answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys
from fngate.backoff import Backoff, Health, stop_if_cancelled
from fngate.errors import FunctionNotFound, Unavailable
from fngate.registry import (
    LOADING,
    NOT_LOADED,
    READY,
    UNAVAILABLE,
    ModelState,
    RunnerView,
    Source,
    control_tail,
    read_runners,
    read_unloaded,
    summarize,
)
from fngate.repository import FunctionRecord, FunctionVersion
from gateway.validation import shown

log = logging.getLogger(__name__)

MAX_PIPELINE_DEPTH = 8
"""Pipelines whose steps are pipelines: how deep a state is looked for (a cycle stops there)."""
REFRESH_MARGIN_S = 1.0


def route_weights(record: FunctionRecord, ready: set[str]) -> dict[str, int]:
    """The traffic split, except that a version not ready yet hands its share to the newest older
    version that is (make before break); with none ready, it is woken by its first invocation."""
    weights: dict[str, int] = {}
    for version, weight in record.traffic.items():
        target = version
        if version not in ready:
            older = [other for other in ready if int(other) < int(version)]
            target = max(older, key=int, default=version)
        weights[target] = weights.get(target, 0) + weight
    return weights


def choose(weights: Mapping[str, int], rng: random.Random) -> str:
    versions = list(weights)
    if len(versions) == 1:
        return versions[0]  # the usual case: no draw
    return rng.choices(versions, weights=[weights[version] for version in versions])[0]


class Catalog:
    def __init__(
        self,
        source: Source,
        redis: aioredis.Redis | None = None,
        health: Health | None = None,
        unreadable: Callable[[], Mapping[str, str]] = dict,
        block_s: float = 1.0,
    ) -> None:
        self._source = source
        self._block_s = block_s
        """The longest one read of the control stream blocks: below `redis`'s socket timeout."""
        self._unreadable_of = unreadable
        """What `source` could not read at its last read, by function (or Triton model), with why."""
        self._unreadable: Mapping[str, str] = {}
        self.redis = redis
        """The queue's Redis: runner states are read, and model control written, there."""
        self.health = health or Health("redis")
        """Whether the last refresh worked (shared with the activator): the gateway's readiness."""
        self._records: dict[str, FunctionRecord] = {}
        self._runners: list[RunnerView] = []
        self._ready: dict[str, set[str]] = {}
        self._costs: dict[str, tuple[float, float, int]] = {}
        self._unloaded: frozenset[str] = frozenset()
        self._aliases: dict[str, str] = {}
        """Triton model name -> function, where they differ (text_model -> text-model)."""
        self._rng = random.Random()
        self._control_read = ""
        """The last control-stream entry read (deploys and removals re-read the catalog at once)."""

    @property
    def functions(self) -> dict[str, FunctionVersion]:
        """Each function's newest served version."""
        return {name: record.default for name, record in self._records.items() if record.default is not None}

    @property
    def records(self) -> dict[str, FunctionRecord]:
        return self._records

    @property
    def unreadable(self) -> Mapping[str, str]:
        """The repository's folders (or registry entries) that could not be read, by name, with why:
        not served unless they read well before (then as they were)."""
        return self._unreadable

    @property
    def runners(self) -> list[RunnerView]:
        """Live runners and their model states, as of the last refresh."""
        return self._runners

    def resolve(self, name: str) -> str:
        """The function a V2 client's model name means: itself, or the function a Triton model of
        that name is served as."""
        return name if name in self._records else self._aliases.get(name, name)

    def record(self, name: str) -> FunctionRecord:
        record = self._records.get(self.resolve(name))
        if record is None:
            # Triton's words: its example clients check that the message starts with them.
            raise FunctionNotFound(
                f"Request for unknown model: '{shown(name)}' is not found (no function or Triton "
                "model of that name is deployed)"
            )
        return record

    def is_unloaded(self, name: str) -> bool:
        """Explicitly unloaded (model control) and not loaded since: not ready, invocations refused."""
        return self.resolve(name) in self._unloaded

    def set_unloaded(self, name: str, unloaded: bool) -> None:
        """What this gateway knows at once; the others learn it from Redis on their next refresh."""
        self._unloaded = self._unloaded | {name} if unloaded else self._unloaded - {name}

    def get(self, name: str, version: str | None = None) -> FunctionVersion:
        """The version that answers an invocation: the pinned one if served, else one drawn by
        traffic weight. An explicitly unloaded function answers 503 until it is loaded."""
        name = self.resolve(name)
        if name in self._unloaded:
            raise Unavailable(
                f"function '{name}' is unloaded: POST /v2/repository/models/{name}/load serves it again"
            )
        return self.find(name, version)

    def find(self, name: str, version: str | None = None) -> FunctionVersion:
        """As `get`, whether unloaded or not (metadata, configuration, readiness)."""
        name = self.resolve(name)
        record = self.record(name)
        if version is not None:
            if version not in record.served:
                served = ", ".join(record.served) or "none"
                raise FunctionNotFound(
                    f"function '{shown(name)}' has no version '{shown(version)}' (serving {served})"
                )
            return record.versions[version]
        if not record.traffic:
            raise Unavailable(f"function '{shown(name)}': its version policy serves no version")
        return record.versions[choose(route_weights(record, self._ready.get(name, set())), self._rng)]

    def cost(self, name: str) -> tuple[float, float, int] | None:
        """A function's batch cost as its live runners measured it (fixed µs a batch, µs a row, their
        mean) and how many runners report it; None before any has run a batch of it."""
        return self._costs.get(name)

    def state(self, name: str, version: str, depth: int = 0) -> ModelState:
        """A version's state over the live runners; a pipeline's (an ensemble's), which no runner
        loads, is its steps': READY when each step's function has a served version (or the pinned
        one) READY, else LOADING while one loads, else UNAVAILABLE naming the step that is not."""
        record = self._records.get(name)
        function = record.versions.get(version) if record is not None else None
        pipeline = function.manifest.pipeline if function is not None else None
        if pipeline is None or depth > MAX_PIPELINE_DEPTH:
            return summarize(self._runners, name, version)
        states = []
        for step in pipeline.steps:
            called = self.resolve(step.function_name)
            found = self._records.get(called)
            versions = [step.pinned] if step.pinned else list(found.served) if found is not None else []
            options = [self.state(called, each, depth + 1) for each in versions] or [NOT_LOADED]
            best = max(options, key=lambda state: ({READY: 2, LOADING: 1}.get(state.state, 0), state.at_ms))
            states.append((step.name, best))
        for wanted in (UNAVAILABLE, LOADING):
            for step_name, state in states:
                if state.state == wanted:
                    reason = f"step '{step_name}': {state.reason}" if state.reason else ""
                    return ModelState(wanted, reason, state.at_ms)
        return ModelState(READY, "", max(state.at_ms for _, state in states))

    async def refresh(self) -> None:
        records = await self._source()
        self._unreadable = dict(self._unreadable_of())
        added = records.keys() - self._records.keys()
        removed = self._records.keys() - records.keys()
        if added or removed:
            log.info(
                "catalog: %d functions (added %s, removed %s)", len(records), sorted(added), sorted(removed)
            )
        self._records = records
        self._aliases = {
            record.newest().manifest.model_name: name
            for name, record in records.items()
            if record.newest().manifest.model_name != name
        }
        await self.refresh_states()

    async def refresh_states(self) -> None:
        if self.redis is None:
            return
        self._runners = await read_runners(self.redis)
        self._unloaded = await read_unloaded(self.redis)
        ready: dict[str, set[str]] = {}
        for view in self._runners:
            for (function, version), state in view.models.items():
                if state.state == READY:
                    ready.setdefault(function, set()).add(version)
        self._ready = ready
        self._costs = _costs(self._runners)

    async def run(self, interval_s: float) -> None:
        """Re-read every `interval_s`, and at once when a deploy or removal is announced on the
        control stream. A failed or unanswered read keeps the last good catalog, is reported in
        `health`, and is retried with backoff (at most 1 s apart, so service resumes promptly)."""
        backoff = Backoff()
        while True:
            try:
                with contextlib.suppress(TimeoutError):
                    # No news in time says nothing of Redis by itself (the cluster client may be
                    # retrying on a failed-over slot): the refresh that follows tells.
                    await self.news(interval_s)
                async with asyncio.timeout(interval_s + REFRESH_MARGIN_S):
                    await self.refresh()
            except (OSError, RedisError) as exc:  # OSError covers TimeoutError
                stop_if_cancelled(exc)
                self.health.failed("catalog", exc)
                await asyncio.sleep(backoff.failed())
                continue
            backoff.succeeded()
            self.health.succeeded()

    async def news(self, interval_s: float) -> bool:
        """Wait up to `interval_s` for a control entry after the last one read: True once one came.
        Each read blocks `block_s` at most, below the client's socket timeout (a longer interval is
        waited in several)."""
        if self.redis is None:
            await asyncio.sleep(interval_s)
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + interval_s
        while (left := deadline - loop.time()) > 0:
            block_s = min(left, self._block_s)
            # The socket timeout is the client's own: bound each read for a paused Redis here too.
            async with asyncio.timeout(block_s + REFRESH_MARGIN_S):
                if not self._control_read:
                    # Not "$": a deploy announced while a refresh ran would wait for the next
                    # interval (another gateway's deploy answering 404 here meanwhile).
                    self._control_read = await control_tail(self.redis)
                response: Any = await self.redis.xread(
                    {keys.control(): self._control_read}, count=100, block=max(1, int(block_s * 1000))
                )
            for _stream, entries in response or ():
                self._control_read = entries[-1][0].decode()
            if response:
                return True
        return False


def _costs(runners: list[RunnerView]) -> dict[str, tuple[float, float, int]]:
    """Per function, as Catalog.cost answers: summed over the runners' views once a refresh."""
    found: dict[str, list[tuple[float, float]]] = {}
    for view in runners:
        for function, cost in view.costs.items():
            found.setdefault(function, []).append(cost)
    return {
        function: (sum(c[0] for c in costs) / len(costs), sum(c[1] for c in costs) / len(costs), len(costs))
        for function, costs in found.items()
    }
