"""Model files from the repository to a local folder: the artifact cache (files by sha256, checked
as they download or against their sidecar records, written atomically, bounded, least recently used
first) and the store that gives the pool a version's local folder. Every method here blocks."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from fngate.errors import FunctionNotFound, Unavailable
from fngate.manifest import MANIFEST_FILE
from fngate.repository import ArtifactFile, FunctionVersion, is_remote
from fngate.s3 import PART_BYTES, S3Repository
from runner.backends.engine_cache import EngineStore, FolderEngineStore, S3EngineStore
from runner.records import RACY_NS, Verifications

log = logging.getLogger(__name__)

FETCH_THREADS = 8
Fetch = Callable[[ArtifactFile, Path], str]
"""Write the file to the path; returns the sha256 of what was written (computed as it arrived)."""
Read = Callable[[ArtifactFile], tuple[bytes, str]]
"""The file's bytes in memory and their sha256 (computed as they arrived)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    view: Path
    """The version's folder (its files as links into the cache)."""
    download_s: float
    data: bytes | None = None
    """The verified bytes of the file asked to be kept in memory, when it was downloaded now; the
    cache's copy of it is written in the background (`flush` waits for that)."""


class ArtifactCache:
    """Files under root/blobs/{sha256}; a version's folder, root/views/{digest}, links to them.
    Shared safely by the threads of a runner and by runners on one machine (a file lock per blob).
    A blob's mtime is the time it was written (set in the past, so its record is never racy); its
    atime is its recency for eviction."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.views = root / "views"
        self._locks = root / "locks"
        for folder in (self.blobs, self.views, self._locks):
            folder.mkdir(parents=True, exist_ok=True)
        self.verifications = Verifications(root / "records")
        self._max_bytes = max_bytes
        self._pinned: collections.Counter[str] = collections.Counter()
        self._mutex = threading.Lock()
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="artifact-writer")
        self._writes: set[concurrent.futures.Future[None]] = set()
        self._remove_leftovers()

    def materialize(
        self, function: FunctionVersion, fetch: Fetch, read: Read | None = None, keep: str = ""
    ) -> Placed:
        """A folder with the version's files, each verified; what is missing is fetched. The file at
        path `keep`, when missing, is read into memory with `read` instead and returned verified,
        its copy in the cache written in the background. Pins the files until `release`."""
        with self._mutex:
            self._pinned.update(item.sha256 for item in function.files)
        started = time.perf_counter()
        try:
            with concurrent.futures.ThreadPoolExecutor(min(FETCH_THREADS, len(function.files) or 1)) as pool:
                results = list(
                    pool.map(
                        lambda item: self._ensure(item, fetch, read if item.path == keep else None),
                        function.files,
                    )
                )
            download_s = time.perf_counter() - started if any(results) else 0.0
            view = self._view(function)
        except BaseException:
            self.release(function)
            raise
        data = next((result for result in results if isinstance(result, bytes)), None)
        if data is None:
            self.evict()
        return Placed(view, download_s, data)

    def flush(self) -> None:
        """Wait for the cache writes under way."""
        for write in list(self._writes):
            write.result()

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
                    entries.append((stat.st_atime_ns, stat.st_size, path))
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
                    self.verifications.forget(path.name)
                    total -= size
                    log.info("artifact cache: evicted %s (%d bytes)", path.name, size)
        if self._writes:
            return  # a view links to a blob still being written: not broken
        for view in self.views.iterdir():
            if any(not link.exists() for link in view.rglob("*") if link.is_symlink()):
                shutil.rmtree(view, ignore_errors=True)

    def _ensure(self, item: ArtifactFile, fetch: Fetch, read: Read | None) -> bool | bytes:
        """Whether the file had to be fetched; its bytes when it was read into memory."""
        blob = self.blobs / item.sha256
        with contextlib.ExitStack() as held:
            held.enter_context(self._lock(item.sha256, wait=True))
            if blob.is_file() and self._intact(blob, item):
                _touch(blob)  # which changes its ctime: recorded again, as the file just checked
                self.verifications.record(item.sha256, blob.stat(), item.sha256)
                return False
            if read is not None:
                data, actual = read(item)
                _check(item, len(data), actual)
                write = self._writer.submit(self._write, item, data, held.pop_all())
                self._writes.add(write)
                write.add_done_callback(self._writes.discard)
                return data
            temporary = self.blobs / f".tmp-{item.sha256}-{uuid.uuid4().hex[:8]}"
            try:
                actual = fetch(item, temporary)
                _check(item, temporary.stat().st_size, actual)
                self._commit(temporary, item)
            finally:
                temporary.unlink(missing_ok=True)
            return True
        raise AssertionError("unreachable")

    def _write(self, item: ArtifactFile, data: bytes, lock: contextlib.ExitStack) -> None:
        """The cache's copy of bytes verified in memory; the blob's lock is held until it is written."""
        with lock:
            temporary = self.blobs / f".tmp-{item.sha256}-{uuid.uuid4().hex[:8]}"
            try:
                temporary.write_bytes(data)
                self._commit(temporary, item)
            except OSError as exc:  # the model runs from memory; the next load downloads again
                log.warning("artifact cache: could not write %s (%s)", item.path, exc)
            finally:
                temporary.unlink(missing_ok=True)
        self.evict()

    def _commit(self, temporary: Path, item: ArtifactFile) -> None:
        """A verified file into its place, with its record: mtime set in the past, so that any later
        write to it changes the mtime however coarse the file clock, and recency (atime) now."""
        now_ns = time.time_ns()
        os.utime(temporary, ns=(now_ns, now_ns - 2 * RACY_NS))
        blob = self.blobs / item.sha256
        os.replace(temporary, blob)  # a rename changes the ctime: recorded after it
        self.verifications.record(item.sha256, blob.stat(), item.sha256)

    def _intact(self, blob: Path, item: ArtifactFile) -> bool:
        """By its record when it matches (see Verifications), else by hashing it in full."""
        problem = self.verifications.problem(blob, item, item.sha256)
        if problem:
            log.warning("artifact cache: %s is damaged (%s); fetching it again", blob, problem)
            blob.unlink(missing_ok=True)
            return False
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
    """Recency for eviction (atime), from the fine clock (file times from the kernel's are coarse);
    the mtime stays what its record says."""
    with contextlib.suppress(FileNotFoundError):
        os.utime(blob, ns=(time.time_ns(), blob.stat().st_mtime_ns))


def _check(item: ArtifactFile, size: int, sha256: str) -> None:
    """Bytes fetched for `item` (their size and the sha256 computed as they arrived) are what the
    deploy recorded; raises Unavailable naming the file otherwise."""
    if size != item.size:
        raise Unavailable(
            f"{item.path}: {size} bytes where the deploy recorded {item.size} (truncated or corrupt)"
        )
    if sha256 != item.sha256:
        raise Unavailable(
            f"{item.path}: sha256 {sha256[:12]}... does not match {item.sha256[:12]}... "
            "recorded at deploy (corrupt)"
        )


def in_memory(function: FunctionVersion) -> str:
    """The file whose verified bytes may go straight to the backend (its cache copy written in the
    background): an ONNX model that onnxruntime builds a session of from bytes, unless the version
    has other files (external data is read from beside the model's path) or asks for TensorRT
    (its engine cache works from the file). "" when none."""
    model = function.manifest.model
    if model.backend != "onnxruntime" or model.accelerator == "tensorrt":
        return ""
    if any(item.path not in (model.path, MANIFEST_FILE) for item in function.files):
        return ""
    return model.path


@dataclasses.dataclass(frozen=True, slots=True)
class Materialized:
    function: FunctionVersion
    """The version with `directory` set to a local folder holding its files."""
    download_s: float
    model_bytes: bytes | None = None
    """The model file's verified bytes, when it was downloaded now and the backend may load them
    from memory (see `in_memory`)."""


class Artifacts:
    """A version's local folder: an unversioned folder as it is, a deployed one in a folder
    repository after checking its files in place (spared by their records), one in S3 through the
    artifact cache."""

    def __init__(
        self, repo_url: str, artifact_dir: Path, max_bytes: int, part_bytes: int = PART_BYTES
    ) -> None:
        self._remote = S3Repository(repo_url, part_bytes) if is_remote(repo_url) else None
        self._root = Path(repo_url).expanduser().resolve() if repo_url and self._remote is None else None
        self.cache = ArtifactCache(artifact_dir, max_bytes) if self._remote is not None else None
        self.verifications = (
            self.cache.verifications
            if self.cache is not None
            else Verifications(artifact_dir / "records")
            if self._root is not None
            else None
        )

    def materialize(self, function: FunctionVersion) -> Materialized:
        """Raises Unavailable (or FunctionNotFound for a missing object) naming the file."""
        try:
            if self._remote is None or self.cache is None:
                self._check_in_place(function)
                return Materialized(function, 0.0)
            remote = self._remote
            placed = self.cache.materialize(
                function,
                lambda item, target: remote.fetch(function, item, target),
                lambda item: remote.read(function, item),
                in_memory(function),
            )
        except FileNotFoundError as exc:
            raise Unavailable(f"{exc.filename} is missing") from exc
        except FunctionNotFound as exc:  # a missing object: the function exists, its files do not
            raise Unavailable(exc.message) from exc
        return Materialized(
            dataclasses.replace(function, directory=placed.view), placed.download_s, placed.data
        )

    def prefetch(self, function: FunctionVersion) -> bool:
        """Put the version's files in the artifact cache without loading it (an S3 repository only:
        a folder's files are local already). Whether anything was downloaded."""
        if self._remote is None or self.cache is None:
            return False
        remote = self._remote
        placed = self.cache.materialize(function, lambda item, target: remote.fetch(function, item, target))
        self.cache.release(function)
        return placed.download_s > 0

    def _check_in_place(self, function: FunctionVersion) -> None:
        for item in function.files:
            path = function.directory / item.path
            if self.verifications is None:
                raise AssertionError("a deployed version's files come from a repository")
            key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()
            problem = self.verifications.problem(path, item, key)
            if problem:
                raise Unavailable(f"{item.path}: {problem}")

    def release(self, function: FunctionVersion) -> None:
        if self.cache is not None:
            self.cache.release(function)

    def engine_store(self) -> EngineStore | None:
        """Where TensorRT engine caches persist: beside the versions, under `.engines/`."""
        if self._remote is not None:
            return S3EngineStore(self._remote.client, self._remote.bucket, self._remote.prefix)
        return FolderEngineStore(self._root) if self._root is not None else None
