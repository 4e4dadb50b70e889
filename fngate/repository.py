"""The model repository as both processes see it: which functions exist, at which version, and
where their files are. The folder layout is `{root}/{function}/function.yaml` beside the model."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Protocol

from fngate.errors import FunctionNotFound
from fngate.manifest import FunctionManifest, ManifestError, load_manifest

log = logging.getLogger(__name__)

MANIFEST_FILE = "function.yaml"


@dataclasses.dataclass(frozen=True, slots=True)
class FunctionVersion:
    manifest: FunctionManifest
    version: str
    directory: Path
    """A local folder holding the manifest and the model files."""
    digest: str = ""
    """sha256 over the version's files: what makes two versions' answers differ."""

    @property
    def name(self) -> str:
        return self.manifest.name


class Repository(Protocol):
    def scan(self) -> dict[str, FunctionVersion]:
        """Every servable function by name. Blocking: call it in a thread from async code."""
        ...

    def get(self, name: str) -> FunctionVersion:
        """One function; raises FunctionNotFound. Blocking."""
        ...


class FolderRepository:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._reported: set[tuple[str, str]] = set()
        self._digests: dict[Path, tuple[tuple[tuple[str, int, int], ...], str]] = {}

    def scan(self) -> dict[str, FunctionVersion]:
        found: dict[str, FunctionVersion] = {}
        if not self.root.is_dir():
            log.warning("repository folder %s does not exist", self.root)
            return found
        for path in sorted(self.root.glob(f"*/{MANIFEST_FILE}")):
            entry = self._read(path)
            if entry is not None:
                found[entry.name] = entry
        return found

    def get(self, name: str) -> FunctionVersion:
        path = self.root / name / MANIFEST_FILE
        entry = self._read(path) if "/" not in name and name not in (".", "..") else None
        if entry is None:
            raise FunctionNotFound(f"function {name!r} is not in the repository")
        return entry

    def _read(self, path: Path) -> FunctionVersion | None:
        if not path.is_file():
            return None
        try:
            manifest = load_manifest(path)
        except ManifestError as exc:
            self._report(path, str(exc))
            return None
        if manifest.name != path.parent.name:
            self._report(path, f"name {manifest.name!r} differs from its folder {path.parent.name!r}")
            return None
        return FunctionVersion(manifest, "1", path.parent, self._digest(path.parent))

    def _digest(self, folder: Path) -> str:
        """sha256 over every file's name and contents; recomputed only when a file changes."""
        stamp = tuple(
            (str(item.relative_to(folder)), item.stat().st_size, item.stat().st_mtime_ns)
            for item in sorted(folder.rglob("*"))
            if item.is_file() and "__pycache__" not in item.parts
        )
        cached = self._digests.get(folder)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        digest = hashlib.sha256()
        for name, _size, _mtime in stamp:
            digest.update(name.encode() + b"\0")
            digest.update(hashlib.sha256((folder / name).read_bytes()).digest())
        self._digests[folder] = (stamp, digest.hexdigest())
        return digest.hexdigest()

    def _report(self, path: Path, problem: str) -> None:
        # Scans repeat every few seconds: say each problem once, not on every scan.
        if (str(path), problem) not in self._reported:
            self._reported.add((str(path), problem))
            log.warning("skipping %s: %s", path, problem)


def open_repository(url: str) -> Repository:
    """A repository from its URL: a folder path (S3 arrives with the deploy issue)."""
    if url.startswith("s3://"):
        raise NotImplementedError("S3 repositories are not supported yet; use a folder")
    return FolderRepository(Path(url).expanduser().resolve())
