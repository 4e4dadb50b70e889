"""What a front end answers about the server and its functions (as the Open Inference Protocol's
models), as plain data: server and model metadata, readiness, Triton's model configuration and
statistics. HTTP renders it as JSON; gRPC fills the protocol's messages from the same documents."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

import fngate
from fngate import keys
from fngate.errors import FunctionNotFound, Unavailable
from fngate.manifest import TensorSpec
from fngate.repository import FunctionVersion
from fngate.statistics import model_stats
from gateway.catalog import Catalog
from gateway.model_config import backend_of, model_config, platform_of

EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration", "statistics"]


def server(name: str) -> dict[str, Any]:
    """Server metadata: `name` is the gateway's server_name (fngate by default)."""
    return {"name": name, "version": fngate.__version__, "extensions": EXTENSIONS}


def model(catalog: Catalog, name: str, pinned: str | None = None) -> dict[str, Any]:
    """A version's metadata; with none pinned, every served version, described by the default."""
    if pinned is not None:
        function = catalog.find(name, pinned)
        versions = [function.version]
    else:
        record = catalog.record(name)
        function = record.default or record.newest()
        versions = list(record.served)
    manifest = function.manifest
    return {
        "name": manifest.model_name,
        "versions": versions,
        "platform": platform_of(manifest),
        "inputs": [_tensor(spec) for spec in manifest.inputs],
        "outputs": [_tensor(spec) for spec in manifest.outputs],
    }


def ready(catalog: Catalog, name: str, pinned: str | None = None) -> tuple[FunctionVersion, bool]:
    """A served version is ready, idle or not (its next invocation loads it), unless explicitly
    unloaded and not loaded since."""
    function = catalog.find(name, pinned)
    return function, not catalog.is_unloaded(function.name)


def configuration(catalog: Catalog, name: str, pinned: str | None = None) -> dict[str, Any]:
    """Triton's model configuration of the version asked for, or of the default one."""
    if pinned is not None:
        function = catalog.find(name, pinned)
    else:
        record = catalog.record(name)
        function = record.default or record.newest()
    return model_config(function.manifest)


async def statistics(
    catalog: Catalog,
    redis: aioredis.Redis,
    name: str | None = None,
    pinned: str | None = None,
    readable: Callable[[str], bool] = lambda name: True,
) -> dict[str, Any]:
    """Triton's statistics of every served version (of one function, or of all that the caller may
    read), summed over every runner; a pinned version may be any stored one."""
    if name is None:
        wanted = [
            (name, version)
            for name, record in sorted(catalog.records.items())
            if readable(name)
            for version in record.served
        ]
    elif pinned is not None:
        name = catalog.resolve(name)
        record = catalog.record(name)
        if pinned not in record.versions:
            raise FunctionNotFound(f"function '{name}' has no version '{pinned[:64]}'")
        wanted = [(name, pinned)]
    else:
        name = catalog.resolve(name)
        wanted = [(name, version) for version in catalog.record(name).served]
    try:
        async with redis.pipeline(transaction=False) as pipe:
            for function, version in wanted:
                pipe.hgetall(keys.statistics(function, version))
            hashes: list[dict[bytes, bytes]] = await pipe.execute()
    except RedisError as exc:
        raise Unavailable(f"statistics are unavailable: {exc}") from exc
    return {
        "model_stats": [
            model_stats(catalog.record(function).newest().manifest.model_name, version, raw)
            for (function, version), raw in zip(wanted, hashes, strict=True)
        ]
    }


def functions(catalog: Catalog) -> list[dict[str, str]]:
    return [
        {"name": name, "version": entry.version, "backend": backend_of(entry.manifest)}
        for name, entry in sorted(catalog.functions.items())
    ]


def _tensor(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}
