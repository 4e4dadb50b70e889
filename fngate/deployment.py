"""What deploying, routing and removing a function does, for `fngate deploy`, `traffic`, `rollback`
and `rm` and for the gateway's deploy API alike: check a function's folder, store it as the next
version and remove the oldest past what the function keeps (fngate/retention.py), keep the registry
in step, tell the runners; move traffic between stored versions, make before break; remove every
version and answer what was queued for it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from fngate import clients, delivery, keys, queue, retention
from fngate.config import RepositoryLimits
from fngate.errors import FunctionError, FunctionNotFound, InvalidArgument, Unavailable
from fngate.manifest import MANIFEST_FILE, FunctionManifest, ManifestError, load_manifest
from fngate.pipeline import deploy_problems
from fngate.registry import (
    READY,
    UNAVAILABLE,
    ControlOp,
    Registry,
    create_stream,
    priorities_of,
    read_runners,
    send_control,
    set_unloaded,
    summarize,
)
from fngate.repository import (
    ArtifactFile,
    FunctionRecord,
    FunctionVersion,
    Repository,
    Routing,
    collect_files,
    hash_file,
    is_remote,
    make_record,
    open_repository,
    policy_problems,
    routing_problems,
)
from fngate.wire import Reply, invocations_of

REPLY_MAXLEN = 100_000
RUNNER_START_S = 2.0
"""A runner process's start before it loads anything (imports, Redis, discovery)."""
WARM_POLL_S = 0.2


def deploy_files(path: Path, manifest: FunctionManifest) -> list[tuple[ArtifactFile, Path]]:
    """The manifest (stored as function.yaml whatever its name) and the files of its folder."""
    manifest_file = path.resolve()
    files = [
        (item, source)
        for item, source in collect_files(manifest_file.parent)
        if item.path != MANIFEST_FILE and source.resolve() != manifest_file
    ]
    files.insert(
        0, (ArtifactFile(MANIFEST_FILE, hash_file(manifest_file), manifest_file.stat().st_size), path)
    )
    if manifest.pipeline is not None:
        return files[:1]  # a pipeline is its manifest alone
    if not any(item.path == manifest.model.path for item, _ in files):
        # Named from the function's folder: a deploy through the gateway unpacks it in a scratch
        # folder of the gateway's, which is no business of the caller's.
        raise InvalidArgument(f"{manifest.model.path} does not exist in the function's folder (model.path)")
    return files


def policy_check(repository: Repository, manifest: FunctionManifest, max_versions: int) -> list[str]:
    """The version policy as it will be with this version added as the next number: it must serve
    no more versions than the function keeps."""
    try:
        stored = list(repository.get(manifest.name).versions.values())
    except FunctionNotFound:
        stored = []
    upcoming = FunctionVersion(manifest, repository.next_version(manifest.name), Path())
    record = make_record([*stored, upcoming])
    return policy_problems(record) + retention.count_problems(record, retention.kept(manifest, max_versions))


async def warm(redis: aioredis.Redis, name: str, versions: Sequence[str], pool: str, timeout_s: float) -> str:
    """Ask the pool's runners to load `versions` of `name` (waking the pool when none runs) and
    wait until one runner has each ready: '' then, else what went wrong."""
    request_id = await send_control(redis, ControlOp("load", name, tuple(versions)))
    if not any(view.pool == pool for view in await read_runners(redis)):
        await clients.publish(redis, keys.wake_channel(), pool)  # a runner that starts replays the load
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runners = await read_runners(redis)
        states = {version: summarize(runners, name, version) for version in versions}
        for version, state in states.items():
            if state.state == UNAVAILABLE and state.request == request_id:
                return f"version {version} failed to load: {state.reason}"
        if all(state.state == READY for state in states.values()):
            return ""
        await asyncio.sleep(WARM_POLL_S)
    return f"was not loaded within {timeout_s:.0f} s (is a runner of pool '{pool}' running?)"


