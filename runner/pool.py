"""Loaded models: each function version is loaded on first use, once even when asked concurrently."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from fngate.errors import Unavailable
from fngate.repository import FunctionVersion
from runner.backends import Backend, load_backend

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class LoadedModel:
    function: FunctionVersion
    backend: Backend
    load_s: float
    last_used: float


class ModelPool:
    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._models: dict[tuple[str, str], LoadedModel] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    @property
    def loaded(self) -> dict[tuple[str, str], LoadedModel]:
        return self._models

    async def get(self, function: FunctionVersion) -> LoadedModel:
        """The loaded model of `function`, loading it in a thread on first use."""
        key = (function.name, function.version)
        model = self._models.get(key)
        if model is None:
            async with self._locks.setdefault(key, asyncio.Lock()):
                model = self._models.get(key)
                if model is None:
                    model = await self._load(function)
                    self._models[key] = model
        model.last_used = time.monotonic()
        return model

    async def _load(self, function: FunctionVersion) -> LoadedModel:
        started = time.perf_counter()
        manifest = function.manifest
        try:
            backend = await asyncio.to_thread(load_backend, manifest, function.directory, self._threads)
        except Exception as exc:
            log.exception("loading %s version %s failed", function.name, function.version)
            raise Unavailable(f"function '{function.name}' failed to load: {exc}") from exc
        load_s = time.perf_counter() - started
        log.info(
            "loaded %s version %s (%s) in %.3f s",
            function.name,
            function.version,
            manifest.model.backend,
            load_s,
        )
        return LoadedModel(function, backend, load_s, time.monotonic())

    def close(self) -> None:
        for model in self._models.values():
            model.backend.close()
        self._models.clear()
