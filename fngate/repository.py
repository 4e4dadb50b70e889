"""The model repository as every process sees it: the functions, their stored versions, which of
them the manifest's version policy serves, and where their files are. The folder layout:

    {root}/{function}/function.yaml      an unversioned function (version "1"), as in functions/
    {root}/{function}/{version}/...      a deployed version: its manifest and model files
    {root}/{function}/{version}.json     that version's index (files and sha256), written last
    {root}/{function}/routing.json       the routing `fngate traffic` or `rollback` set (until a deploy)
    {root}/{model}/config.pbtxt          a Triton model, with its versions in {root}/{model}/{version}/
                                         (fngate.triton: served as the function its name maps to)

An S3 repository (fngate/s3.py) has the same layout under s3://bucket/prefix/."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Protocol, TypeVar

import orjson

from fngate.errors import FunctionNotFound, InvalidArgument
from fngate.manifest import (
    DNS_LABEL,
    MANIFEST_FILE,
    FunctionManifest,
    ManifestError,
    VersionsSpec,
    load_manifest,
    parse_manifest,
)

log = logging.getLogger(__name__)

VERSION = re.compile(r"^[1-9][0-9]{0,8}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1024 * 1024
Progress = Callable[[int], None]
"""Called with the number of bytes just transferred."""


@dataclasses.dataclass(frozen=True, slots=True)
class ArtifactFile:
    path: str
    """Relative to the version's folder, with '/' separators; never leaves it (see `safe_path`)."""
    sha256: str
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class FunctionVersion:
    manifest: FunctionManifest
    version: str
    directory: Path
    """A local folder holding the manifest and the model files. For a version in a remote
    repository, Path() until a runner's store has put its files in the local cache."""
    digest: str = ""
    """sha256 over the version's files: what makes two versions' answers differ."""
    files: tuple[ArtifactFile, ...] = ()
    """Every file with its sha256, for a deployed version; empty for an unversioned folder."""

    @property
    def name(self) -> str:
        return self.manifest.name


ROUTING_FILE = "routing.json"


@dataclasses.dataclass(frozen=True, slots=True)
class Routing:
    """Which stored versions are served and how unpinned invocations split over them, set by
    `fngate traffic` or `fngate rollback` over the newest manifest's version policy. The next
    deploy removes it: the new version's manifest says what is served again."""

    served: tuple[str, ...]
    traffic: Mapping[str, int]

    def encode(self) -> dict[str, Any]:
        return {"served": list(self.served), "traffic": dict(self.traffic)}

    @classmethod
    def decode(cls, doc: Any, source: str) -> Routing:
        """Raises ValueError naming what is wrong."""
        served, traffic = (doc or {}).get("served"), (doc or {}).get("traffic")
        if not isinstance(served, list) or not isinstance(traffic, dict):
            raise ValueError(f"{source}: a routing is {{'served': [...], 'traffic': {{...}}}}")
        versions = tuple(str(item) for item in served)
        weights = {str(version): int(weight) for version, weight in traffic.items()}
        if any(not VERSION.match(item) for item in versions) or not set(weights) <= set(versions):
            raise ValueError(f"{source}: traffic goes to served versions only: {doc}")
        return cls(versions, weights)


@dataclasses.dataclass(frozen=True, slots=True)
class FunctionRecord:
    """A function with every stored version and what the newest manifest's policy makes of them."""

    name: str
    versions: Mapping[str, FunctionVersion]
    """By version, oldest first."""
    served: tuple[str, ...]
    """The versions the policy serves (pins may name them), oldest first."""
    traffic: Mapping[str, int]
    """Weights of served versions for invocations that name no version."""
    routing: Routing | None = None
    """What `fngate traffic` set over the policy, if anything (it made `served` and `traffic`)."""

    def newest(self) -> FunctionVersion:
        """The last version deployed: its manifest holds the version policy."""
        return list(self.versions.values())[-1]

    @property
    def default(self) -> FunctionVersion | None:
        """The newest served version: what `fngate ls` and /v1/functions show."""
        return self.versions[self.served[-1]] if self.served else None


