"""main(settings, stopping): one TaskGroup with a consume loop per function and the discovery loop.
The composition root of the runner."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid

import redis.asyncio as aioredis

from fngate.config import RunnerSettings
from fngate.repository import FunctionVersion, Repository, open_repository
from runner.consumer import FunctionConsumer
from runner.pool import ModelPool
from runner.status import StatusServer

log = logging.getLogger(__name__)


def consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def main(settings: RunnerSettings, stopping: asyncio.Event) -> None:
    name = consumer_name()
    repository = open_repository(settings.repo)
    pool = ModelPool(settings.intra_op_threads)
    redis = aioredis.from_url(settings.redis_url, socket_connect_timeout=5)
    consumers: dict[str, FunctionConsumer] = {}
    loops: list[asyncio.Task[None]] = []
    async with redis:
        await redis.ping()
        log.info("runner %s started (repository %s)", name, settings.repo)
        try:
            async with asyncio.TaskGroup() as tasks:

                async def discover() -> None:
                    while not stopping.is_set():
                        for function in await _servable(repository, settings):
                            consumer = consumers.get(function.name)
                            if consumer is None:
                                consumer = FunctionConsumer(redis, function, pool, settings, name, stopping)
                                consumers[function.name] = consumer
                                loops.append(
                                    tasks.create_task(consumer.run(), name=f"consume {function.name}")
                                )
                                log.info("consuming %s version %s", function.name, function.version)
                            else:
                                consumer.function = function
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(settings.rescan_s):
                                await stopping.wait()

                loops.append(tasks.create_task(discover(), name="discover"))
                status = StatusServer(
                    settings.status_host, settings.status_port, ready=lambda: bool(consumers)
                )
                serving = tasks.create_task(status.run(), name="status")
                await stopping.wait()
                log.info("runner %s draining (up to %.0f s)", name, settings.drain_timeout_s)
                await _drain(loops, settings.drain_timeout_s)
                serving.cancel()
        finally:
            pool.close()
    log.info("runner %s stopped", name)


async def _drain(loops: list[asyncio.Task[None]], timeout_s: float) -> None:
    """Give the loops `timeout_s` to finish what they read; then cancel what is left."""
    _done, late = await asyncio.wait(loops, timeout=timeout_s)
    for task in late:
        log.warning("cancelling %s after the drain timeout", task.get_name())
        task.cancel()


async def _servable(repository: Repository, settings: RunnerSettings) -> list[FunctionVersion]:
    functions = await asyncio.to_thread(repository.scan)
    wanted = set(settings.functions)
    return [
        function
        for name, function in functions.items()
        if (name in wanted if wanted else function.manifest.scaling.pool == settings.pool)
    ]
