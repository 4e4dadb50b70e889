"""Model files from the repository to a local folder: the S3 repository (boto3's one home), the
artifact cache (files by sha256, verified, written atomically, bounded, least recently used first)
and the store that gives the pool a version's local folder. Every method here blocks."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from fngate.errors import FunctionNotFound, Unavailable
from fngate.manifest import FunctionManifest, ManifestError
from fngate.repository import (
    CHUNK,
    MANIFEST_FILE,
    VERSION,
    ArtifactFile,
    FunctionRecord,
    FunctionVersion,
    Progress,
    check_name,
    decode_version,
    digest_of,
    encode_version,
    hash_file,
    is_remote,
    make_record,
    next_version,
    now_iso,
)
from runner.backends.engine_cache import EngineStore, FolderEngineStore, S3EngineStore

log = logging.getLogger(__name__)

MISSING = {"NoSuchKey", "404", "NotFound"}
CLAIM_ATTEMPTS = 20
FETCH_THREADS = 8
SMALL_BYTES = 8 * 1024 * 1024
"""Up to this size a file is fetched with one GET (the transfer manager adds a HEAD)."""
Fetch = Callable[[ArtifactFile, Path], None]


@contextlib.contextmanager
def s3_errors(what: str) -> Iterator[None]:
    """boto3's exceptions become Unavailable (FunctionNotFound for a missing object), once, here."""
    from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

    try:
        yield
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        if code in MISSING:
            raise FunctionNotFound(f"{what} is missing from the repository") from exc
        if code in {"AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"}:
            raise Unavailable(f"{what}: access denied by S3 ({code})") from exc
        if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
            raise Unavailable(f"{what}: S3 is unavailable ({code})") from exc
        raise Unavailable(f"{what}: S3 answered {code}: {error.get('Message', exc)}") from exc
    except BotoCoreError as exc:
        raise Unavailable(f"{what}: the repository is unreachable: {exc}") from exc