def make_record(versions: Iterable[FunctionVersion], routing: Routing | None = None) -> FunctionRecord:
    """A function from its stored versions; `routing`, where it names stored versions, in place of
    the newest manifest's version policy."""
    ordered = sorted(versions, key=lambda item: int(item.version))
    if not ordered:
        raise ValueError("a function record needs at least one version")
    numbers = [item.version for item in ordered]
    by_version = {item.version: item for item in ordered}
    routed = tuple(number for number in numbers if routing is not None and number in routing.served)
    if routing is not None and routed:
        weights = {
            number: weight for number, weight in routing.traffic.items() if number in routed and weight
        }
        return FunctionRecord(ordered[-1].name, by_version, routed, weights or {routed[-1]: 100}, routing)
    policy = ordered[-1].manifest.versions
    served = served_versions(numbers, policy)
    return FunctionRecord(ordered[-1].name, by_version, served, traffic_weights(served, policy))


def routing_problems(record: FunctionRecord, traffic: Mapping[str, int]) -> list[str]:
    """What is wrong with sending unpinned traffic of `record` this way (`fngate traffic` refuses)."""
    problems = []
    unknown = [version for version in traffic if version not in record.versions]
    if unknown:
        problems.append(f"no stored versions {unknown} (stored: {list(record.versions)})")
    if any(weight < 0 for weight in traffic.values()) or sum(traffic.values()) != 100:
        problems.append(f"weights must be positive and add up to 100, not {sum(traffic.values())}")
    if len(record.versions) == 1 and not record.newest().files:
        problems.append("an unversioned function folder has one version only: deploy it to a repository")
    return problems


def served_versions(versions: Sequence[str], policy: VersionsSpec) -> tuple[str, ...]:
    """Which of `versions` (oldest first) the policy serves: the latest N, all, or the named ones."""
    if policy.policy == "all":
        return tuple(versions)
    if policy.policy == "specific":
        return tuple(version for version in versions if version in policy.specific)
    return tuple(versions[-policy.latest :])


def traffic_weights(served: Sequence[str], policy: VersionsSpec) -> dict[str, int]:
    """The manifest's split over served versions; without one, the newest served takes everything."""
    weights = {version: weight for version, weight in policy.traffic.items() if version in served and weight}
    if weights or not served:
        return weights
    return {served[-1]: 100}


def policy_problems(record: FunctionRecord) -> list[str]:
    """What is wrong with the version policy of `record`'s newest manifest (deploy refuses these)."""
    policy = record.newest().manifest.versions
    problems = []
    if policy.policy == "specific" and not policy.specific:
        problems.append("versions.specific: name at least one version for policy 'specific'")
    missing = [version for version in policy.specific if version not in record.versions]
    if missing:
        problems.append(f"versions.specific: no versions {missing} (stored: {list(record.versions)})")
    stray = [version for version in policy.traffic if version not in record.served]
    if stray:
        problems.append(f"versions.traffic: versions {stray} are not served (served: {list(record.served)})")
    if policy.traffic and sum(policy.traffic.values()) != 100:
        problems.append(f"versions.traffic: weights add up to {sum(policy.traffic.values())}, not 100")
    if not record.served:
        problems.append("the version policy serves no version")
    return problems


def check_name(name: str) -> str:
    """A function name, which is also a path segment: it must be a DNS-1123 label."""
    if not DNS_LABEL.match(name) or len(name) > 63:
        shown = name if len(name) <= 64 else f"{name[:64]}..."
        raise FunctionNotFound(
            f"{shown!r} is not a function name (a DNS-1123 label of at most 63 characters)"
        )
    return name


def safe_path(path: str) -> str:
    """A file's path inside a version: relative, '/'-separated, no '.', '..' or empty parts."""
    parts = path.split("/")
    if not path or "\\" in path or path.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{path!r} is not a relative path inside the version's folder")
    return path


def digest_of(files: Iterable[ArtifactFile]) -> str:
    """sha256 over every file's path and sha256, in path order."""
    digest = hashlib.sha256()
    for item in sorted(files, key=lambda item: PurePosixPath(item.path).parts):
        digest.update(item.path.encode() + b"\0")
        digest.update(bytes.fromhex(item.sha256))
    return digest.hexdigest()


def hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def collect_files(folder: Path) -> list[tuple[ArtifactFile, Path]]:
    """The files a deploy uploads: everything in the manifest's folder but hidden files and caches.
    Blocking (reads every file)."""
    found = []
    for item in sorted(folder.rglob("*")):
        relative = item.relative_to(folder)
        if any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
            continue
        if item.is_file():
            path = safe_path(relative.as_posix())
            found.append((ArtifactFile(path, hash_file(item), item.stat().st_size), item))
    return found


