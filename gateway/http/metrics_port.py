"""The gateway's metrics port (8002 by default, as Triton's): GET /metrics without an API key, the
gateway's fngate_* families beside Triton's nv_* names, for Prometheus and the dashboards and
alerts Triton users run. Everything on it is read when it is scraped (the statistics hashes every
runner adds to, the gateway's own counters, NVML); nothing is counted per invocation for it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from fngate import clients, custom_metrics, keys, nv_metrics, status_port
from fngate.backoff import Health
from fngate.config import GatewaySettings
from fngate.errors import ErrorCode
from fngate.nvml import read_gpus
from fngate.registry import Source, function_source
from gateway import metrics

log = logging.getLogger(__name__)

MAX_KEYS = 10_000
"""The most API keys whose usage one scrape reports."""
REJECTED = {ErrorCode.OVERLOADED.value, ErrorCode.DEADLINE_EXCEEDED.value}
"""The gateway's answers Triton counts as REJECTED: a full queue, an invocation past its deadline."""


class MetricsPort:
    """What one scrape answers. Its Redis client is this port's own, opened on the first scrape."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._settings = settings
        self._redis: aioredis.Redis | None = None
        self._source: Source | None = None
        self._health = Health("redis (metrics port)")
        self._names: dict[str, str] = {}
        """Function -> the name Triton's series give it (`model`): the Triton model's own name where
        it came from a Triton repository (add_sub, not add-sub), else the function's."""
        self._custom: list[nv_metrics.Family] = []
        """The custom metrics of Triton Python models (pb_utils.MetricFamily), as last read."""
        self._cpu = nv_metrics.read_cpu()
        """At the last scrape (or the start): nv_cpu_utilization is the share busy since."""

    async def route(self, path: str) -> tuple[str, str, bytes]:
        if path != "/metrics":
            return status_port.NOT_FOUND
        return "200 OK", CONTENT_TYPE_LATEST, await self.scrape()

    async def scrape(self) -> bytes:
        """fngate's families, then Triton's. With Redis down: the families that need none."""
        families: list[nv_metrics.Family] = []
        try:
            families += await self._inference()
            families += await self._key_usage()
            self._health.succeeded()
        except (RedisError, OSError) as exc:
            self._health.failed("scrape", exc)
        collected = metrics.registry()
        families += nv_metrics.cache_families(
            self._by_model(metrics.counts(collected, "fngate_cache_hits")),
            self._by_model(metrics.counts(collected, "fngate_cache_misses")),
        )
        now = nv_metrics.read_cpu()
        families += nv_metrics.host_families(self._cpu, now)
        self._cpu = now
        families += nv_metrics.gpu_families(await asyncio.to_thread(read_gpus))
        families += self._custom
        return generate_latest(collected) + nv_metrics.render(families)

    async def _inference(self) -> list[nv_metrics.Family]:
        """nv_inference_* of every served version of every function (a pipeline's count its calls:
        it has no batches of its own), and the queue gauges /metrics refreshes too."""
        redis = self._client()
        if self._source is None:  # one source: a folder's digests are recomputed only on change
            self._source = function_source(self._settings.repo, redis)
        records = await self._source()
        wanted = [(name, version) for name, record in sorted(records.items()) for version in record.served]
        custom = [
            (name, version)
            for name, version in wanted
            if records[name].versions[version].manifest.pipeline is None
            and records[name].versions[version].manifest.model.backend == "python"
        ]
        async with redis.pipeline(transaction=False) as pipe:
            for name, version in wanted:
                pipe.hgetall(keys.statistics(name, version))
            for name, version in custom:
                pipe.hgetall(keys.custom_metrics(name, version))
            read: list[Any] = await pipe.execute()
        hashes = read[: len(wanted)]
        self._custom = custom_metrics.families(read[len(wanted) :])
        priorities: dict[str, int] = {}
        for name, version in wanted:
            if records[name].versions[version].manifest.pipeline is not None:
                continue  # its steps wait on their functions' streams
            levels = records[name].versions[version].manifest.batching.priorities
            priorities[name] = max(priorities.get(name, 1), levels)
        waiting = await metrics.refresh_queue_gauges(redis, priorities)
        self._names = {
            name: (record.default or record.newest()).manifest.model_name for name, record in records.items()
        }
        collected = metrics.registry()
        rejected = metrics.counts(
            collected, "fngate_request_failure", lambda labels: labels.get("code") in REJECTED
        )
        canceled = metrics.counts(collected, "fngate_withdrawn")
        counted = []
        for (name, version), raw in zip(wanted, hashes, strict=True):
            record = records[name]
            default = version == (record.default or record.newest()).version  # a function's own counts
            failures = (
                {"REJECTED": rejected.get(name, 0), "CANCELED": canceled.get(name, 0)} if default else {}
            )
            pending = waiting.get(name, 0) if default else 0
            counted.append(nv_metrics.VersionCounts(self._names[name], version, raw, failures, pending))
        return nv_metrics.inference_families(counted)

    async def _key_usage(self) -> list[nv_metrics.Family]:
        """fngate_key_compute_seconds_total and fngate_key_cpu_seconds_total: the batch time and the
        CPU time runners charged to each key (at most MAX_KEYS of them), by function."""
        redis = self._client()
        ids: Any = await redis.hkeys(keys.api_keys())
        ids = sorted(ident.decode() for ident in ids)[:MAX_KEYS]
        async with redis.pipeline(transaction=False) as pipe:
            for ident in ids:
                pipe.hgetall(keys.key_usage(ident))
                pipe.hgetall(keys.key_cpu(ident))
            charged: list[Any] = await pipe.execute()

        def samples(of: list[Any]) -> tuple[Any, ...]:
            return tuple(
                ((("function", function.decode()), ("key_id", ident)), float(seconds))
                for ident, hashed in zip(ids, of, strict=True)
                for function, seconds in sorted(hashed.items())
            )

        return [
            nv_metrics.Family(
                "fngate_key_compute_seconds_total",
                "Seconds of batch time charged to each API key, by function (a batch's time split by rows)",
                "counter",
                samples(charged[0::2]),
            ),
            nv_metrics.Family(
                "fngate_key_cpu_seconds_total",
                "CPU seconds charged to each API key, by function (a batch's CPU time split by rows; "
                "functions in a process of their own)",
                "counter",
                samples(charged[1::2]),
            ),
        ]

    def _by_model(self, counts: dict[str, float]) -> dict[str, float]:
        return {self._names.get(name, name): value for name, value in counts.items()}

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            timeout_s = self._settings.redis_timeout_s
            self._redis = clients.connect(
                self._settings.redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
            )
        return self._redis

    async def aclose(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


@contextlib.asynccontextmanager
async def serving(settings: GatewaySettings) -> AsyncIterator[None]:
    """Serve the metrics port while inside (on `metrics_bind`, else on its own address)."""
    if settings.metrics_bind.startswith("fd://"):
        sock: socket.socket | None = socket.socket(fileno=int(settings.metrics_bind.removeprefix("fd://")))
    else:
        sock = status_port.bind(settings.metrics_host or settings.host, settings.metrics_port, "metrics")
    if sock is None:
        yield
        return
    port = MetricsPort(settings)
    server = await status_port.start(port.route, "", 0, sock)
    where = sock.getsockname()
    log.info("metrics on http://%s:%d/metrics", where[0], where[1])
    try:
        yield
    finally:
        server.close()
        await port.aclose()
