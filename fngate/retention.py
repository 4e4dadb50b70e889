"""What a repository keeps: at most `max_versions` stored versions of a function (fewer with the
manifest's versions.max_stored), and at most `max_repository_bytes` in all. The decisions are pure;
`holders` and `admit` read what they need for the deploy sequence (fngate/deployment.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence, Set
from pathlib import Path

import redis.asyncio as aioredis

from fngate.config import RepositoryLimits
from fngate.errors import FunctionNotFound, PayloadTooLarge
from fngate.manifest import FunctionManifest
from fngate.registry import LOADING, READY, function_source, read_runners
from fngate.repository import ArtifactFile, FunctionRecord, FunctionVersion, Repository, make_record


@dataclasses.dataclass(frozen=True, slots=True)
class Retention:
    """What a deploy may leave in the repository, and which versions of the function it must not
    remove besides those served before and after it."""

    limits: RepositoryLimits
    held: frozenset[str] | None
    """What `holders` found; None where it could not be read: then nothing is removed."""


async def holders(redis: aioredis.Redis, repo: str, name: str) -> frozenset[str]:
    """The versions of function `name` that something still names: loaded or loading on a runner
    (invocations may be queued for them, and gateways send a new version's share to the newest
    older one that is ready until it is), or pinned by a step of a served pipeline."""
    runners = await read_runners(redis)
    loaded = {
        version
        for view in runners
        for (function, version), state in view.models.items()
        if function == name and state.state in (READY, LOADING)
    }
    return frozenset(loaded) | pinned(await function_source(repo, redis)(), name)


def removals(record: FunctionRecord, served_before: Iterable[str], retention: Retention) -> tuple[str, ...]:
    """The versions of `record` (the function with the new version stored) that a deploy removes."""
    if retention.held is None:
        return ()
    keep = kept(record.newest().manifest, retention.limits.max_versions)
    return prunable(record, keep, retention.held | set(served_before))


def admit(
    repository: Repository,
    manifest: FunctionManifest,
    files: Sequence[tuple[ArtifactFile, Path]],
    retention: Retention,
) -> None:
    """Refuse (PayloadTooLarge) a version that would leave the repository over
    max_repository_bytes, counting what the deploy would remove. Blocking: it lists the repository."""
    limit = retention.limits.max_repository_bytes
    if not limit:
        return
    try:
        stored = repository.get(manifest.name)
        versions, served = list(stored.versions.values()), stored.served
    except FunctionNotFound:
        versions, served = [], ()
    entries = tuple(item for item, _ in files)
    upcoming = FunctionVersion(manifest, repository.next_version(manifest.name), Path(), files=entries)
    record = make_record([*versions, upcoming])
    freeing = size_of(record.versions[number] for number in removals(record, served, retention))
    problem = storage_problem(repository.stored_bytes(), size_of([upcoming]), freeing, limit)
    if problem:
        raise PayloadTooLarge(problem)


def kept(manifest: FunctionManifest, max_versions: int) -> int:
    """How many stored versions of the function its newest manifest keeps."""
    wanted = manifest.versions.max_stored
    return min(wanted, max_versions) if wanted is not None else max_versions


def prunable(record: FunctionRecord, keep: int, held: Set[str]) -> tuple[str, ...]:
    """The versions a deploy removes, oldest first: as many as `record` holds past `keep`, of those
    that nothing serves or `held` names. Versions whose files fngate did not deploy (an unversioned
    folder, a Triton model) are never removed."""
    excess = len(record.versions) - keep
    candidates = [
        number
        for number, version in record.versions.items()
        if version.files and number not in record.served and number not in held
    ]
    return tuple(candidates[: max(excess, 0)])


def count_problems(record: FunctionRecord, keep: int) -> list[str]:
    """A version policy that serves more versions than are kept (deploy refuses it)."""
    if len(record.served) <= keep:
        return []
    return [
        f"versions: the policy serves {len(record.served)} versions, and a function keeps {keep} "
        "(versions.max_stored, at most the deployment's max_versions): serve fewer"
    ]


def pinned(records: Mapping[str, FunctionRecord], name: str) -> frozenset[str]:
    """The versions of function `name` that a step of a served pipeline version pins (`name@2`)."""
    found = set()
    for record in records.values():
        for number in record.served:
            spec = record.versions[number].manifest.pipeline
            for step in spec.steps if spec is not None else ():
                if step.function_name == name and step.pinned is not None:
                    found.add(step.pinned)
    return frozenset(found)


def size_of(versions: Iterable[FunctionVersion]) -> int:
    """The bytes of the versions' files, as their indexes record them."""
    return sum(item.size for version in versions for item in version.files)


def storage_problem(stored_bytes: int, adding_bytes: int, freeing_bytes: int, limit_bytes: int) -> str:
    """Why a deploy of `adding_bytes` is refused ('' when it fits): the repository holds
    `stored_bytes`, and the versions the deploy removes free `freeing_bytes`. 0: no limit."""
    after = stored_bytes + adding_bytes - freeing_bytes
    if not limit_bytes or after <= limit_bytes:
        return ""
    return (
        f"the repository would hold {after} bytes, over its limit of {limit_bytes} bytes "
        f"(max_repository_bytes; it holds {stored_bytes} bytes, this version adds {adding_bytes}"
        f"{f', removing its oldest versions frees {freeing_bytes}' if freeing_bytes else ''}): free "
        "space with `fngate rm` of a function no longer needed, or deploy with a lower "
        "versions.max_stored (its oldest versions are removed first); nothing was uploaded"
    )