def encode_version(function: FunctionVersion) -> dict[str, Any]:
    """A version's index document: what the repository stores beside it and the registry holds."""
    return {
        "function": function.name,
        "version": function.version,
        "digest": function.digest,
        "manifest": function.manifest.model_dump(mode="json"),
        "files": [dataclasses.asdict(item) for item in function.files],
    }


def decode_version(doc: Any, directory: Path, source: str) -> FunctionVersion:
    """Validate an index document; raises ValueError (or ManifestError) naming the problem."""
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: an index is a JSON object")
    manifest = parse_manifest(doc.get("manifest"), source)
    version = str(doc.get("version", ""))
    if not VERSION.match(version):
        raise ValueError(f"{source}: {version!r} is not a version number")
    if doc.get("function") != manifest.name:
        raise ValueError(f"{source}: names function {doc.get('function')!r}, its manifest {manifest.name!r}")
    files = []
    for item in doc.get("files") or ():
        sha256, size = str(item.get("sha256", "")), item.get("size")
        if not SHA256.match(sha256) or not isinstance(size, int) or size < 0:
            raise ValueError(f"{source}: a file entry needs a sha256 and a size: {item}")
        files.append(ArtifactFile(safe_path(str(item.get("path", ""))), sha256, size))
    if manifest.model_spec is not None and not any(item.path == manifest.model.path for item in files):
        raise ValueError(f"{source}: the model file {manifest.model.path!r} is not among its files")
    return FunctionVersion(manifest, version, directory, digest_of(files), tuple(files))


def next_version(taken: Iterable[str]) -> int:
    return max((int(name) for name in taken if VERSION.match(name)), default=0) + 1


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


class Repository(Protocol):
    url: str

    def scan(self) -> dict[str, FunctionRecord]:
        """Every function with its stored versions, by name. Blocking: call it in a thread."""
        ...

    def get(self, name: str) -> FunctionRecord:
        """One function; raises FunctionNotFound. Blocking."""
        ...

    @property
    def unreadable(self) -> dict[str, str]:
        """As of the last scan: by function (or Triton model), why it, or a version of it, could
        not be read."""
        ...

    def next_version(self, name: str) -> str:
        """The number the next deploy of `name` will most likely get. Blocking."""
        ...

    def add_version(
        self, manifest: FunctionManifest, files: Sequence[tuple[ArtifactFile, Path]], progress: Progress
    ) -> FunctionVersion:
        """Store a new version (the next number) of `manifest`'s function: files first, index last.
        Blocking."""
        ...

    def remove(self, name: str) -> None:
        """Delete every version of a function; raises FunctionNotFound. Blocking."""
        ...

    def remove_versions(self, name: str, versions: Sequence[str]) -> None:
        """Delete these versions of a function, each index before its files. Blocking."""
        ...

    def stored_bytes(self) -> int:
        """What the repository holds: every file under its folder or object under its prefix.
        Blocking."""
        ...

    def set_routing(self, name: str, routing: Routing | None) -> None:
        """Store the routing of a function (None: remove it, the policy rules again). Blocking."""
        ...


STAMP_SETTLE_NS = 2_000_000_000
T = TypeVar("T")