async def route(
    repository: Repository, redis: aioredis.Redis, name: str, traffic: Mapping[str, int]
) -> tuple[FunctionRecord, str]:
    """Send unpinned invocations of `name` to stored versions by weight, make before break: the
    versions to be served are served first, beside the current ones (loadable and pinnable);
    where a runner has the function loaded, they are loaded and ready before traffic moves; then it
    moves, and versions no longer routed stop being served. A load that fails leaves the routing
    as it was (raises Unavailable). Returns the new record and how the loads went ('' for none)."""
    record = await asyncio.to_thread(repository.get, name)
    problems = routing_problems(record, traffic)
    if problems:
        raise InvalidArgument(f"function '{name}': " + "; ".join(problems))
    weights = {version: weight for version, weight in traffic.items() if weight}
    targets = tuple(sorted(weights, key=int))
    before = record.routing
    making = Routing(tuple(sorted(set(record.served) | set(targets), key=int)), dict(record.traffic))
    await _set_routing(repository, redis, name, making)
    manifest = record.newest().manifest
    runners = await read_runners(redis)
    loaded = any(
        key[0] == name and state.state == READY for view in runners for key, state in view.models.items()
    )
    note = ""
    if loaded and manifest.pipeline is None:
        started = time.monotonic()
        timeout_s = manifest.model.load_timeout_s + RUNNER_START_S
        failure = await warm(redis, name, targets, manifest.scaling.pool, timeout_s)
        if failure:
            await _set_routing(repository, redis, name, before)
            raise Unavailable(f"function '{name}': {failure}; its traffic stays as it was")
        note = f"versions {', '.join(targets)} loaded ({time.monotonic() - started:.1f} s)"
    await _set_routing(repository, redis, name, Routing(targets, weights))
    return await asyncio.to_thread(repository.get, name), note


async def _set_routing(
    repository: Repository, redis: aioredis.Redis, name: str, routing: Routing | None
) -> None:
    await asyncio.to_thread(repository.set_routing, name, routing)
    if is_remote(repository.url):
        await Registry(redis, repository.url).put(await asyncio.to_thread(repository.get, name))
    await send_control(redis, ControlOp("deploy", name))  # runners and gateways look now


def previous_version(traffic: Iterable[str], stored: Iterable[str]) -> str | None:
    """What `fngate rollback NAME` goes back to: the stored version just before the newest one
    that takes traffic now."""
    current = max((int(version) for version in traffic), default=0)
    older = [version for version in stored if int(version) < current]
    return max(older, key=int) if older else None


def pipelines_using(records: Mapping[str, FunctionRecord], name: str) -> list[str]:
    """The pipelines whose served versions have a step that calls function `name`."""
    found = []
    for other, record in sorted(records.items()):
        for version in record.served:
            spec = record.versions[version].manifest.pipeline
            if spec is not None and any(step.function_name == name for step in spec.steps):
                found.append(f"{other} (version {version})")
    return found


async def withdraw(
    repository: Repository, record: FunctionRecord, redis: aioredis.Redis, grace_s: float
) -> int:
    """Remove every version of a function, tell the runners, answer its queued invocations
    not_found (now and after `grace_s`); returns how many were answered. `fngate rm` and the deploy
    API's DELETE. A function that a pipeline calls is not removed (InvalidArgument): the pipeline
    would answer 404 from then on."""
    users = pipelines_using(await asyncio.to_thread(repository.scan), record.name)
    if users:
        raise InvalidArgument(
            f"function '{record.name}' is a step of pipeline {', '.join(users)}: remove or redeploy "
            "the pipeline first"
        )
    if is_remote(repository.url):
        await Registry(redis, repository.url).remove(record.name)
    await asyncio.to_thread(repository.remove, record.name)
    await set_unloaded(redis, record.name, False)  # a function deployed again under this name starts loadable
    await send_control(redis, ControlOp("remove", record.name))
    priorities = priorities_of(record)
    answered = await answer_queued(redis, record.name, priorities)
    await asyncio.sleep(grace_s)
    return answered + await answer_queued(redis, record.name, priorities)


