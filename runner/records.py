"""Sidecar records of verified files: a file checked against its sha256 is not read again to check
it while its size, mtime, ctime and inode are what its record says; one that changed is hashed in
full. The ctime is there because a user cannot set it back: a file changed in place with its mtime
restored still shows a new ctime."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from pathlib import Path

from fngate.repository import ArtifactFile, hash_file

RACY_NS = 2_000_000_000
"""A record is trusted only for a file last written this long before the record was made: a write
within the same tick of the kernel's coarse file clock would leave its mtime unchanged."""


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """A file verified against its sha256, and the file as it was then: while its size, mtime,
    ctime and inode are unchanged, it is not read again to check it."""

    sha256: str
    size: int
    mtime_ns: int
    inode: int
    verified_ns: int
    ctime_ns: int

    def matches(self, stat: os.stat_result, sha256: str) -> bool:
        return (
            self.sha256 == sha256
            and (self.size, self.mtime_ns, self.inode, self.ctime_ns) == _identity(stat)
            and stat.st_mtime_ns < self.verified_ns - RACY_NS
        )


class Verifications:
    """Sidecar records (records/{key}.json) of verified files; a file whose record does not match
    is hashed in full, and recorded again when it is intact. Shared by the runners of a machine."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.hashed_bytes = 0
        """Bytes this process hashed to verify files on disk (not counting downloads)."""

    def problem(self, path: Path, item: ArtifactFile, key: str) -> str:
        """What is wrong with `path` as `item` ("" when nothing is): by its record, else by hashing."""
        stat = path.stat()
        if stat.st_size != item.size:
            return f"{stat.st_size} bytes where the deploy recorded {item.size} (truncated or corrupt)"
        record = self._read(key)
        if record is not None and record.matches(stat, item.sha256):
            return ""
        actual = hash_file(path)
        self.hashed_bytes += stat.st_size
        if actual != item.sha256:
            self.forget(key)
            return (
                f"sha256 {actual[:12]}... does not match {item.sha256[:12]}... recorded at deploy (corrupt)"
            )
        if _identity(path.stat()) == _identity(stat):  # unchanged while it was hashed
            self.record(key, stat, item.sha256)
        return ""

    def record(self, key: str, stat: os.stat_result, sha256: str) -> None:
        record = Record(sha256, stat.st_size, stat.st_mtime_ns, stat.st_ino, time.time_ns(), stat.st_ctime_ns)
        temporary = self.folder / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
        temporary.write_text(json.dumps(dataclasses.asdict(record)))
        os.replace(temporary, self.folder / f"{key}.json")

    def forget(self, key: str) -> None:
        (self.folder / f"{key}.json").unlink(missing_ok=True)

    def _read(self, key: str) -> Record | None:
        try:
            return Record(**json.loads((self.folder / f"{key}.json").read_text()))
        except (OSError, ValueError, TypeError):  # none, unreadable or older: verify by hashing
            return None


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns
