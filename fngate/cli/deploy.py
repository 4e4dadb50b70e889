"""`fngate deploy`, `fngate ls` and `fngate rm`: versions into and out of a repository (a folder or
S3), the registry kept in step with an S3 repository, and the queued invocations of a removed
function answered. The repository object comes from the CLI (boto3 only for an S3 one: fngate/s3.py)."""

from __future__ import annotations

import asyncio
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import orjson
from redis.exceptions import RedisError

from fngate import clients, deployment, retention
from fngate.cli.examples import example_body, example_v2_body
from fngate.config import RepositoryLimits
from fngate.deployment import RUNNER_START_S, warm, withdraw
from fngate.errors import ErrorCode, FunctionError, InvalidArgument
from fngate.manifest import FunctionManifest, ManifestError, load_manifest
from fngate.pipeline import order
from fngate.registry import (
    ControlOp,
    Registry,
    create_stream,
    priorities_of,
    read_runners,
    send_control,
    summarize,
)
from fngate.repository import (
    FunctionRecord,
    FunctionVersion,
    Repository,
    is_remote,
)

LARGE_BYTES = 8 * 1024 * 1024
"""Uploads from this size on get a progress bar (on a terminal)."""
REPLY_MAXLEN = 100_000
DOWNLOAD_BYTES_PER_S = 50e6
"""A cautious repository throughput for the load estimate (what moto's S3 stand-in gave on loopback;
S3 in the same region gives more)."""
LOAD_BYTES_PER_S = 300e6
"""onnxruntime's session creation, measured: 268 MB in 0.64-0.75 s on one core."""


class ProgressBar:
    """Bytes uploaded of `total`, redrawn on one terminal line; boto3 reports from several threads."""

    def __init__(self, total: int, stream: TextIO, label: str) -> None:
        self._total = max(total, 1)
        self._stream = stream
        self._label = label
        self._done = 0
        self._drawn = 0.0
        self._lock = threading.Lock()
        self.enabled = total >= LARGE_BYTES and stream.isatty()

    def __call__(self, count: int) -> None:
        with self._lock:
            self._done += count
            now = time.monotonic()
            if self.enabled and (now - self._drawn > 0.1 or self._done >= self._total):
                self._drawn = now
                self._stream.write("\r" + self.render())
                self._stream.flush()

    def render(self) -> str:
        share = min(self._done / self._total, 1.0)
        filled = int(share * 30)
        return (
            f"{self._label} [{'#' * filled}{'.' * (30 - filled)}] {share:4.0%} "
            f"{_size(self._done)} of {_size(self._total)}"
        )

    def close(self) -> None:
        if self.enabled:
            self._stream.write("\n")


def deploy(
    path: Path,
    repository: Repository,
    redis_url: str,
    gateway: str | None,
    out: TextIO,
    err: TextIO,
    record_it: bool = True,
    warm: bool = False,
    limits: RepositoryLimits | None = None,
) -> int:
    """Validate, upload as the next version, remove the oldest versions past what the function
    keeps, record it, print how to call it (unless `gateway` is None); with `warm`, have a runner of
    its pool load it and wait for that. Nothing is uploaded for a manifest, a version policy, a
    registry or a storage limit (`limits`; None: the FNGATE_* variables and defaults) that fails
    its check. Without `record_it` an S3 repository is only written, and nothing removed: the
    registry (private to the cluster) learns the version from a later `fngate ls --sync` that can
    reach it."""
    try:
        manifest = load_manifest(path)
    except ManifestError as exc:
        return _nothing_uploaded(exc, err)
    remote = is_remote(repository.url)
    limits = limits if limits is not None else RepositoryLimits()
    try:
        files, problems = deployment.check(path, repository, manifest, limits)
        if problems:
            for problem in problems:
                print(f"{path}: {problem}", file=err)
            print("fngate deploy: nothing was uploaded", file=err)
            return 2
        keeping = retention.Retention(
            limits, _held(redis_url, repository.url, manifest.name, remote, record_it)
        )
        retention.admit(repository, manifest, files, keeping)
        total = sum(item.size for item, _ in files)
        warning = load_warning(manifest, total)
        if warning:
            print(f"{path}: warning: {warning}", file=err)
        print(f"{manifest.name}: uploading {len(files)} files ({_size(total)}) to {repository.url}", file=out)
        bar = ProgressBar(total, err, f"{manifest.name}: uploading")
        try:
            version, record, removed = deployment.store(repository, manifest, files, bar, keeping)
        finally:
            bar.close()
    except FunctionError as exc:
        print(f"fngate deploy: {path}: {exc.message}", file=err)
        return 2 if exc.code is ErrorCode.INVALID_ARGUMENT else 1  # the user's mistake, or a service's
    except (RedisError, OSError) as exc:
        print(
            f"fngate deploy: the registry at {redis_url} is unreachable ({exc}); nothing was uploaded",
            file=err,
        )
        return 1
    if remote and not record_it:
        print(
            f"uploaded {manifest.name} version {version.version} to {repository.url}; it is served once "
            "`fngate ls --sync` has run where the registry is reachable (the fngate-registry-sync job)",
            file=out,
        )
        _print_pruned(record, removed, keeping, out)
        return 0
    try:
        asyncio.run(_announce(redis_url, repository.url, record))
    except (RedisError, OSError) as exc:
        if remote:
            print(
                f"fngate deploy: version {version.version} is in {repository.url}, but the registry at "
                f"{redis_url} could not record it ({exc}); run `fngate ls --sync` when it is reachable",
                file=err,
            )
            return 1
    _print_deployed(version, record, repository.url, gateway, out)
    _print_pruned(record, removed, keeping, out)
    if not warm:
        return 0
    if manifest.pipeline is not None:
        print(
            f"{manifest.name} is a pipeline: --warm loads nothing (deploy its steps' functions with it)",
            file=out,
        )
        return 0
    try:
        failure = asyncio.run(_warm(redis_url, version, out))
    except (RedisError, OSError) as exc:
        failure = f"the registry at {redis_url} is unreachable ({exc})"
    if failure:
        print(f"fngate deploy --warm: {version.name} version {version.version} {failure}", file=err)
        return 1
    return 0


