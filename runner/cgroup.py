"""A cgroup of its own for each function process, where this runner may make one (root, under
cgroup v2, v1 or both): the memory that process and everything it starts may use together, how
many processes and threads they may have (pids.max), and one kill for all of them (cgroup.kill, or
the freezer), so that nothing a function starts outlives it. The cgroups of a runner that died
are removed, and what still ran in them killed, when the next runner starts (`reap`). Where none
can be made, the runner says so at its start (`describe`) and the process's own RLIMIT_DATA holds
its memory (runner.confinement)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
PREFIX = "fngate-runner-"
"""A runner's folder of function cgroups: PREFIX + `{pid}-{start time}` (/proc/PID/stat's)."""
KILL_TIMEOUT_S = 5.0
FREEZE_TIMEOUT_S = 1.0
_POLL_S = (0.0005, 0.01)
"""Waits for the kernel (a killed process gone, a cgroup freed): from the first, doubling to the second."""
_counter = itertools.count()


@dataclasses.dataclass(frozen=True)
class Place:
    """One hierarchy's folder of this runner's function cgroups."""

    folder: Path
    version: int
    kill: str = ""
    """How a cgroup of it is killed as a whole: "cgroup.kill" (v2, Linux 5.14), "cgroup.freeze"
    (v2: frozen, each process killed, thawed), "freezer" (v1, the same); "" where it is not."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this runner makes its function cgroups, by what each holds; `missing` says why
    something is not held."""

    memory: Place | None = None
    pids: Place | None = None
    kill: Place | None = None
    missing: tuple[str, ...] = ()

    @property
    def places(self) -> list[Place]:
        return list({place.folder: place for place in (self.memory, self.pids, self.kill) if place}.values())

    def describe(self) -> str:
        """What holds a function's processes, in words, for the runner's start."""
        held = []
        if self.memory is not None:
            held.append(f"memory (cgroup v{self.memory.version})")
        if self.pids is not None:
            held.append(f"pids.max (cgroup v{self.pids.version})")
        if self.kill is not None:
            held.append(f"killed as a whole ({_KILLS[self.kill.kill]})")
        text = "cgroups hold " + ", ".join(held) if held else "no cgroups"
        if self.missing:
            text += "; not held: " + "; ".join(self.missing)
        return text


_KILLS = {
    "cgroup.kill": "cgroup.kill",
    "cgroup.freeze": "cgroup v2 freezer",
    "freezer": "cgroup v1 freezer",
    "": "each process found in its cgroups, in rounds",
}
_layout: list[Layout] = []
_layout_lock = threading.Lock()


class FunctionCgroup:
    """One function process's cgroups (one folder per hierarchy that holds something of it)."""

    def __init__(self, layout: Layout, folders: dict[Path, Path]) -> None:
        self.layout = layout
        self._folders = folders
        """This cgroup's folder, by its hierarchy's base folder."""

    @classmethod
    def create(cls, name: str, memory_limit_bytes: int, pids_limit: int) -> FunctionCgroup | None:
        """New cgroups at these limits (no swap); None where this runner can make none."""
        layout = current_layout()
        if not layout.places:
            return None
        leaf = f"{name}-{next(_counter)}"
        folders: dict[Path, Path] = {}
        try:
            for place in layout.places:
                folders[place.folder] = folder = place.folder / leaf
                folder.mkdir()
            if layout.memory is not None:
                _limit_memory(folders[layout.memory.folder], layout.memory.version, memory_limit_bytes)
            if layout.pids is not None:
                (folders[layout.pids.folder] / "pids.max").write_text(str(pids_limit))
        except OSError as exc:
            log.warning("could not make the cgroups of a function process of %s (%s)", name, exc)
            for folder in folders.values():
                with contextlib.suppress(OSError):
                    folder.rmdir()
            return None
        return cls(layout, folders)

    def add(self, pid: int) -> None:
        for folder in self._folders.values():
            (folder / "cgroup.procs").write_text(str(pid))

    def _folder(self, place: Place | None) -> Path | None:
        return None if place is None else self._folders[place.folder]

    def out_of_memory(self) -> bool:
        """The kernel ended a process of this cgroup at its limit."""
        folder = self._folder(self.layout.memory)
        if folder is None or self.layout.memory is None:
            return False
        events = "memory.events" if self.layout.memory.version == 2 else "memory.oom_control"
        return _count(folder / events, "oom_kill") > 0

    def at_limit(self) -> bool:
        """Its use reached the limit (the kernel reclaimed, or ended a process): a batch that ran
        out of time there was held by its memory, not slow."""
        folder = self._folder(self.layout.memory)
        if folder is None or self.layout.memory is None:
            return False
        if self.layout.memory.version == 2:
            return _count(folder / "memory.events", "max") > 0 or self.out_of_memory()
        try:
            return int((folder / "memory.failcnt").read_text()) > 0 or self.out_of_memory()
        except (OSError, ValueError):
            return self.out_of_memory()

    def pids_refused(self) -> int:
        """How many times a fork or a thread of its processes was refused at pids.max."""
        folder = self._folder(self.layout.pids)
        return 0 if folder is None else _count(folder / "pids.events", "max")

    def kill(self) -> int:
        """Kill every process in it, and wait until they are gone: how many there were."""
        place = self.layout.kill
        folder = self._folder(place)
        killed = kill_all(folder, place.kill) if folder is not None and place is not None else 0
        for other in self._folders.values():  # without a kill of its own: what any of them still holds
            killed += kill_all(other, "")
        return killed

    def remove(self) -> None:
        """Kill what is left in it, then remove its folders."""
        self.kill()
        for folder in self._folders.values():
            _remove(folder)


