"""TensorRT engine caches that outlive a pod. The key names what an engine depends on (the
version's files and which of them is the model, the TensorRT version, the GPU: its compute
capability, name and driver, the precision, the builder and the options that shape the engine); a
model's local folder is filled from a store before its session is created and saved to the store
after a build, at the session's creation or on first use. A cache whose recorded key differs from
the one wanted is never used; one that TensorRT refuses is stale: deleted and rebuilt.
Every method here blocks."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import logging
import re
import shutil
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import orjson

from fngate.errors import FunctionError, FunctionNotFound
from fngate.s3 import s3_errors
from runner.metrics import ENGINE_CACHE_EVENTS

log = logging.getLogger(__name__)

META = "fngate-engine.json"
ENGINE_SUFFIXES = (".engine",)
MAX_ARCHIVE_MEMBERS = 64
PREFIX = ".engines"
"""Where engines live in a repository: a hidden folder no function can be named after."""
_SLUG = re.compile(r"[^a-z0-9.]+")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineKey:
    files_sha256: str
    """The version's files (the model, its external data, whatever else it loads) and which of
    them is the model: an engine depends on the weights wherever they are kept."""
    tensorrt: str
    """TensorRT's version, as the library reports it: an engine only loads in the same one."""
    compute_capability: str
    device: str
    """The GPU's name, "NVIDIA H200": GPUs of one compute capability (H100, H200) still differ in
    what TensorRT tunes an engine for, and TensorRT advises against sharing engines between them."""
    driver: str
    """The driver's major version, "580": what TensorRT chose under one driver may not hold under another."""
    precision: str
    builder: str
    """What built the engine, e.g. "onnxruntime 1.31.1": its cache files are named its way."""
    options: str
    """A fingerprint of the settings that shape the engine (profiles, fp16, workspace)."""

    @property
    def name(self) -> str:
        """The store's key: one folder per model, one object per build configuration."""
        builder = _SLUG.sub("-", self.builder.lower()).strip("-")
        cc = self.compute_capability.replace(".", "")
        device = _SLUG.sub("-", self.device.lower()).strip("-")
        gpu = f"sm{cc}-{device}-r{self.driver}"
        return f"{self.files_sha256}/trt{self.tensorrt}-{gpu}-{self.precision}-{builder}-{self.options}.tar"

    def fields(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    def mismatch(self, recorded: Any) -> str | None:
        """How a cache's recorded key differs from this one; None when it is the same."""
        if not isinstance(recorded, dict):
            return "it records no key"
        for field, wanted in self.fields().items():
            found = recorded.get(field)
            if found != wanted:
                return f"{field} is {found!r}, not {wanted!r}"
        return None


def options_fingerprint(options: dict[str, str], ignore: tuple[str, ...] = ()) -> str:
    """16 hex digits over the options, less those (paths, device id) that do not shape an engine."""
    kept = {name: value for name, value in sorted(options.items()) if name not in ignore}
    return hashlib.sha256(orjson.dumps(kept)).hexdigest()[:16]


class EngineStore(Protocol):
    """Where engine caches persist between pods: the repository, through a folder or S3."""

    def fetch(self, key: str, target: Path) -> bool:
        """Write the object stored under `key` to `target`; False when there is none."""
        ...

    def store(self, key: str, source: Path) -> None:
        """Keep the file `source` under `key`, replacing what was there."""
        ...


class FolderEngineStore:
    """Engine caches in a local or shared folder (the folder repository's `.engines`)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def fetch(self, key: str, target: Path) -> bool:
        path = self.root / _safe_key(key)
        try:
            shutil.copyfile(path, target)
        except FileNotFoundError:
            return False
        return True

    def store(self, key: str, source: Path) -> None:
        path = self.root / _safe_key(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".tmp-{uuid.uuid4().hex}")
        try:
            shutil.copyfile(source, temporary)
            temporary.replace(path)
        finally:
            temporary.unlink(missing_ok=True)


class S3EngineStore:
    """Engine caches in S3 under s3://bucket/prefix/; `client` is a boto3 S3 client the caller
    built (the repository store's, with its endpoint, retries and credentials)."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self._client = client
        self._bucket = bucket
        self._prefix = prefix.strip("/")

    def fetch(self, key: str, target: Path) -> bool:
        try:
            with s3_errors(self._url(key)):
                self._client.download_file(self._bucket, self._key(key), str(target))
        except FunctionNotFound:
            return False
        return True

    def store(self, key: str, source: Path) -> None:
        with s3_errors(self._url(key)):
            self._client.upload_file(str(source), self._bucket, self._key(key))

    def _key(self, key: str) -> str:
        key = _safe_key(key)
        return f"{self._prefix}/{key}" if self._prefix else key

    def _url(self, key: str) -> str:
        return f"s3://{self._bucket}/{self._key(key)}"


class EngineCache:
    """One model's engine folder under `root`, named by its key; `prepare` fills it from the store
    (or keeps what is there when its key matches), `save` sends what was built since to the store:
    at the session's creation, or later, when a batch of a shape no engine covers makes TensorRT
    build one (`changed` tells). Hold `locked()` around `prepare`, `save` and the session's
    creation: runners on one machine then build once."""

    def __init__(self, root: Path, key: EngineKey, store: EngineStore | None, function: str) -> None:
        self.key = key
        self.folder = root / hashlib.sha256(key.name.encode()).hexdigest()[:32]
        self._root = root
        self._store = store
        self._function = function
        self.event = ""
        """What `prepare` found: local, downloaded, miss or mismatch; stale after `discard`."""
        self._saved: frozenset[tuple[str, int, int]] = frozenset()
        """The engines as `prepare` left them or `save` stored them: (name, size, mtime)."""

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self._root.mkdir(parents=True, exist_ok=True)
        with (self._root / f"{self.folder.name}.lock").open("a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def prepare(self) -> str:
        """Make `folder` hold this key's engines, or nothing; returns (and records) the event."""
        event = self._prepare()
        self._saved = self._signature()
        return event

    def changed(self) -> bool:
        """The folder holds engines that the store does not: built since `prepare` or `save`."""
        return self._signature() != self._saved

    def _prepare(self) -> str:
        problem = self._local_problem()
        if problem is None:
            return self._record("local")
        if self.folder.exists():
            log.warning("%s: discarding the local engine cache %s: %s", self._function, self.folder, problem)
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)
        if self._store is None:
            return self._record("miss")
        return self._record(self._download())

    def discard(self, problem: str) -> None:
        """The engines `prepare` kept or downloaded did not load (TensorRT refused them, or its
        provider failed with them): delete them, so that the next session builds afresh and
        `save` replaces the stored copy."""
        log.warning(
            "%s: its TensorRT engine cache (%s) did not load (%s); deleted, building one",
            self._function,
            self.event,
            problem,
        )
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        self._saved = frozenset()
        self._record("stale")

    def save(self) -> bool:
        """After a build: record the key beside the engines and upload them, when there are engines
        the store lacks. Never raises; a store that fails costs the next pod a build, not this one
        its model."""
        if not self.changed() or not self._engines(self.folder):
            return False
        (self.folder / META).write_bytes(orjson.dumps(self.key.fields()))
        self._saved = self._signature()
        if self._store is None:
            return False
        with tempfile.TemporaryDirectory(dir=self._root) as scratch:
            archive = Path(scratch) / "engine.tar"
            try:
                _pack(self.folder, archive)
                self._store.store(self.key.name, archive)
            except (FunctionError, OSError) as exc:
                message = exc.message if isinstance(exc, FunctionError) else str(exc)
                log.warning("%s: could not upload its TensorRT engine cache: %s", self._function, message)
                ENGINE_CACHE_EVENTS.labels(self._function, "upload_failed").inc()
                return False
        log.info("%s: uploaded its TensorRT engine cache %s", self._function, self.key.name)
        ENGINE_CACHE_EVENTS.labels(self._function, "uploaded").inc()
        return True

    def _download(self) -> str:
        assert self._store is not None
        with tempfile.TemporaryDirectory(dir=self._root) as scratch:
            archive = Path(scratch) / "engine.tar"
            unpacked = Path(scratch) / "unpacked"
            try:
                if not self._store.fetch(self.key.name, archive):
                    log.info("%s: no stored engine cache %s; building one", self._function, self.key.name)
                    return "miss"
                _unpack(archive, unpacked)
            except (FunctionError, OSError, tarfile.TarError, ValueError) as exc:
                message = exc.message if isinstance(exc, FunctionError) else str(exc)
                log.warning(
                    "%s: the stored engine cache is unusable (%s); building one", self._function, message
                )
                return "miss"
            problem = self._problem(unpacked)
            if problem is not None:
                log.warning(
                    "%s: the stored engine cache %s does not match (%s); not used, building one",
                    self._function,
                    self.key.name,
                    problem,
                )
                return "mismatch"
            shutil.rmtree(self.folder)
            unpacked.rename(self.folder)
        log.info("%s: downloaded its TensorRT engine cache %s", self._function, self.key.name)
        return "downloaded"

    def _local_problem(self) -> str | None:
        if not self.folder.is_dir():
            return "there is none"
        return self._problem(self.folder)

    def _problem(self, folder: Path) -> str | None:
        try:
            recorded = orjson.loads((folder / META).read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return f"it has no readable {META}"
        mismatch = self.key.mismatch(recorded)
        if mismatch is not None:
            return mismatch
        if not self._engines(folder):
            return "it holds no engine"
        return None

    def _signature(self) -> frozenset[tuple[str, int, int]]:
        engines = self._engines(self.folder) if self.folder.is_dir() else []
        return frozenset((path.name, *_size_and_time(path)) for path in engines)

    @staticmethod
    def _engines(folder: Path) -> list[Path]:
        return [path for path in folder.iterdir() if path.suffix in ENGINE_SUFFIXES and path.is_file()]

    def _record(self, event: str) -> str:
        self.event = event
        ENGINE_CACHE_EVENTS.labels(self._function, event).inc()
        return event


def _size_and_time(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_size, status.st_mtime_ns


def _pack(folder: Path, archive: Path) -> None:
    """A flat, uncompressed tar (engines do not compress), the key first."""
    with tarfile.open(archive, "w") as tar:
        tar.add(folder / META, arcname=META)
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.name != META and not path.name.startswith("."):
                tar.add(path, arcname=path.name)


def _unpack(archive: Path, target: Path) -> None:
    """Regular files with plain names only: an archive is data from the repository, not trusted."""
    target.mkdir()
    with tarfile.open(archive, "r") as tar:
        members = tar.getmembers()
        if len(members) > MAX_ARCHIVE_MEMBERS:
            raise ValueError(f"{len(members)} files, more than an engine cache holds")
        for member in members:
            if not member.isfile() or "/" in member.name or member.name.startswith("."):
                raise ValueError(f"unexpected entry {member.name!r}")
            source = tar.extractfile(member)
            if source is None:
                raise ValueError(f"unreadable entry {member.name!r}")
            with source, (target / member.name).open("wb") as sink:
                shutil.copyfileobj(source, sink, io.DEFAULT_BUFFER_SIZE * 64)


def _safe_key(key: str) -> str:
    parts = key.split("/")
    if not key or any(part in ("", ".", "..") for part in parts) or "\\" in key:
        raise ValueError(f"{key!r} is not an engine cache key")
    return f"{PREFIX}/{key}"