def _held(redis_url: str, repo_url: str, name: str, remote: bool, record_it: bool) -> frozenset[str] | None:
    """The versions of `name` that runners or pipelines still name (retention.holders); None where
    that is unknown, so that nothing is removed: an S3 repository not recorded now, or a folder's
    Redis unreachable. An S3 repository's unreachable registry raises (nothing is uploaded)."""
    if remote and not record_it:
        return None

    async def read() -> frozenset[str]:
        async with clients.connect(redis_url, socket_connect_timeout=3) as redis:
            return await retention.holders(redis, repo_url, name)

    try:
        return asyncio.run(read())
    except (RedisError, OSError):
        if remote:
            raise
        return None


def _print_pruned(
    record: FunctionRecord, removed: Sequence[str], keeping: retention.Retention, out: TextIO
) -> None:
    keep = retention.kept(record.newest().manifest, keeping.limits.max_versions)
    if removed:
        print(
            f"pruned {record.name} {'versions' if len(removed) > 1 else 'version'} {', '.join(removed)} "
            f"from the repository (a function keeps {keep} versions: max_versions, versions.max_stored)",
            file=out,
        )
    elif keeping.held is None and len(record.versions) > keep:
        print(
            f"{record.name} has {len(record.versions)} versions stored, more than the {keep} it keeps: "
            "the oldest are pruned by the next deploy that reaches the registry's Redis",
            file=out,
        )


def _nothing_uploaded(exc: ManifestError, err: TextIO) -> int:
    """A manifest that fails its check: every problem, and the user's-mistake exit code."""
    for line in exc.lines():
        print(line, file=err)
    print("fngate deploy: nothing was uploaded", file=err)
    return 2


def deploy_all(
    paths: Sequence[Path],
    repository: Repository,
    redis_url: str,
    gateway: str | None,
    out: TextIO,
    err: TextIO,
    record_it: bool = True,
    warm: bool = False,
    limits: RepositoryLimits | None = None,
) -> int:
    """`fngate deploy FILE...`: functions first, then pipelines, whose steps may call functions of
    the same command. Every manifest and every pipeline is checked before anything is uploaded."""
    manifests: dict[Path, FunctionManifest] = {}
    failed = False
    for path in paths:
        try:
            manifests[path] = load_manifest(path)
        except ManifestError as exc:
            failed = True
            for line in exc.lines():
                print(line, file=err)
    functions = [manifest for manifest in manifests.values() if manifest.pipeline is None]
    for path, manifest in manifests.items():
        for problem in deployment.steps_check(repository, manifest, functions):
            failed = True
            print(f"{path}: {problem}", file=err)
    if failed:
        print("fngate deploy: nothing was uploaded", file=err)
        return 2
    for path in sorted(paths, key=lambda path: manifests[path].pipeline is not None):
        code = deploy(path, repository, redis_url, gateway, out, err, record_it, warm, limits)
        if code:
            return code
    return 0