class S3Repository:
    """The repository layout of fngate/repository.py under s3://bucket/prefix/. Endpoint, region and
    credentials come from the standard AWS settings (AWS_ENDPOINT_URL_S3 included)."""

    def __init__(self, url: str) -> None:
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not url.startswith("s3://") or not bucket:
            raise ValueError(f"{url!r} is not an S3 URL (s3://bucket/prefix)")
        self._bucket = bucket
        self._prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self._prefix}" if self._prefix else f"s3://{bucket}"
        # Imported here: a runner of a folder repository does not pay for boto3 at its cold start.
        import boto3  # type: ignore[import-untyped]
        from botocore.config import Config  # type: ignore[import-untyped]

        config = Config(retries={"mode": "standard", "max_attempts": 3}, connect_timeout=5, read_timeout=60)
        self._client: Any = boto3.client("s3", config=config)

    def engine_store(self) -> S3EngineStore:
        """TensorRT engine caches under `{prefix}/.engines/`, beside the versions."""
        return S3EngineStore(self._client, self._bucket, self._prefix)

    def scan(self) -> dict[str, FunctionRecord]:
        records = {}
        for name in self._children(self._key("")):
            if VERSION.match(name) is None:
                with contextlib.suppress(FunctionNotFound):
                    record = self._read(check_name(name))
                    if record is not None:
                        records[name] = record
        return records

    def get(self, name: str) -> FunctionRecord:
        record = self._read(check_name(name))
        if record is None:
            raise FunctionNotFound(f"function {name!r} is not in {self.url}")
        return record

    def next_version(self, name: str) -> str:
        taken = self._children(self._key(check_name(name), ""))
        return str(next_version(item.removesuffix(".json") for item in taken))

    def add_version(
        self, manifest: FunctionManifest, files: Sequence[tuple[ArtifactFile, Path]], progress: Progress
    ) -> FunctionVersion:
        name = check_name(manifest.name)
        claim = next(((item, path) for item, path in files if item.path == MANIFEST_FILE), None)
        if claim is None:
            raise ValueError(f"a version's files must include its {MANIFEST_FILE}")
        number = self._claim(name, claim[1].read_bytes())
        progress(claim[0].size)
        for item, source in files:
            if item is not claim[0]:
                self._upload(source, self._key(name, str(number), item.path), item, progress)
        entries = tuple(item for item, _ in files)
        version = FunctionVersion(manifest, str(number), Path(), digest_of(entries), entries)
        index = orjson.dumps({**encode_version(version), "at": now_iso()})
        with s3_errors(self._url(name, f"{number}.json")):
            self._client.put_object(Bucket=self._bucket, Key=self._key(name, f"{number}.json"), Body=index)
        return version

    def remove(self, name: str) -> None:
        home = self._key(check_name(name), "")
        with s3_errors(self._url(name)):
            keys = [item["Key"] for page in self._pages(home, None) for item in page.get("Contents", ())]
            if not keys:
                raise FunctionNotFound(f"function {name!r} is not in {self.url}")
            # Indexes first: a scan in between sees fewer versions, never a version without files.
            keys.sort(key=lambda key: not key.endswith(".json"))
            for start in range(0, len(keys), 1000):
                batch = [{"Key": key} for key in keys[start : start + 1000]]
                self._client.delete_objects(Bucket=self._bucket, Delete={"Objects": batch, "Quiet": True})

    def fetch(self, function: FunctionVersion, item: ArtifactFile, target: Path) -> None:
        """One GET for a small file; ranged GETs in parallel (boto3's transfer manager) for a large one."""
        key = self._key(function.name, function.version, item.path)
        with s3_errors(self._url(function.name, function.version, item.path)):
            if item.size > SMALL_BYTES:
                self._client.download_file(self._bucket, key, str(target))
                return
            body = self._client.get_object(Bucket=self._bucket, Key=key)["Body"]
            with target.open("wb") as sink:
                for chunk in body.iter_chunks(CHUNK):
                    sink.write(chunk)

    def _read(self, name: str) -> FunctionRecord | None:
        versions = []
        home = self._key(name, "")
        with s3_errors(self._url(name)):
            indexes = [item["Key"] for page in self._pages(home, "/") for item in page.get("Contents", ())]
        for key in indexes:
            stem = key.removeprefix(home).removesuffix(".json")
            if not key.endswith(".json") or VERSION.match(stem) is None:
                continue
            with s3_errors(f"s3://{self._bucket}/{key}"):
                body = self._client.get_object(Bucket=self._bucket, Key=key)["Body"].read()
            try:
                version = decode_version(orjson.loads(body), Path(), f"s3://{self._bucket}/{key}")
            except (ValueError, ManifestError) as exc:
                log.warning("skipping %s: %s", key, exc)
                continue
            if version.name == name and version.version == stem:
                versions.append(version)
        return make_record(versions) if versions else None

    def _claim(self, name: str, manifest: bytes) -> int:
        """The next version number, claimed by writing its manifest only if it does not exist yet."""
        number = int(self.next_version(name))
        for _ in range(CLAIM_ATTEMPTS):
            key = self._key(name, str(number), MANIFEST_FILE)
            try:
                with s3_errors(self._url(name, str(number))):
                    self._client.put_object(Bucket=self._bucket, Key=key, Body=manifest, IfNoneMatch="*")
                return number
            except Unavailable as exc:
                cause: Any = exc.__cause__
                code = getattr(cause, "response", {}).get("Error", {}).get("Code")
                if code not in {"PreconditionFailed", "412"}:  # not someone else's claim of it
                    raise
            number += 1
        raise Unavailable(f"{self._url(name)}: could not claim a version number; retry")

    def _upload(self, source: Path, key: str, item: ArtifactFile, progress: Progress) -> None:
        extra = {"Metadata": {"sha256": item.sha256}, "ChecksumAlgorithm": "SHA256"}
        with s3_errors(f"s3://{self._bucket}/{key}"):
            self._client.upload_file(str(source), self._bucket, key, ExtraArgs=extra, Callback=progress)

    def _children(self, prefix: str) -> list[str]:
        """Names one level below `prefix`: folders without their '/', objects as they are."""
        names = []
        with s3_errors(self._url()):
            for page in self._pages(prefix, "/"):
                names += [
                    item["Prefix"][len(prefix) :].rstrip("/") for item in page.get("CommonPrefixes", ())
                ]
                names += [item["Key"][len(prefix) :] for item in page.get("Contents", ())]
        return names

    def _pages(self, prefix: str, delimiter: str | None) -> Iterator[dict[str, Any]]:
        arguments = {"Bucket": self._bucket, "Prefix": prefix}
        if delimiter:
            arguments["Delimiter"] = delimiter
        yield from self._client.get_paginator("list_objects_v2").paginate(**arguments)

    def _key(self, *parts: str) -> str:
        return "/".join([self._prefix, *parts] if self._prefix else parts)

    def _url(self, *parts: str) -> str:
        return "/".join([self.url, *parts])


