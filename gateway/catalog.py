"""The functions this gateway knows and their manifests, refreshed from the repository."""

from __future__ import annotations

import asyncio
import logging

from fngate.errors import FunctionNotFound
from fngate.repository import FunctionVersion, Repository

log = logging.getLogger(__name__)


class Catalog:
    def __init__(self, repository: Repository) -> None:
        self._repository = repository
        self._functions: dict[str, FunctionVersion] = {}

    @property
    def functions(self) -> dict[str, FunctionVersion]:
        return self._functions

    def get(self, name: str, version: str | None = None) -> FunctionVersion:
        entry = self._functions.get(name)
        if entry is None:
            raise FunctionNotFound(f"function '{name}' is not deployed")
        if version is not None and version != entry.version:
            raise FunctionNotFound(f"function '{name}' has no version '{version}' (serving {entry.version})")
        return entry

    async def refresh(self) -> None:
        functions = await asyncio.to_thread(self._repository.scan)
        added = functions.keys() - self._functions.keys()
        removed = self._functions.keys() - functions.keys()
        if added or removed:
            log.info(
                "catalog: %d functions (added %s, removed %s)", len(functions), sorted(added), sorted(removed)
            )
        self._functions = functions

    async def run(self, interval_s: float) -> None:
        """Re-read the repository every `interval_s`; a failed scan keeps the last good catalog."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh()
            except OSError:
                log.exception("catalog refresh failed; keeping the previous catalog")