def load_warning(manifest: FunctionManifest, total_bytes: int) -> str:
    """Why the first load of a version of this size may outlast its limits ("" when it likely fits):
    the estimate is cautious (DOWNLOAD_BYTES_PER_S, LOAD_BYTES_PER_S, RUNNER_START_S)."""
    if manifest.pipeline is not None:
        return ""  # no model of its own: its steps' functions load theirs
    estimate_s = RUNNER_START_S + total_bytes / DOWNLOAD_BYTES_PER_S + total_bytes / LOAD_BYTES_PER_S
    limit_s = manifest.model.load_timeout_s
    if estimate_s <= limit_s / 2:
        return ""
    return (
        f"{_size(total_bytes)} of files may take about {estimate_s:.0f} s to fetch and load on a cold "
        f"start, against model.load_timeout_s of {limit_s:g} s (the longest an invocation waits for "
        "a load); raise it, keep a runner warm (scaling.min_replicas: 1), or deploy with --warm"
    )


async def _warm(redis_url: str, version: FunctionVersion, out: TextIO) -> str:
    """Have a runner of the version's pool load it (waking the pool when none runs) and wait until
    one has it ready: "" then, else what went wrong."""
    started = time.monotonic()
    timeout_s = version.manifest.model.load_timeout_s + RUNNER_START_S
    async with clients.connect(redis_url, socket_connect_timeout=3) as redis:
        failure = await warm(
            redis, version.name, (version.version,), version.manifest.scaling.pool, timeout_s
        )
    if not failure:
        print(
            f"{version.name} version {version.version} is loaded ({time.monotonic() - started:.1f} s)",
            file=out,
        )
    return failure.removeprefix(f"version {version.version} ")


def deploy_through(
    path: Path, gateway: str, api_key: str, out: TextIO, err: TextIO, warm: bool = False
) -> int:
    """`fngate deploy --gateway URL`: the manifest and its folder, as a tar.gz, to the gateway's
    deploy API with an API key of the `deploy` scope; the gateway stores it and tells the runners.
    With `warm`, then the gateway's model-control load (an `admin` key), which waits for it."""
    try:
        manifest = load_manifest(path)
        files = deployment.deploy_files(path, manifest)
    except ManifestError as exc:
        return _nothing_uploaded(exc, err)
    except FunctionError as exc:
        print(f"fngate deploy: {exc.message}", file=err)
        return 2
    base = gateway.rstrip("/")
    with tempfile.TemporaryFile() as archive:
        with tarfile.open(fileobj=archive, mode="w:gz") as tar:
            for item, source in files:
                tar.add(source, arcname=item.path, recursive=False)
        size = archive.tell()
        archive.seek(0)
        print(f"{manifest.name}: uploading {len(files)} files ({_size(size)} compressed) to {base}", file=out)
        request = urllib.request.Request(
            f"{base}/v1/functions/{manifest.name}",
            data=archive,
            method="PUT",
            headers={
                "Content-Type": "application/gzip",
                "Content-Length": str(size),
                "Authorization": f"Bearer {api_key}",
            },
        )
        answer = call_gateway(request, 600, "fngate deploy", base, err)
        if answer is None:
            return 1
        doc = orjson.loads(answer)
    traffic = ", ".join(f"version {v}: {w}%" for v, w in doc["traffic"].items())
    print(
        f"deployed {manifest.name} version {doc['deployed']} through {base}\n"
        f"serving versions {', '.join(doc['served'])}; traffic {traffic}",
        file=out,
    )
    pruned = doc.get("pruned") or []
    if pruned:
        noun = "versions" if len(pruned) > 1 else "version"
        print(f"pruned {manifest.name} {noun} {', '.join(pruned)} from the repository", file=out)
    body = example_body(manifest)
    data = f"'{body}'" if body is not None else "@request.json"
    print(
        f"call it:\n  curl -s -X POST {base}/v1/functions/{manifest.name} "
        f'-H "Authorization: Bearer $FNGATE_API_KEY" -d {data}',
        file=out,
    )
    return _warm_through(base, manifest, api_key, out, err) if warm and manifest.pipeline is None else 0


def _warm_through(base: str, manifest: FunctionManifest, api_key: str, out: TextIO, err: TextIO) -> int:
    request = urllib.request.Request(
        f"{base}/v2/repository/models/{manifest.name}/load",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
    )
    started = time.monotonic()
    timeout_s = manifest.model.load_timeout_s + RUNNER_START_S
    if call_gateway(request, timeout_s, "fngate deploy --warm", base, err) is None:
        return 1
    print(f"{manifest.name} is loaded ({time.monotonic() - started:.1f} s)", file=out)
    return 0


