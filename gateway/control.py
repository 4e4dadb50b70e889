"""Model control, whatever the front end: the Open Inference Protocol's model repository extension
(the index, load and unload), carried out through Redis by every runner of a function's pool."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import clients, keys
from fngate.errors import FunctionError, InvalidArgument, Unavailable
from fngate.manifest import ManifestError
from fngate.queue.stored import text
from fngate.registry import (
    READY,
    RELOAD_FAILED,
    UNAVAILABLE,
    ControlOp,
    id_order,
    send_control,
    set_unloaded,
)
from fngate.repository import FunctionRecord, is_triton_model
from gateway.catalog import MAX_PIPELINE_DEPTH, Catalog

POLL_S = 0.1


async def repository_index(catalog: Catalog, ready_only: bool = False) -> list[dict[str, str]]:
    """Every function version that is served or loaded somewhere, with its state and reason; and
    every folder of the repository that cannot be read (and is not served as it was read last),
    UNAVAILABLE with why, under its folder's name and no version, as Triton lists a model it could
    not load."""
    await _refresh_states(catalog)
    loaded = {key for view in catalog.runners for key in view.models}
    entries = []
    for name, record in sorted(catalog.records.items()):
        versions = set(record.served) | {version for function, version in loaded if function == name}
        for version in sorted(versions & record.versions.keys(), key=int):
            state = catalog.state(name, version)
            if not ready_only or state.state == READY:
                model = record.newest().manifest.model_name  # a Triton model's own name
                entries.append(
                    {"name": model, "version": version, "state": state.state, "reason": state.reason}
                )
    models = {record.newest().manifest.model_name for record in catalog.records.values()}
    served = catalog.records.keys() | models
    if not ready_only:
        entries += [
            {"name": name, "state": UNAVAILABLE, "reason": reason}
            for name, reason in sorted(catalog.unreadable.items())
            if name not in served
        ]
    return sorted(entries, key=lambda entry: entry["name"])


async def load_request(catalog: Catalog, name: str, parameters: dict[str, object], timeout_s: float) -> None:
    """Triton's load request (both protocols): a Triton model's configuration given with it is
    checked and then served in place of its config.pbtxt, by every gateway and runner, until a load
    without one; then `load`. What fails says so in Triton's words first ("failed to load '<name>':
    ..."), which its clients look for."""
    try:
        config = _config_of(parameters)
        before = await _override(catalog, name, config)
        try:
            await load(catalog, name, timeout_s)
        except FunctionError as exc:
            if config is None:
                raise
            # The model serves on as it was (its runners kept the files they had loaded), and so
            # does every gateway once the configuration it was served with is back.
            await _restore(catalog, name, before)
            if isinstance(exc, LoadFailed):  # the configuration cannot serve the model
                raise InvalidArgument(exc.message) from None
            raise
    except FunctionError as exc:
        failed = type(exc)(f"failed to load '{name}': {exc.message}")
        raise failed from None


class LoadFailed(Unavailable):
    """A runner could not load the model as the repository (or a load's configuration) has it."""


MAX_CONFIG_CHARS = 64 * 1024


def _config_of(parameters: dict[str, object]) -> str | None:
    """A load request's `config` (None: none); its `file:` parameters (model files of its own) are
    refused, never silently ignored: fngate's runners load the files the repository holds."""
    files = sorted(key for key in parameters if key.startswith("file:"))
    if files:
        raise InvalidArgument(
            f"failed to poll from model repository: model files given with the load request "
            f"({', '.join(files)[:200]}) are not taken: deploy them (fngate deploy), then load"
        )
    config = parameters.get("config")
    if config is None:
        return None
    if not isinstance(config, str) or len(config) > MAX_CONFIG_CHARS:
        raise InvalidArgument(
            f"load: parameters.config must be a string of at most {MAX_CONFIG_CHARS} characters: the "
            "configuration as JSON"
        )
    from fngate.triton.config import parse_config_json

    try:  # a configuration that is none is refused as Triton refuses it
        parse_config_json(config, "load: parameters.config")
    except ManifestError as exc:
        raise InvalidArgument(str(exc)[:1000]) from None
    return config


async def _override(catalog: Catalog, name: str, config: str | None) -> str | None:
    """Serve a Triton model with `config` in place of its config.pbtxt (read as Triton reads an
    override: the whole configuration, completed from the model file), or, for None, with its
    config.pbtxt again. Checked here first, by reading the model's folder with it. Answers the
    configuration it was served with before (None: its config.pbtxt)."""
    version = catalog.record(name).newest()
    model = version.manifest.model_name
    if config is None:
        await _serve_with(catalog, model, None)
        return None
    folder = version.directory
    if not is_triton_model(folder) or version.files:
        raise InvalidArgument(
            "load: a configuration given with the load request applies to a Triton model of a "
            f"repository folder; function '{version.name}' is deployed from its manifest: deploy the "
            "change (fngate deploy), then load"
        )
    from fngate.triton.models import read_model

    try:
        await asyncio.to_thread(read_model, folder, config)
    except ManifestError as exc:
        raise InvalidArgument(str(exc)[:1000]) from None
    try:
        before: bytes | str | None = await _redis(catalog).hget(keys.config_overrides(), model)
    except RedisError as exc:
        raise Unavailable(f"the registry is unavailable: {exc}") from exc
    await _serve_with(catalog, model, config)
    return None if before is None else text(before)


