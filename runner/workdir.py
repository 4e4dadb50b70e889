"""The working folder of each function process (its current directory and TMPDIR): a tmpfs of its
own, at the function's working_folder_limit_mb, where this runner may mount one (root), else a plain
folder. Each lives in its runner's folder in the temporary directory; the folders of a runner that
died are unmounted and removed when the next runner starts (`reap`)."""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from runner import cgroup, confinement

log = logging.getLogger(__name__)

_base: list[tuple[Path, str]] = []
"""This runner's folder, and why its working folders are plain ones ("" when they are tmpfs)."""
_lock = threading.Lock()


class WorkingFolder:
    """One process's working folder: made empty, owned by the process's user, removed with it."""

    def __init__(self, path: Path, mounted: bool) -> None:
        self.path = path
        self.mounted = mounted

    @classmethod
    def make(cls, name: str, limit_bytes: int, owner: tuple[int, int] | None) -> WorkingFolder:
        """A new folder, a tmpfs of `limit_bytes` where one can be mounted; raises OSError."""
        base, unmounted = runner_folder()
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
        mounted = False
        if not unmounted:
            uid, gid = owner or (os.getuid(), os.getgid())
            options = f"size={limit_bytes},mode=0700,uid={uid},gid={gid}"
            try:
                confinement.mount("fngate-work", str(path), "tmpfs", _FLAGS, options)
                mounted = True
            except OSError as exc:
                log.warning(
                    "could not mount a tmpfs for %s's working folder (%s): its size is not capped", name, exc
                )
        if owner is not None and not mounted:
            os.chown(path, *owner)
        return cls(path, mounted)

    def remove(self) -> None:
        """Once its processes have gone (a tmpfs goes with its last user)."""
        if self.mounted:
            with contextlib.suppress(OSError):
                confinement.unmount(str(self.path))
        shutil.rmtree(self.path, ignore_errors=True)


_FLAGS = confinement.MS_NOSUID | confinement.MS_NODEV


def runner_folder() -> tuple[Path, str]:
    """This runner's folder (made at the first call, removed at its exit), and why its working
    folders cannot be tmpfs ("" when they are): a tmpfs is mounted and unmounted there at once to
    tell."""
    with _lock:
        if not _base:
            name = f"{cgroup.PREFIX}{os.getpid()}-{cgroup.start_time(os.getpid())}"
            base = Path(tempfile.gettempdir()) / name
            base.mkdir(mode=0o711, exist_ok=True)
            base.chmod(0o711)  # its processes' users reach their own folder, and list none
            _base.append((base, _probe(base)))
            atexit.register(_remove_all, base)
        return _base[0]


def _probe(base: Path) -> str:
    if os.geteuid() != 0:
        return "the runner is not root (RLIMIT_FSIZE caps each file at the limit instead)"
    probe = base / ".probe"
    probe.mkdir(exist_ok=True)
    try:
        confinement.mount("fngate-work", str(probe), "tmpfs", _FLAGS, "size=4096")
        confinement.unmount(str(probe))
    except OSError as exc:
        return f"no tmpfs can be mounted here ({exc}; RLIMIT_FSIZE caps each file at the limit instead)"
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()
    return ""


def reap() -> int:
    """Unmount and remove the folders of runners that are gone: how many runners' folders."""
    runner_folder()
    removed = 0
    parent = Path(tempfile.gettempdir())
    try:
        entries = list(parent.iterdir())
    except OSError:
        return 0
    for entry in entries:
        if entry.name.startswith(cgroup.PREFIX) and entry.is_dir() and not cgroup.owner_alive(entry.name):
            _remove_all(entry)
            removed += 1
    return removed


def _remove_all(base: Path) -> None:
    for mounted in sorted(_mounts_below(base), key=lambda path: -len(path.parts)):
        with contextlib.suppress(OSError):
            confinement.unmount(str(mounted))
    try:
        shutil.rmtree(base)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("could not remove %s: %s", base, exc)


def _mounts_below(folder: Path) -> list[Path]:
    """Mount points at or below `folder`, from /proc/self/mountinfo (its octal escapes undone)."""
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(" ")
        if len(fields) < 5:
            continue
        point = Path(fields[4].encode().decode("unicode_escape"))
        if point == folder or point.is_relative_to(folder):
            found.append(point)
    return found