def call_gateway(
    request: urllib.request.Request, timeout_s: float, command: str, base: str, err: TextIO
) -> bytes | None:
    """The gateway's answer to `request`, or None once why there is none is printed."""
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as exc:
        print(f"{command}: the gateway answered {exc.code}: {_api_error(exc.read())}", file=err)
    except (urllib.error.URLError, OSError) as exc:
        print(f"{command}: the gateway at {base} is unreachable ({exc})", file=err)
    return None


def _api_error(body: bytes) -> str:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode(errors="replace")[:500]
    return str(doc.get("error", doc)) if isinstance(doc, dict) else str(doc)


def _print_deployed(
    version: FunctionVersion, record: FunctionRecord, url: str, gateway: str | None, out: TextIO
) -> None:
    name = version.name
    traffic = ", ".join(f"version {v}: {w}%" for v, w in record.traffic.items())
    print(
        f"deployed {name} version {version.version} (digest {version.digest[:12]}) "
        f"to {url}/{name}/{version.version}/\nserving versions {', '.join(record.served)}; traffic {traffic}",
        file=out,
    )
    if gateway is None:
        return
    print("call it (with FNGATE_API_KEY set to a key that may invoke it):", file=out)
    for line in curl_lines(gateway, version, record):
        print(f"  {line}", file=out)
    if version.version not in record.served:
        print(
            f"version {version.version} is stored, not served (its versions policy serves "
            f"{', '.join(record.served)}): `fngate traffic {name} {version.version}=100` routes to it",
            file=out,
        )


AUTH_HEADER = '-H "Authorization: Bearer $FNGATE_API_KEY"'


def curl_lines(gateway: str, version: FunctionVersion, record: FunctionRecord) -> list[str]:
    """Commands that call the function as deployed: the /v1 route (its traffic split), and the
    V2 route pinned to this version when it is served."""
    name = version.name
    body = example_body(version.manifest)
    data = f"'{body}'" if body is not None else "@request.json"
    lines = [f"curl -s -X POST {gateway}/v1/functions/{name} {AUTH_HEADER} -d {data}"]
    if version.version in record.served:
        v2 = example_v2_body(version.manifest)
        lines.append(
            f"curl -s -X POST {gateway}/v2/models/{name}/versions/{version.version}/infer {AUTH_HEADER} "
            f"-d '{v2}'"
            if v2 is not None
            else f"curl -s -X POST {gateway}/v2/models/{name}/versions/{version.version}/infer "
            f"{AUTH_HEADER} -d @request.json"
        )
    return lines


async def _announce(redis_url: str, repo_url: str, record: FunctionRecord) -> None:
    async with clients.connect(redis_url, socket_connect_timeout=3) as redis:
        await deployment.announce(redis, repo_url, record)


def list_functions(repository: Repository, redis_url: str, sync: bool, out: TextIO, err: TextIO) -> int:
    """Every function and version: served, traffic share, load state across runners."""
    try:
        records = repository.scan()
    except FunctionError as exc:
        print(f"fngate ls: {exc.message}", file=err)
        return 1
    try:
        runners, drift = asyncio.run(_states(redis_url, repository.url, records, sync, repository.unreadable))
    except (RedisError, OSError) as exc:
        if sync:  # a job that syncs must fail visibly
            print(f"fngate ls --sync: redis at {redis_url} is unreachable ({exc})", file=err)
            return 1
        print(f"fngate ls: load states unknown: redis at {redis_url} is unreachable ({exc})", file=err)
        runners, drift = None, []
    rows = [("FUNCTION", "VERSION", "SERVED", "TRAFFIC", "STATE", "REASON")]
    for name, record in sorted(records.items()):
        for version in record.versions:
            state = summarize(runners, name, version) if runners is not None else None
            traffic = record.traffic.get(version)
            rows.append(
                (
                    name,
                    version,
                    "yes" if version in record.served else "no",
                    f"{traffic}%" if traffic else "-",
                    state.state if state is not None else "?",
                    state.reason if state is not None else "",
                )
            )
    _print_table(rows, out)
    pipelines = _pipeline_rows(records)
    if len(pipelines) > 1:
        print(file=out)
        _print_table(pipelines, out)
    if runners:
        print(file=out)
        _print_table(_runner_rows(runners), out)
    for name, problem in sorted(repository.unreadable.items()):
        print(f"fngate ls: {name} cannot be read: {problem}", file=err)
    for line in drift:
        print(f"fngate ls: {line}", file=err)
    return 0