def current_layout() -> Layout:
    """This runner's layout, made (and its folders created) at the first call."""
    with _layout_lock:
        if not _layout:
            _layout.append(_make_layout())
            atexit.register(_remove_layout, _layout[0])
        return _layout[0]


def _make_layout() -> Layout:
    if os.geteuid() != 0:
        return Layout(missing=("cgroups: the runner is not root",))
    own = _own_cgroups()
    name = f"{PREFIX}{os.getpid()}-{start_time(os.getpid())}"
    missing: list[str] = []
    memory = pids = kill = None
    v2 = _v2_mount()
    if v2 is not None and "" in own:
        try:
            base = _v2_parent(v2, own[""]) / name
            base.mkdir(exist_ok=True)
            controllers = _enable(base, ("memory", "pids"))
            place = Place(base, 2, _v2_kill(base))
            kill = place if place.kill else None
            memory = place if "memory" in controllers else None
            pids = place if "pids" in controllers else None
        except OSError as exc:
            missing.append(f"cgroup v2 at {v2} ({exc})")
    for controller in ("memory", "pids", "freezer"):
        if (controller == "memory" and memory is not None) or (controller == "pids" and pids is not None):
            continue
        if controller == "freezer" and kill is not None:
            continue
        mount = ROOT / controller
        if controller not in own or not (mount / "cgroup.procs").is_file():
            continue
        try:
            base = mount / own[controller].lstrip("/") / name
            base.mkdir(exist_ok=True)
        except OSError as exc:
            missing.append(f"cgroup v1 {controller} ({exc})")
            continue
        if controller == "memory":
            memory = Place(base, 1)
        elif controller == "pids":
            pids = Place(base, 1)
        else:
            kill = Place(base, 1, "freezer")
    if memory is None:
        missing.append("memory: no memory controller here (RLIMIT_DATA at memory_limit_mb only)")
    if pids is None:
        missing.append("pids_limit: no pids controller here")
    if kill is None:
        missing.append(
            "a kill as a whole: no cgroup.kill nor freezer (each process found is killed, in rounds)"
        )
    return Layout(memory, pids, kill, tuple(missing))


def _v2_mount() -> Path | None:
    """The unified hierarchy: /sys/fs/cgroup itself (v2 only), or /sys/fs/cgroup/unified (hybrid)."""
    for mount in (ROOT, ROOT / "unified"):
        if (mount / "cgroup.controllers").is_file():
            return mount
    return None


def _v2_parent(mount: Path, own: str) -> Path:
    """Where a v2 runner's folder goes: beside its own cgroup (a process may only sit in a leaf,
    so not below it), or in the root when it is in the root."""
    folder = mount / own.lstrip("/")
    return folder.parent if own not in ("", "/") else folder


def _enable(base: Path, wanted: tuple[str, ...]) -> set[str]:
    """Turn `wanted` controllers on for the children of `base` (and for `base` in its parent, where
    that parent allows it): the ones that are on."""
    parent = base.parent
    offered = _read(parent / "cgroup.controllers").split()
    enabled = _read(parent / "cgroup.subtree_control").split()
    for controller in wanted:
        if controller in offered and controller not in enabled:
            with contextlib.suppress(OSError):  # a parent with processes of its own cannot
                (parent / "cgroup.subtree_control").write_text(f"+{controller}")
    available = _read(base / "cgroup.controllers").split()
    on = set()
    for controller in wanted:
        if controller in available:
            with contextlib.suppress(OSError):
                (base / "cgroup.subtree_control").write_text(f"+{controller}")
                on.add(controller)
    return on


def _v2_kill(base: Path) -> str:
    """How this kernel kills a v2 cgroup as a whole: cgroup.kill (5.14), else its freezer (5.2);
    each file exists in every non-root cgroup of a kernel that has it."""
    for how in ("cgroup.kill", "cgroup.freeze"):
        if (base / how).exists():
            return how
    return ""


def _limit_memory(folder: Path, version: int, limit_bytes: int) -> None:
    if version == 2:
        (folder / "memory.max").write_text(str(limit_bytes))
        with contextlib.suppress(OSError):  # without swap accounting there is no such file
            (folder / "memory.swap.max").write_text("0")
        with contextlib.suppress(OSError):  # what the function started goes with it
            (folder / "memory.oom.group").write_text("1")
    else:
        (folder / "memory.limit_in_bytes").write_text(str(limit_bytes))
        with contextlib.suppress(OSError):
            (folder / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))