def check(
    path: Path,
    repository: Repository,
    manifest: FunctionManifest,
    limits: RepositoryLimits,
    upcoming: Sequence[FunctionManifest] = (),
) -> tuple[list[tuple[ArtifactFile, Path]], list[str]]:
    """Step one of deploying (blocking: it reads the folder and the repository): the files the
    manifest at `path` deploys, and every problem that stops it (the version policy, a pipeline's
    steps against the functions deployed now or about to be, as the next version of their function
    when deployed in the same command: `upcoming`). The storage limit is `retention.admit`'s."""
    files = deploy_files(path, manifest)
    policy = policy_check(repository, manifest, limits.max_versions)
    return files, policy + steps_check(repository, manifest, upcoming)


def steps_check(
    repository: Repository, manifest: FunctionManifest, upcoming: Sequence[FunctionManifest] = ()
) -> list[str]:
    """A pipeline's graph, and its steps against the functions deployed now (each must exist) or
    about to be (`upcoming`); nothing for a function."""
    if manifest.pipeline is None:
        return []
    records = repository.scan()
    for other in upcoming:
        stored = list(records[other.name].versions.values()) if other.name in records else []
        records[other.name] = make_record(
            [*stored, FunctionVersion(other, repository.next_version(other.name), Path())]
        )
    return [f"{where}: {problem}" for where, problem in deploy_problems(manifest, records)]


def store(
    repository: Repository,
    manifest: FunctionManifest,
    files: list[tuple[ArtifactFile, Path]],
    progress: Any = lambda count: None,
    keeping: retention.Retention | None = None,
) -> tuple[FunctionVersion, FunctionRecord, tuple[str, ...]]:
    """Step two (blocking): the files stored as the function's next version, then, with `keeping`,
    the oldest versions past what the function keeps removed, each index before its files (the
    versions served before this deploy and those `keeping.held` names stay). Returns the version,
    the function's record after, and the versions removed."""
    try:
        served_before = repository.get(manifest.name).served
    except FunctionNotFound:
        served_before = ()
    version = repository.add_version(manifest, files, progress)
    record = repository.get(manifest.name)
    removed = retention.removals(record, served_before, keeping) if keeping is not None else ()
    if removed:
        repository.remove_versions(manifest.name, removed)
        kept = [item for number, item in record.versions.items() if number not in removed]
        record = make_record(kept, record.routing)
    return version, record, removed


async def announce(redis: aioredis.Redis, repository_url: str, record: FunctionRecord) -> None:
    """Step three: the registry records the function (S3 repositories; a folder is its own
    record), its invocation streams and runner group exist, and the runners are told to look."""
    if is_remote(repository_url):
        await Registry(redis, repository_url).put(record)
    else:
        await create_stream(redis, record.name, priorities_of(record))
    await send_control(redis, ControlOp("deploy", record.name))


async def publish(
    path: Path,
    repository: Repository,
    redis: aioredis.Redis,
    limits: RepositoryLimits,
    name: str | None = None,
) -> tuple[FunctionVersion, FunctionRecord, tuple[str, ...]]:
    """The deploy API's deploy, the same three steps as `fngate deploy` (fngate.cli.deploy):
    check, store (and remove the oldest versions past what the function keeps), announce. Raises
    FunctionError; nothing is stored for a manifest (not named `name`, when given) or a version
    policy that fails its check, nor past the repository's storage limit (PayloadTooLarge)."""
    try:
        manifest = load_manifest(path)
    except ManifestError as exc:
        raise InvalidArgument("; ".join(line.removeprefix(f"{path}: ") for line in exc.lines())) from None
    if name is not None and manifest.name != name:
        raise InvalidArgument(f"the manifest names '{manifest.name}', not '{name}'")
    files, problems = await asyncio.to_thread(check, path, repository, manifest, limits)
    if problems:
        raise InvalidArgument("; ".join(problems))
    keeping = retention.Retention(limits, await retention.holders(redis, repository.url, manifest.name))
    await asyncio.to_thread(retention.admit, repository, manifest, files, keeping)
    version, record, removed = await asyncio.to_thread(store, repository, manifest, files, keeping=keeping)
    await announce(redis, repository.url, record)
    return version, record, removed


def describe(record: FunctionRecord) -> dict[str, Any]:
    """A function's stored versions as the deploy API answers GET."""
    return {
        "name": record.name,
        "served": list(record.served),
        "traffic": record.traffic,
        "versions": [
            {
                "version": number,
                "digest": version.digest,
                "backend": version.manifest.model.backend
                if version.manifest.pipeline is None
                else "pipeline",
                "files": [
                    {"path": item.path, "sha256": item.sha256, "size": item.size} for item in version.files
                ],
            }
            for number, version in record.versions.items()
        ],
    }


def open_any(url: str) -> Repository:
    """A repository from its URL: a folder, or S3 (fngate/s3.py, with boto3)."""
    if is_remote(url):
        from fngate.s3 import S3Repository

        return S3Repository(url)
    return open_repository(url)


async def clear_cache(redis: aioredis.Redis, function: str) -> int:
    """Drop every cached response of `function` (`fngate cache clear`, and after a live reload);
    returns how many."""
    cleared = 0
    batch: list[bytes] = []
    async for key in redis.scan_iter(match=keys.cache_prefix(function) + "*", count=1000):
        batch.append(key)
        if len(batch) == 1000:
            cleared += await redis.unlink(*batch)
            batch.clear()
    if batch:
        cleared += await redis.unlink(*batch)
    return cleared


async def answer_queued(redis: aioredis.Redis, name: str, priorities: int = 1) -> int:
    """Answer every invocation queued for `name` (and those waiting on it) not_found, at every
    priority level; delete them."""
    answered = 0
    for stream in keys.levels(name, priorities):
        answered += await _answer_stream(redis, stream, name)
    return answered


async def _answer_stream(redis: aioredis.Redis, stream: str, name: str) -> int:
    finish = redis.register_script(queue.FINISH)
    across_slots = delivery.registered(redis) if clients.is_cluster_client(redis) else None
    error = FunctionNotFound(f"function '{name}' was removed")
    answered = 0
    while True:
        entries: Any = await redis.xrange(stream, count=500)
        if not entries:
            break
        outgoing = []
        extra = 0
        for _entry_id, fields in entries:
            try:
                members = invocations_of(fields)
            except (KeyError, ValueError, TypeError, FunctionError):
                continue
            extra += len(members) - 1
            for invocation, _ in members:
                reply = Reply(invocation.id, invocation.version, {}, error).encode()
                outgoing.append(
                    queue.Outgoing(
                        reply,
                        invocation.reply_to,
                        in_flight=invocation.in_flight_key or "",
                        reply_ttl_ms=invocation.result_ttl_s * 1000,
                    )
                )
        ids = [entry_id for entry_id, _ in entries]
        size = sum(queue.entry_bytes(fields) for _, fields in entries)
        if across_slots is not None:  # a Redis Cluster: the gateways' reply streams are elsewhere
            await delivery.finish(
                across_slots, stream, keys.RUNNER_GROUP, outgoing, ids, size, REPLY_MAXLEN, extra=extra
            )
        else:
            call = queue.finish_call(
                stream, keys.RUNNER_GROUP, outgoing, ids, size, REPLY_MAXLEN, extra=extra
            )
            await finish(keys=call.keys, args=call.args)
        answered += len(outgoing)
    return answered
