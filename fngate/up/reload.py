"""`fngate up --reload`: the repository folder watched for changed functions (their files' digest),
each reloaded where a runner has it loaded, make before break: the runner loads the new files
beside the model that serves and swaps when they are ready; if they do not load, the error is
logged here and the old files serve on. The response cache of a reloaded function is cleared (an
answer given while the new files loaded may have been cached under their digest)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate.deployment import RUNNER_START_S, WARM_POLL_S, clear_cache
from fngate.registry import READY, RELOAD_FAILED, UNAVAILABLE, ControlOp, read_runners, send_control
from fngate.repository import FolderRepository, FunctionRecord

log = logging.getLogger("fngate.up.reload")
POLL_S = 0.5

Digests = dict[tuple[str, str], str]


def digests(records: dict[str, FunctionRecord]) -> Digests:
    """(function, version) -> digest of every served version."""
    return {
        (name, version): record.versions[version].digest
        for name, record in records.items()
        for version in record.served
    }


def changed(before: Digests, after: Digests) -> dict[str, tuple[str, ...]]:
    """The functions with a served version whose files changed, and those versions."""
    found: dict[str, list[str]] = {}
    for key, digest in after.items():
        if key in before and before[key] != digest:
            found.setdefault(key[0], []).append(key[1])
    return {name: tuple(versions) for name, versions in found.items()}


class ReloadWatch:
    def __init__(self, repository: FolderRepository, redis: aioredis.Redis, poll_s: float = POLL_S) -> None:
        self._repository = repository
        self._redis = redis
        self._poll_s = poll_s

    async def run(self, stopping: asyncio.Event) -> None:
        """Until `stopping`: a scan every poll_s; each changed function reloaded in a task of its own."""
        log.info("watching %s: changed functions reload where they are loaded", self._repository.root)
        known = digests(await asyncio.to_thread(self._repository.scan))
        async with asyncio.TaskGroup() as reloads:
            while not stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._poll_s):
                        await stopping.wait()
                if stopping.is_set():
                    break
                records = await asyncio.to_thread(self._repository.scan)
                current = digests(records)
                for name, versions in changed(known, current).items():
                    reloads.create_task(self._reload(records[name], versions))
                known = current

    async def _reload(self, record: FunctionRecord, versions: tuple[str, ...]) -> None:
        name = record.name
        try:
            runners = await read_runners(self._redis)
            ready = {key for view in runners for key, state in view.models.items() if state.state == READY}
            loaded = tuple(version for version in versions if (name, version) in ready)
            if not loaded:
                log.info("%s changed; nothing has it loaded: its next invocation loads the new files", name)
                return
            log.info("%s changed: reloading version %s", name, ", ".join(loaded))
            outcome = await self._await(record, loaded)
            if outcome:
                log.error("%s: %s; the files loaded before serve on", name, outcome)
                return
            cleared = await clear_cache(self._redis, name)
            log.info("%s reloaded%s", name, f" ({cleared} cached answers dropped)" if cleared else "")
        except (RedisError, OSError) as exc:
            log.error("%s changed, but could not be reloaded: redis is unavailable (%s)", name, exc)

    async def _await(self, record: FunctionRecord, versions: tuple[str, ...]) -> str:
        """Ask for the load and wait until every runner that has a version serves its new files:
        '' then, else what went wrong."""
        name = record.name
        request_id = await send_control(self._redis, ControlOp("load", name, versions))
        timeout_s = record.newest().manifest.model.load_timeout_s + RUNNER_START_S
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [
                view.models[(name, version)]
                for view in await read_runners(self._redis)
                for version in versions
                if (name, version) in view.models
            ]
            for state in states:
                if state.request == request_id and (
                    state.reason.startswith(RELOAD_FAILED) or state.state == UNAVAILABLE
                ):
                    return state.reason
            wanted = {record.versions[version].digest for version in versions}
            if states and all(state.state == READY and state.digest in wanted for state in states):
                return ""
            await asyncio.sleep(WARM_POLL_S)
        return f"the reload did not finish within {timeout_s:.0f} s"
