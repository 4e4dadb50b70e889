"""Idle models and idle runners: a model unused for its manifest's idle_unload_s is unloaded and
its memory handed back to the system; a runner with no model loaded and nothing to do for
idle_shutdown_s asks to stop (local scale to zero; on Kubernetes KEDA scales instead, and the
setting stays 0)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from runner.budget import give_back_memory, rss_bytes
from runner.metrics import MODELS_LOADED, RSS_BYTES
from runner.models import LoadedModels

log = logging.getLogger(__name__)


async def watch(
    models: LoadedModels,
    busy: Callable[[], bool],
    stopping: asyncio.Event,
    idle_shutdown_s: float,
    interval_s: float = 0.25,
) -> None:
    """Until `stopping`: unload idle models; set `stopping` once the runner has been idle long enough.
    `busy()` says whether any invocation is read and not yet answered."""
    idle_since = time.monotonic()
    while not stopping.is_set():
        now = time.monotonic()
        for key, model in list(models.loaded.items()):
            limit = model.function.manifest.scaling.idle_unload_s
            if model.in_use == 0 and now - model.last_used >= limit:
                before = rss_bytes()
                if await models.unload(key, "idle-unloaded"):
                    await asyncio.to_thread(give_back_memory)
                    after = rss_bytes()
                    log.info(
                        "%s version %s idle for %.0f s: unloaded; RSS %.1f -> %.1f MiB",
                        *key,
                        limit,
                        before / 2**20,
                        after / 2**20,
                    )
        MODELS_LOADED.set(len(models.loaded))
        RSS_BYTES.set(rss_bytes())
        if models.loaded or models.loading or busy():
            idle_since = now
        elif idle_shutdown_s > 0 and now - idle_since >= idle_shutdown_s:
            log.info("no model loaded and no work for %.0f s: stopping", idle_shutdown_s)
            stopping.set()
            return
        try:
            async with asyncio.timeout(interval_s):
                await stopping.wait()
        except TimeoutError:
            pass