class ArtifactCache:
    """Files under root/blobs/{sha256}; a version's folder, root/views/{digest}, links to them.
    Shared safely by the threads of a runner and by runners on one machine (a file lock per blob)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.views = root / "views"
        self._locks = root / "locks"
        for folder in (self.blobs, self.views, self._locks):
            folder.mkdir(parents=True, exist_ok=True)
        self._max_bytes = max_bytes
        self._verified: set[str] = set()
        self._pinned: collections.Counter[str] = collections.Counter()
        self._mutex = threading.Lock()
        self._remove_leftovers()

    def materialize(self, function: FunctionVersion, fetch: Fetch) -> tuple[Path, float]:
        """A folder with the version's files, each verified; what is missing is fetched. Pins the
        files until `release`. Returns the folder and the seconds spent downloading."""
        with self._mutex:
            self._pinned.update(item.sha256 for item in function.files)
        started = time.perf_counter()
        try:
            with concurrent.futures.ThreadPoolExecutor(min(FETCH_THREADS, len(function.files) or 1)) as pool:
                fetched = list(pool.map(lambda item: self._ensure(item, fetch), function.files))
            download_s = time.perf_counter() - started if any(fetched) else 0.0
            view = self._view(function)
        except BaseException:
            self.release(function)
            raise
        self.evict()
        return view, download_s

    def release(self, function: FunctionVersion) -> None:
        with self._mutex:
            self._pinned.subtract(item.sha256 for item in function.files)
            self._pinned = +self._pinned

    def evict(self) -> None:
        """Delete least recently used files that no loaded model holds until under the bound."""
        entries = []
        for path in self.blobs.iterdir():
            if not path.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    stat = path.stat()
                    entries.append((stat.st_mtime_ns, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        with self._mutex:
            pinned = set(self._pinned)
        for _, size, path in sorted(entries):
            if total <= self._max_bytes:
                break
            if path.name in pinned:
                continue
            with self._lock(path.name, wait=False) as locked:
                if locked:
                    path.unlink(missing_ok=True)
                    self._verified.discard(path.name)
                    total -= size
                    log.info("artifact cache: evicted %s (%d bytes)", path.name, size)
        for view in self.views.iterdir():
            if any(not link.exists() for link in view.rglob("*") if link.is_symlink()):
                shutil.rmtree(view, ignore_errors=True)

    def _ensure(self, item: ArtifactFile, fetch: Fetch) -> bool:
        """Whether the file had to be fetched."""
        blob = self.blobs / item.sha256
        with self._lock(item.sha256, wait=True):
            if blob.is_file() and self._intact(blob, item):
                _touch(blob)
                return False
            temporary = self.blobs / f".tmp-{item.sha256}-{uuid.uuid4().hex[:8]}"
            try:
                fetch(item, temporary)
                problem = _problem(temporary, item)
                if problem:
                    raise Unavailable(f"{item.path}: {problem}")
                os.replace(temporary, blob)
                _touch(blob)
            finally:
                temporary.unlink(missing_ok=True)
            self._verified.add(item.sha256)
            return True

    def _intact(self, blob: Path, item: ArtifactFile) -> bool:
        """Verified once per process (a restarted runner checks its cache again before use)."""
        if item.sha256 in self._verified:
            return True
        problem = _problem(blob, item)
        if problem:
            log.warning("artifact cache: %s is damaged (%s); fetching it again", blob, problem)
            blob.unlink(missing_ok=True)
            return False
        self._verified.add(item.sha256)
        return True

    def _view(self, function: FunctionVersion) -> Path:
        view = self.views / function.digest
        if view.is_dir():
            return view
        temporary = self.views / f".tmp-{uuid.uuid4().hex}"
        for item in function.files:
            link = temporary / item.path
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(self.blobs / item.sha256, link.parent))
        try:
            temporary.rename(view)
        except OSError:  # another thread or runner made it first
            shutil.rmtree(temporary, ignore_errors=True)
        return view

    @contextlib.contextmanager
    def _lock(self, name: str, wait: bool) -> Iterator[bool]:
        with (self._locks / f"{name}.lock").open("a+b") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _remove_leftovers(self) -> None:
        """Temporary files of downloads that a killed runner left (an hour old: not in progress)."""
        cutoff = time.time() - 3600
        for folder in (self.blobs, self.views):
            for path in folder.glob(".tmp-*"):
                with contextlib.suppress(OSError):
                    if path.lstat().st_mtime < cutoff:
                        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _touch(blob: Path) -> None:
    """Recency for eviction, from the fine clock (file times from the kernel's are coarse)."""
    now_ns = time.time_ns()
    os.utime(blob, ns=(now_ns, now_ns))


def _problem(path: Path, item: ArtifactFile) -> str:
    size = path.stat().st_size
    if size != item.size:
        return f"{size} bytes where the deploy recorded {item.size} (truncated or corrupt)"
    actual = hash_file(path)
    if actual != item.sha256:
        return f"sha256 {actual[:12]}... does not match {item.sha256[:12]}... recorded at deploy (corrupt)"
    return ""


@dataclasses.dataclass(frozen=True, slots=True)
class Materialized:
    function: FunctionVersion
    """The version with `directory` set to a local folder holding its files."""
    download_s: float


class Store:
    """A version's local folder: an unversioned folder as it is, a deployed one in a folder
    repository after checking its files in place, one in S3 through the artifact cache."""

    def __init__(self, repo_url: str, artifact_dir: Path, max_bytes: int) -> None:
        self._remote = S3Repository(repo_url) if is_remote(repo_url) else None
        self._root = Path(repo_url).expanduser().resolve() if repo_url and self._remote is None else None
        self._cache = ArtifactCache(artifact_dir, max_bytes) if self._remote is not None else None

    def materialize(self, function: FunctionVersion) -> Materialized:
        """Raises Unavailable (or FunctionNotFound for a missing object) naming the file."""
        try:
            if self._remote is None or self._cache is None:
                for item in function.files:
                    problem = _problem(function.directory / item.path, item)
                    if problem:
                        raise Unavailable(f"{item.path}: {problem}")
                return Materialized(function, 0.0)
            remote = self._remote
            view, download_s = self._cache.materialize(
                function, lambda item, target: remote.fetch(function, item, target)
            )
        except FileNotFoundError as exc:
            raise Unavailable(f"{exc.filename} is missing") from exc
        except FunctionNotFound as exc:  # a missing object: the function exists, its files do not
            raise Unavailable(exc.message) from exc
        return Materialized(dataclasses.replace(function, directory=view), download_s)

    def release(self, function: FunctionVersion) -> None:
        if self._cache is not None:
            self._cache.release(function)

    def engine_store(self) -> EngineStore | None:
        """Where TensorRT engine caches persist: beside the versions, under `.engines/`."""
        if self._remote is not None:
            return self._remote.engine_store()
        return FolderEngineStore(self._root) if self._root is not None else None