class FolderRepository:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)
        self._reported: set[tuple[str, str]] = set()
        self._digests: dict[Path, tuple[tuple[tuple[str, int, int], ...], str]] = {}
        self._last_good: dict[Path, FunctionRecord] = {}
        """Each folder's function as last read well: a live edit that breaks the folder (the problem
        is logged) leaves the function served as it was, not gone."""
        self._problems: dict[Path, str] = {}
        """The folders that could not be read, with why (`unreadable`)."""
        self._clashes: dict[Path, str] = {}
        """The folders of the last scan whose function another folder serves already."""
        self.completed: Mapping[str, str] = {}
        """Python model folder name -> what its auto_complete_config answered, for a folder with no
        config.pbtxt (runner.triton.complete; FunctionSource keeps it current)."""
        self.overrides: Mapping[str, str] = {}
        """Triton model folder name -> the configuration (JSON) a load request gave it, read in place
        of its config.pbtxt (gateway.control; FunctionSource keeps it current)."""
        self._parsed: dict[Path, tuple[tuple[tuple[str, int, int, int, int], ...], Any]] = {}
        """Each `function.yaml` and Triton model folder as last read, by what the stat of its
        files says (_once_per_change): a scan every few seconds parses only what changed. A
        manifest's YAML costs 5 ms here, a Triton model's configuration about 1 ms (and with
        auto-complete a read of its model file), holding the interpreter while the event loop
        waits."""

    def scan(self) -> dict[str, FunctionRecord]:
        found: dict[str, FunctionRecord] = {}
        if not self.root.is_dir():
            log.warning("repository folder %s does not exist", self.root)
            self._problems = {}
            return found
        seen, clashes = set(), {}
        for folder in sorted(self.root.iterdir()):
            seen.add(folder)
            record = self._read(folder)
            if record is None:
                continue
            if record.name in found:
                clashes[folder] = f"function {record.name!r} is served from another folder already"
                self._report(folder, clashes[folder])
                continue
            found[record.name] = record
        self._problems = {folder: problem for folder, problem in self._problems.items() if folder in seen}
        self._clashes = clashes
        return found

    @property
    def unreadable(self) -> dict[str, str]:
        """By folder name (a function's, or a Triton model's), why the last scan could not read a
        folder (paths in the reason relative to the repository). One that read well before is served
        as it was then; the others are not served."""
        inside = f"{self.root}{os.sep}"  # reasons name files within the repository, not the machine's paths
        problems = {**self._problems, **self._clashes}
        return {folder.name: problem.replace(inside, "") for folder, problem in problems.items()}

    def get(self, name: str) -> FunctionRecord:
        record = self._read(self.root / check_name(name))
        if record is None:  # a Triton model whose folder is not the function's name (text_model)
            record = self._triton_record(name)
        if record is None:
            raise FunctionNotFound(f"function {name!r} is not in the repository")
        return record

    def next_version(self, name: str) -> str:
        home = self.root / check_name(name)
        return str(next_version(item.name.removesuffix(".json") for item in home.glob("*")))

    def add_version(
        self, manifest: FunctionManifest, files: Sequence[tuple[ArtifactFile, Path]], progress: Progress
    ) -> FunctionVersion:
        home = self.root / check_name(manifest.name)
        if (home / MANIFEST_FILE).is_file():
            raise InvalidArgument(
                f"{home} holds an unversioned function (its own folder is version 1); "
                "deploy to another repository folder"
            )
        home.mkdir(parents=True, exist_ok=True)
        number = int(self.next_version(manifest.name))
        while True:
            try:
                (home / str(number)).mkdir()  # claims the number, even against a concurrent deploy
                break
            except FileExistsError:
                number += 1
        target = home / str(number)
        for item, source in files:
            _copy(source, target / item.path, progress)
        entries = tuple(item for item, _ in files)
        version = FunctionVersion(manifest, str(number), target, digest_of(entries), entries)
        _write_atomic(home / f"{number}.json", orjson.dumps({**encode_version(version), "at": now_iso()}))
        self.set_routing(manifest.name, None)  # the new version's policy rules
        return version

    def set_routing(self, name: str, routing: Routing | None) -> None:
        path = self.root / check_name(name) / ROUTING_FILE
        if routing is None:
            path.unlink(missing_ok=True)
        else:
            _write_atomic(path, orjson.dumps({**routing.encode(), "at": now_iso()}))

    def remove(self, name: str) -> None:
        home = self.root / check_name(name)
        if (home / MANIFEST_FILE).is_file():
            raise InvalidArgument(
                f"{home} was not deployed by fngate (it has no versions); delete it yourself"
            )
        if not home.is_dir():
            raise FunctionNotFound(f"function {name!r} is not in the repository")
        for index in home.glob("*.json"):
            index.unlink()  # uncommitted first: a scan meanwhile sees no half-deleted version
        shutil.rmtree(home)

    def remove_versions(self, name: str, versions: Sequence[str]) -> None:
        home = self.root / check_name(name)
        for number in versions:
            if VERSION.match(number):
                (home / f"{number}.json").unlink(missing_ok=True)  # uncommitted first, as in remove
                shutil.rmtree(home / number, ignore_errors=True)

    def stored_bytes(self) -> int:
        total = 0
        for folder, _, names in os.walk(self.root):
            for name in names:
                with contextlib.suppress(FileNotFoundError):  # a temporary file renamed meanwhile
                    total += os.lstat(os.path.join(folder, name)).st_size
        return total

    def _read(self, folder: Path) -> FunctionRecord | None:
        """The function of one folder, read on its own: a folder that cannot be read, whatever the
        error (a fault of this reader's included), is reported with why and leaves its function as
        it was read last (None: never read well, or no function's folder), so that one bad folder
        never stops the others."""
        try:
            record, warnings = self.read_folder(folder)
        except Exception as exc:  # any error: it is this folder's, not the repository's
            problem = problem_of(folder, exc)
            self._problems[folder] = problem
            last = self._last_good.get(folder)
            outcome = "its function serves on as it was read last" if last is not None else "not served"
            self._report(folder, f"{problem} ({outcome})", skipped=False)
            return last
        for warning in warnings:
            self._report(folder, warning, skipped=False)
        if self._problems.pop(folder, None) is not None:
            log.info("%s reads well again", folder)
            self._reported = {item for item in self._reported if item[0] != str(folder)}  # said if it recurs
        if record is None:
            self._last_good.pop(folder, None)
        else:
            self._last_good[folder] = record
        return record

    def read_folder(self, folder: Path) -> tuple[FunctionRecord | None, tuple[str, ...]]:
        """One folder's function as a scan reads it (None: not a function's folder), and what
        fngate does not honour of a Triton model's configuration. Raises what reading it raised:
        ManifestError for a problem of the folder, anything else for a fault (`problem_of`)."""
        if not folder.is_dir() or not (DNS_LABEL.match(folder.name) or is_triton_model(folder)):
            return None, ()
        if (folder / MANIFEST_FILE).is_file():
            return make_record([self._read_unversioned(folder / MANIFEST_FILE)]), ()
        if is_triton_model(folder):
            return self._read_triton(folder)
        versions, problems = [], []
        for index in sorted(folder.glob("*.json")):
            if not VERSION.match(index.stem) or not (folder / index.stem).is_dir():
                continue
            try:
                version = decode_version(orjson.loads(index.read_bytes()), folder / index.stem, str(index))
            except (OSError, ValueError, ManifestError) as exc:
                problems.append(("", str(exc)))
                self._report(index, str(exc))
                continue
            if version.name != folder.name or version.version != index.stem:
                problem = f"names {version.name} version {version.version}, not its place"
                problems.append(("", f"{index}: {problem}"))
                self._report(index, problem)
                continue
            versions.append(version)
        if not versions and problems:
            raise ManifestError(str(folder), problems)
        return (make_record(versions, self._routing(folder)) if versions else None), ()

    def _routing(self, folder: Path) -> Routing | None:
        path = folder / ROUTING_FILE
        try:
            return Routing.decode(orjson.loads(path.read_bytes()), str(path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self._report(path, str(exc))
            return None

    def _read_unversioned(self, path: Path) -> FunctionVersion:
        manifest = self._once_per_change(path, [path], lambda: load_manifest(path))
        if isinstance(manifest, Exception):
            raise manifest.with_traceback(None)  # raised again at each scan: no traceback to grow
        if manifest.name != path.parent.name:
            problem = f"name {manifest.name!r} differs from its folder {path.parent.name!r}"
            raise ManifestError(str(path), [("name", problem)])
        return FunctionVersion(manifest, "1", path.parent, self._digest(path.parent))

    def _once_per_change(self, key: Path, entries: Sequence[Path], read: Callable[[], T]) -> T | Exception:
        """`read()` (or the exception it raised), again only once one of `entries` changed:
        its inode, size, modification or change time (the change time is the kernel's: no one can
        set it back). While one changed in the last STAMP_SETTLE_NS it is read each time: two
        writes within one tick of the clock could leave the same stamp."""
        now = time.time_ns()
        stamp: list[tuple[str, int, int, int, int]] = []
        for entry in entries:
            try:
                info = entry.stat()
            except OSError:
                stamp = []
                break
            if now - max(info.st_mtime_ns, info.st_ctime_ns) <= STAMP_SETTLE_NS:
                stamp = []
                break
            stamp.append((str(entry), info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns))
        cached = self._parsed.get(key)
        if stamp and cached is not None and cached[0] == tuple(stamp):
            return cached[1]  # type: ignore[no-any-return]
        try:
            outcome: T | Exception = read()
        except ManifestError as exc:
            outcome = exc
        except Exception as exc:  # a fault of the reader: still only this folder's problem
            log.debug("reading %s failed", key, exc_info=True)
            outcome = exc
        self._parsed[key] = (tuple(stamp), outcome)
        return outcome

    def _triton_record(self, name: str) -> FunctionRecord | None:
        folders = sorted(self.root.iterdir()) if self.root.is_dir() else []
        for folder in folders:
            if folder.name != name and folder.is_dir() and is_triton_model(folder):
                record = self._read(folder)
                if record is not None and record.name == name:
                    return record
        return None

    def _read_triton(self, folder: Path) -> tuple[FunctionRecord, tuple[str, ...]]:
        """A Triton model's versions (fngate.triton; protobuf loads with the first one read), and
        what fngate does not honour of its configuration."""
        from fngate.triton.models import read_model

        entries = [folder, *(item for item in sorted(folder.rglob("*")) if "__pycache__" not in item.parts)]
        override = self.overrides.get(folder.name)
        completed = self.completed.get(folder.name)
        given = "".join(text for text in (override, completed) if text is not None)
        given_digest = hashlib.sha256(given.encode()).hexdigest() if given else ""
        key = folder / f"given {given_digest}" if given else folder
        model = self._once_per_change(key, entries, lambda: read_model(folder, override, completed))
        if isinstance(model, Exception):
            raise model.with_traceback(None)  # raised again at each scan: no traceback to grow
        versions = [
            FunctionVersion(
                item.manifest,
                item.version,
                folder,
                _combined(self._digest(folder, (TRITON_CONFIG, item.version)), given_digest),
            )
            for item in model.versions
        ]
        return make_record(versions), model.warnings

    def _digest(self, folder: Path, only: tuple[str, ...] = ()) -> str:
        """sha256 over every file's name and contents (of the files and folders named in `only`,
        when given); recomputed only when a file changes."""
        stamp = tuple(
            (str(item.relative_to(folder)), item.stat().st_size, item.stat().st_mtime_ns)
            for item in sorted(folder.rglob("*"))
            if item.is_file()
            and "__pycache__" not in item.parts
            and (not only or item.relative_to(folder).parts[0] in only)
        )
        key = folder / ",".join(only) if only else folder
        cached = self._digests.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        digest = digest_of(
            ArtifactFile(Path(name).as_posix(), hash_file(folder / name), size) for name, size, _ in stamp
        )
        self._digests[key] = (stamp, digest)
        return digest

    def _report(self, path: Path, problem: str, skipped: bool = True) -> None:
        # Scans repeat every few seconds: say each problem once, not on every scan.
        if (str(path), problem) not in self._reported:
            self._reported.add((str(path), problem))
            if skipped:
                log.warning("skipping %s: %s", path, problem)
            else:
                log.warning("%s", problem)


TRITON_CONFIG = "config.pbtxt"


def _combined(digest: str, given: str) -> str:
    """A Triton version's digest with the digest of the configuration given in place of its
    config.pbtxt (a load's, or its auto_complete_config's), if any: a runner loads the version
    again when either changes."""
    if not given:
        return digest
    return hashlib.sha256(f"{digest} {given}".encode()).hexdigest()


def problem_of(folder: Path, exc: Exception) -> str:
    """Why `folder` could not be read: a ManifestError's lines, or what another error (a fault of
    fngate's reader, or of the file system under it) says."""
    if isinstance(exc, ManifestError):
        return str(exc)
    return f"{folder}: cannot be read ({type(exc).__name__}: {exc})"


def is_triton_model(folder: Path) -> bool:
    """A Triton model's folder: a config.pbtxt, or numbered folders holding a model.onnx (or a
    model.py, which fngate names as one it cannot serve without its config.pbtxt) and no index of
    fngate's own beside them (fngate.triton.models)."""
    if (folder / TRITON_CONFIG).is_file():
        return True
    if (folder / MANIFEST_FILE).is_file() or any(folder.glob("*.json")):
        return False
    return any(
        VERSION.match(item.name) and ((item / "model.onnx").is_file() or (item / "model.py").is_file())
        for item in folder.glob("*/")
    )


def _copy(source: Path, target: Path, progress: Progress) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    with source.open("rb") as reader, temporary.open("wb") as writer:
        while chunk := reader.read(CHUNK):
            writer.write(chunk)
            progress(len(chunk))
    os.replace(temporary, target)


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def is_remote(url: str) -> bool:
    return url.startswith("s3://")


def repo_url(url: str) -> str:
    """The one spelling of a repository's URL (the registry records it): no trailing '/', and a
    folder as its absolute path."""
    if is_remote(url):
        return url.rstrip("/")
    return str(Path(url).expanduser().resolve())


def open_repository(url: str) -> FolderRepository:
    """A folder repository from its path. S3 repositories need boto3: see fngate.s3."""
    if is_remote(url):
        raise ValueError(f"{url} is an S3 repository: open it with fngate.s3.S3Repository")
    return FolderRepository(Path(url).expanduser().resolve())