def kill_all(folder: Path, how: str) -> int:
    """Kill every process in the cgroup at `folder` (`how`: Place.kill) and wait until it is
    empty: how many processes it held."""
    held = _procs(folder)
    if not held:
        return 0
    if how == "cgroup.kill":
        _write(folder / "cgroup.kill", "1")
    elif how in ("cgroup.freeze", "freezer"):
        _frozen(folder, how, True)
        for pid in _procs(folder):
            _signal(pid)
        _frozen(folder, how, False)  # a frozen process takes its SIGKILL once thawed
    deadline = time.monotonic() + KILL_TIMEOUT_S
    for pause in _pauses():
        left = _procs(folder)
        if not left:
            return len(held)
        if time.monotonic() > deadline:
            log.warning("cgroup %s still holds processes %s after they were killed", folder, left[:10])
            return len(held)
        if how not in ("cgroup.kill",):  # without an atomic kill: whatever forked meanwhile
            for pid in left:
                _signal(pid)
        time.sleep(pause)
    return len(held)  # not reached: _pauses never ends


def _frozen(folder: Path, how: str, freeze: bool) -> None:
    if how == "cgroup.freeze":
        _write(folder / "cgroup.freeze", "1" if freeze else "0")
    else:
        _write(folder / "freezer.state", "FROZEN" if freeze else "THAWED")
    deadline = time.monotonic() + FREEZE_TIMEOUT_S
    for pause in _pauses():
        if _is_frozen(folder, how, freeze) or time.monotonic() > deadline:
            return
        time.sleep(pause)


def _pauses() -> Iterator[float]:
    pause = _POLL_S[0]
    while True:
        yield pause
        pause = min(pause * 2, _POLL_S[1])


def _is_frozen(folder: Path, how: str, freeze: bool) -> bool:
    if how == "cgroup.freeze":
        return _count(folder / "cgroup.events", "frozen") == int(freeze)
    return _read(folder / "freezer.state").strip() == ("FROZEN" if freeze else "THAWED")


def reap() -> tuple[int, int]:
    """Kill what still runs in the function cgroups of runners that are gone, and remove them:
    how many processes were killed and how many cgroups removed."""
    killed = removed = 0
    for place in _killing_first(current_layout()):  # the others then find their cgroups empty
        for base in _leftovers(place.folder.parent):
            for folder in _children(base):
                killed += kill_all(folder, place.kill)
                removed += _remove(folder)
            removed += _remove(base)
    return killed, removed


def _leftovers(parent: Path) -> Iterator[Path]:
    """Folders of runners (PREFIX) in `parent` whose runner is no longer running."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(PREFIX) and entry.is_dir() and not owner_alive(entry.name):
            yield entry


def owner_alive(name: str) -> bool:
    """Whether the runner that a folder named PREFIX + `{pid}-{start time}` belongs to still runs
    (a process of that id that started then; the id alone for a folder of an older runner)."""
    pid, _, started = name.removeprefix(PREFIX).partition("-")
    if not pid.isdigit():
        return True  # not ours to judge
    now = start_time(int(pid))
    return now is not None and (not started or started == now)


def start_time(pid: int) -> str | None:
    """When a process started (clock ticks since boot, /proc/PID/stat); None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _remove_layout(layout: Layout) -> None:
    """At the runner's exit: whatever its functions still run is killed, and its folders removed."""
    for place in _killing_first(layout):
        for folder in _children(place.folder):
            kill_all(folder, place.kill)
            _remove(folder)
        _remove(place.folder)


def _killing_first(layout: Layout) -> list[Place]:
    return ([layout.kill] if layout.kill else []) + [place for place in layout.places if place != layout.kill]


def _children(folder: Path) -> list[Path]:
    try:
        return [entry for entry in folder.iterdir() if entry.is_dir()]
    except OSError:
        return []


def _remove(folder: Path) -> int:
    """Remove an empty cgroup (the kernel frees one a moment after its last process): 1 if it
    went."""
    deadline = time.monotonic() + KILL_TIMEOUT_S
    for pause in _pauses():
        try:
            folder.rmdir()
            return 1
        except FileNotFoundError:
            return 0
        except OSError:
            if time.monotonic() > deadline:
                break
            time.sleep(pause)
    log.warning("cgroup %s is still busy; left behind", folder)
    return 0


def _procs(folder: Path) -> list[int]:
    return [int(line) for line in _read(folder / "cgroup.procs").split()]


def _signal(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _count(path: Path, key: str) -> int:
    for line in _read(path).splitlines():
        found, _, value = line.partition(" ")
        if found == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


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


def _write(path: Path, text: str) -> None:
    with contextlib.suppress(OSError):
        path.write_text(text)
