"""A memory cgroup of its own for each function process, where this runner may make one (as root,
under cgroup v2 or the v1 memory controller): the kernel holds the process to its memory_limit_mb
during a batch (the allocation past it ends the process), and the cgroup says that this is what
ended it. Elsewhere the process's own RLIMIT_DATA holds it (runner.confinement)."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
V1_MEMORY = ROOT / "memory"
_counter = itertools.count()
_base: list[tuple[Path, int] | None] = []


class MemoryCgroup:
    """One process's cgroup: its limit set, the process added once started, removed after it."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.version = version

    @classmethod
    def create(cls, name: str, limit_bytes: int) -> MemoryCgroup | None:
        """A new cgroup limited to `limit_bytes` (no swap); None where this runner cannot make one."""
        base = _runner_base()
        if base is None:
            return None
        folder, version = base
        path = folder / f"{name}-{next(_counter)}"
        try:
            path.mkdir()
            if version == 2:
                (path / "memory.max").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):  # without swap accounting there is no such file
                    (path / "memory.swap.max").write_text("0")
                with contextlib.suppress(OSError):  # what the function started goes with it
                    (path / "memory.oom.group").write_text("1")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                with contextlib.suppress(OSError):
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except OSError as exc:
            log.warning("could not make a memory cgroup in %s (%s); RLIMIT_DATA holds the limit", folder, exc)
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        return cls(path, version)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def out_of_memory(self) -> bool:
        """The kernel ended a process of this cgroup at its limit."""
        return self._count("memory.events" if self.version == 2 else "memory.oom_control", "oom_kill") > 0

    def at_limit(self) -> bool:
        """Its use reached the limit (the kernel reclaimed, or ended a process): a batch that ran
        out of time there was held by its memory, not slow."""
        if self.version == 2:
            return self._count("memory.events", "max") > 0 or self.out_of_memory()
        try:
            return int((self.path / "memory.failcnt").read_text()) > 0 or self.out_of_memory()
        except (OSError, ValueError):
            return self.out_of_memory()

    def _count(self, name: str, key: str) -> int:
        try:
            for line in (self.path / name).read_text().splitlines():
                found, _, value = line.partition(" ")
                if found == key:
                    return int(value)
        except (OSError, ValueError):
            return 0
        return 0

    def remove(self) -> None:
        """Once its processes have exited (the kernel frees a cgroup a moment after)."""
        for _ in range(20):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)
        log.debug("memory cgroup %s is still busy; left behind", self.path)


def _runner_base() -> tuple[Path, int] | None:
    """This runner's folder of function cgroups (made once), and the cgroup version."""
    if not _base:
        _base.append(_make_base())
    return _base[0]


def _make_base() -> tuple[Path, int] | None:
    if os.geteuid() != 0:
        return None
    own = _own_cgroups()
    name = f"fngate-runner-{os.getpid()}"
    try:
        if "memory" in _read(ROOT / "cgroup.controllers").split() and "" in own:
            # v2: a process may only sit in a leaf, so the folder is a sibling of this runner's cgroup.
            parent = ROOT / own[""].lstrip("/")
            parent = parent.parent if own[""] not in ("", "/") else parent
            folder = parent / name
            folder.mkdir(exist_ok=True)
            (folder / "cgroup.subtree_control").write_text("+memory")
            version = 2
        elif "memory" in own and V1_MEMORY.is_dir():
            folder = V1_MEMORY / own["memory"].lstrip("/") / name
            folder.mkdir(exist_ok=True)
            version = 1
        else:
            return None
    except OSError as exc:
        log.info("no memory cgroups for function processes (%s); RLIMIT_DATA holds their limits", exc)
        return None
    atexit.register(_remove_base, folder)
    return folder, version


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per controller ('' for v2's unified hierarchy)."""
    found = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _id, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            found[controller] = path
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _remove_base(folder: Path) -> None:
    with contextlib.suppress(OSError):
        folder.rmdir()
