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
from collections.abc import Callable, Iterator
from pathlib import Path

from fngate.errors import FunctionNotFound, Unavailable
from fngate.repository import (
    ArtifactFile,
    FunctionVersion,
    hash_file,
    is_remote,
)
from fngate.s3 import S3Repository
from runner.backends.engine_cache import EngineStore, FolderEngineStore, S3EngineStore

log = logging.getLogger(__name__)

FETCH_THREADS = 8
Fetch = Callable[[ArtifactFile, Path], None]


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


class Artifacts:
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
            return S3EngineStore(self._remote.client, self._remote.bucket, self._remote.prefix)
        return FolderEngineStore(self._root) if self._root is not None else None