async def _serve_with(catalog: Catalog, model: str, config: str | None) -> None:
    """The configuration every gateway and runner serves a Triton model with (None: its
    config.pbtxt), in Redis (fngate.keys.config_overrides)."""
    redis = _redis(catalog)
    try:
        if config is None:
            await redis.hdel(keys.config_overrides(), model)
        else:
            await redis.hset(keys.config_overrides(), model, config)
    except RedisError as exc:
        raise Unavailable(f"the registry is unavailable: {exc}") from exc


async def _restore(catalog: Catalog, name: str, config: str | None) -> None:
    """The configuration a model was served with before a load that failed, back (None: its
    config.pbtxt), and the catalog read again with it."""
    await _serve_with(catalog, catalog.record(name).newest().manifest.model_name, config)
    try:
        await catalog.refresh()
    except (RedisError, OSError) as exc:
        raise Unavailable(f"the registry is unavailable: {exc}") from exc


async def load(catalog: Catalog, name: str, timeout_s: float, depth: int = 0) -> None:
    """Ask every runner of the function's pool to load its served versions now; return when one
    runner has each ready within `timeout_s`, or raise Unavailable with the reason a load failed. A
    version loaded from files that have changed since is loaded again, beside the one that serves
    (which serves on if that fails). A pipeline (an ensemble) loads the functions of its steps."""
    if depth == 0:
        try:
            await catalog.refresh()  # the files as they are now: their digests say what to reload
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the repository is unavailable: {exc}") from exc
    record = catalog.record(name)
    await _mark_unloaded(catalog, record.name, False)
    pipeline = (record.default or record.newest()).manifest.pipeline
    if pipeline is not None:
        if depth < MAX_PIPELINE_DEPTH:
            for step in sorted({catalog.resolve(step.function_name) for step in pipeline.steps}):
                await load(catalog, step, timeout_s, depth + 1)
        return
    request_id = await _send(catalog, ControlOp("load", record.name, record.served))
    await _wake(catalog, record)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await _refresh_states(catalog)
        failure = _load_outcome(catalog, record, request_id)
        if failure is None:
            return
        if failure:
            raise LoadFailed(f"function '{record.name}': {failure}")
        await asyncio.sleep(POLL_S)
    waited = f"{timeout_s:.0f} s"
    raise Unavailable(f"function '{record.name}' did not load within {waited}{_no_runner(catalog, record)}")


async def unload(catalog: Catalog, name: str, timeout_s: float) -> None:
    """Ask every runner to unload every version of the function; return once each live runner has
    done so (within `timeout_s`). Until a load, the function is not ready and its invocations get
    503 (on every gateway: the mark is in Redis before the control entry that makes them refresh)."""
    record = catalog.record(name)
    await _mark_unloaded(catalog, record.name, True)
    request_id = await _send(catalog, ControlOp("unload", record.name, tuple(record.versions)))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await _refresh_states(catalog)
        if all(id_order(view.control) >= id_order(request_id) for view in catalog.runners):
            return
        await asyncio.sleep(POLL_S)
    late = [view.name for view in catalog.runners if id_order(view.control) < id_order(request_id)]
    raise Unavailable(f"function '{record.name}': runners {late} did not confirm the unload in time")


def _load_outcome(catalog: Catalog, record: FunctionRecord, request_id: str) -> str | None:
    """None when every served version is ready somewhere, from its files as they are now; a reason
    when a load for this request failed and none is still loading; '' while waiting."""
    waiting = False
    for version in record.served:
        state = catalog.state(record.name, version)
        if state.request == request_id and state.reason.startswith(RELOAD_FAILED):
            return f"version {version}: {state.reason} (the files loaded before serve on)"
        if state.state == UNAVAILABLE and state.request == request_id:
            return f"version {version}: {state.reason}"
        current = record.versions[version].digest
        waiting = (
            waiting or state.state != READY or bool(state.digest and current and state.digest != current)
        )
    return "" if waiting else None


def _no_runner(catalog: Catalog, record: FunctionRecord) -> str:
    pool = record.newest().manifest.scaling.pool
    if any(view.pool == pool for view in catalog.runners):
        return ""
    return f" (no runner of pool '{pool}' is running; one that starts within 10 minutes loads it)"


async def _wake(catalog: Catalog, record: FunctionRecord) -> None:
    """With no runner of the pool alive, ask the scaler for one: it carries out the load request."""
    await _refresh_states(catalog)
    pool = record.newest().manifest.scaling.pool
    if not any(view.pool == pool for view in catalog.runners):
        try:
            await clients.publish(_redis(catalog), keys.wake_channel(), pool)
        except RedisError as exc:
            raise Unavailable(f"could not ask for a runner of pool '{pool}': {exc}") from exc


async def _send(catalog: Catalog, op: ControlOp) -> str:
    try:
        return await send_control(_redis(catalog), op)
    except RedisError as exc:
        raise Unavailable(f"the control stream is unavailable: {exc}") from exc


async def _mark_unloaded(catalog: Catalog, name: str, unloaded: bool) -> None:
    try:
        await set_unloaded(_redis(catalog), name, unloaded)
    except RedisError as exc:
        raise Unavailable(f"the registry is unavailable: {exc}") from exc
    catalog.set_unloaded(name, unloaded)


async def _refresh_states(catalog: Catalog) -> None:
    try:
        await catalog.refresh_states()
    except RedisError as exc:
        raise Unavailable(f"runner states are unavailable: {exc}") from exc


def _redis(catalog: Catalog) -> aioredis.Redis:
    if catalog.redis is None:
        raise Unavailable("model control needs the queue's Redis")
    return catalog.redis