def _pipeline_rows(records: dict[str, FunctionRecord]) -> list[tuple[str, ...]]:
    """Each served version of a pipeline with its steps, in the order they run."""
    rows: list[tuple[str, ...]] = [("PIPELINE", "VERSION", "STEPS")]
    for name, record in sorted(records.items()):
        for number in record.served:
            spec = record.versions[number].manifest.pipeline
            if spec is not None:
                steps = " -> ".join(
                    f"{spec.steps[index].name} ({spec.steps[index].function})" for index in order(spec)
                )
                rows.append((name, number, steps))
    return rows


def _runner_rows(runners: list[Any]) -> list[tuple[str, ...]]:
    """Live runners, each loaded model on a line with how long it has been idle."""
    rows: list[tuple[str, ...]] = [("RUNNER", "POOL", "LOADED", "IDLE")]
    for view in sorted(runners, key=lambda view: view.name):
        loaded = sorted(view.idle_s.items()) or [("-", None)]
        for model, idle in loaded:
            rows.append((view.name, view.pool, model, f"{idle:.0f} s" if idle is not None else "-"))
    return rows


def _print_table(rows: Sequence[tuple[str, ...]], out: TextIO) -> None:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip(), file=out
        )


async def _states(
    redis_url: str,
    repo_url: str,
    records: dict[str, FunctionRecord],
    sync: bool,
    unreadable: Mapping[str, str],
) -> tuple[list[Any], list[str]]:
    """Runner states, and how the registry differs from the repository (with `sync`: rewritten
    from it, except for a function the repository could not read in full and the registry holds:
    that one stays as it was read last)."""
    async with clients.connect(redis_url, socket_connect_timeout=3) as redis:
        runners = await read_runners(redis)
        if sync:  # streams and groups of functions deployed before they were made at deploy time
            for name, record in records.items():
                await create_stream(redis, name, priorities_of(record))
        if not is_remote(repo_url):
            return runners, []
        registry = Registry(redis, repo_url)
        recorded = await registry.read()
        stale = sorted(
            name
            for name in records.keys() | recorded.keys()
            if name not in recorded
            or name not in records
            or recorded[name].versions.keys() != records[name].versions.keys()
        )
        kept = [name for name in stale if name in unreadable and name in recorded]
        stale = [name for name in stale if name not in kept]
        notes = [f"{name} is kept in the registry as it was read last" for name in kept]
        if not sync:
            hint = "; `fngate ls --sync` rewrites it from the repository"
            return runners, [f"the registry differs from the repository for {stale}{hint}"] if stale else []
        for name in stale:
            if name in records:
                await registry.put(records[name])
            else:
                await registry.remove(name)
            await send_control(redis, ControlOp("deploy", name))
        return runners, notes + ([f"registry rewritten for {stale}"] if stale else [])


def remove(
    repository: Repository, name: str, redis_url: str, grace_s: float, out: TextIO, err: TextIO
) -> int:
    """Delete every version; queued invocations are answered not_found, now and after `grace_s`
    (gateways that had not refreshed yet may still have queued some)."""
    try:
        record = repository.get(name)
    except FunctionError as exc:
        print(f"fngate rm: {exc.message}", file=err)
        return 1
    remote = is_remote(repository.url)
    try:
        answered = asyncio.run(_remove(repository, record, redis_url, grace_s, remote))
    except FunctionError as exc:
        print(f"fngate rm: {exc.message}", file=err)
        return 2 if isinstance(exc, InvalidArgument) else 1  # a pipeline's step: the user's to settle
    except (RedisError, OSError) as exc:
        if remote:
            print(
                f"fngate rm: the registry at {redis_url} is unreachable ({exc}); nothing was removed",
                file=err,
            )
            return 1
        repository.remove(name)
        print(
            f"fngate rm: redis at {redis_url} is unreachable ({exc}): queued invocations were not answered",
            file=err,
        )
        answered = 0
    print(
        f"removed {name} ({_count(len(record.versions), 'version')}) from {repository.url}; "
        f"answered {_count(answered, 'queued invocation')} with not_found",
        file=out,
    )
    return 0


async def _remove(
    repository: Repository, record: FunctionRecord, redis_url: str, grace_s: float, remote: bool
) -> int:
    async with clients.connect(redis_url, socket_connect_timeout=3) as redis:
        await redis.ping()
        return await withdraw(repository, record, redis, grace_s)


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"
