"""What a function's process may reach, and the Linux mechanisms that hold it there: an
unprivileged user under a root runner (FUNCTION_UID; never uid 0), with the Python it runs shown to
it in a mount namespace of its own where that user cannot reach it; Landlock (the files it may read
and write, no TCP, no signals or abstract sockets beyond itself); a seccomp filter (runner.seccomp:
no sockets, keyrings, namespaces, other processes' memory or io_uring); resource limits (its memory,
its files' size, no core dumps) and no ptrace of it by its neighbours. The process applies them to
itself (runner.sandbox) before it loads the function's code; the runner describes them
(runner.backends.python)."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import resource
import stat
import struct
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import orjson

from runner import seccomp

FUNCTION_UID = 65534
FUNCTION_GID = 65534
"""The user and group (nobody, nogroup) a function's process runs as under a runner that is root."""

SYSTEM_READABLE = ("/usr", "/lib", "/lib64", "/bin", "/etc", "/opt", "/proc", "/sys")
"""Read (and execute) everywhere below: the system's programs, libraries and configuration, and the
kernel's views of processes and devices. /proc holds no other process's environment or memory for
it: Landlock scopes ptrace, and so those files, to its own process."""
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
GPU_DEVICE_PREFIX = "nvidia"
"""/dev/nvidia*: read, written and ioctl'd by CUDA, when the host has them."""

PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000
MNT_DETACH = 2
_OPEN_TREE, _MOVE_MOUNT = 428, 429  # the same number on every architecture
_OPEN_TREE_CLONE, _AT_RECURSIVE, _AT_FDCWD, _MOVE_MOUNT_F_EMPTY_PATH = 0x1, 0x8000, -100, 0x4

_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
# Filesystem rights, by the ABI that added them.
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_ABI1 = (1 << 13) - 1  # execute .. make_sym
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FS_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
_FS_READ = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6


@dataclasses.dataclass(frozen=True, slots=True)
class Confinement:
    """Where one function's process may read and write, and its memory limit."""

    readable: tuple[str, ...]
    """Folders (and files) it may read, list and execute from."""
    writable: tuple[str, ...]
    """Folders it may also write, create and remove in (its working folder)."""
    memory_limit_bytes: int | None = None
    """RLIMIT_DATA: what it may map for data (heap, anonymous and private writable mappings)."""
    user: tuple[int, int] | None = None
    """The user and group it becomes before anything else (a root runner's FUNCTION_UID)."""
    shown: tuple[str, ...] = ()
    """Folders (of the Python it runs) that `user` cannot reach: shown to it at their own paths, in a
    mount namespace of its own, over a tmpfs that hides the rest of the folder that kept them out."""
    max_file_bytes: int | None = None
    """RLIMIT_FSIZE: the largest file it may write (the size of its working folder)."""

    def encode(self) -> str:
        return orjson.dumps(dataclasses.asdict(self)).decode()

    @classmethod
    def decode(cls, raw: str) -> Confinement:
        doc = orjson.loads(raw)
        user = doc.get("user")
        return cls(
            tuple(doc["readable"]),
            tuple(doc["writable"]),
            doc.get("memory_limit_bytes"),
            None if user is None else (int(user[0]), int(user[1])),
            tuple(doc.get("shown", ())),
            doc.get("max_file_bytes"),
        )


def function_confinement(
    function_directory: Path,
    workdir: Path,
    code: Iterable[Path],
    memory_limit_bytes: int | None,
    linked: Iterable[str] = (),
    user: tuple[int, int] | None = None,
    max_file_bytes: int | None = None,
) -> Confinement:
    """The confinement of a function's process: it reads the system, the Python installation,
    fngate's own code (`code`: the packages it imports), its function's folder and the files its
    links lead to (`linked`: link_targets, relative to that folder), and writes only its working
    folder; under `user`, with what of the Python and the code that user cannot reach shown to it."""
    readable = [
        *SYSTEM_READABLE,
        *sorted(python_paths()),
        *(str(path) for path in code),
        str(function_directory),
    ]
    readable += [str(function_directory / target) for target in linked]  # each file alone
    shown = tuple(hidden([*python_paths(), *code])) if user is not None else ()
    return Confinement(tuple(readable), (str(workdir),), memory_limit_bytes, user, shown, max_file_bytes)


def python_paths() -> set[str]:
    """The folders of the Python installation this process runs (and its virtual environment)."""
    python = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    python |= {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    return python | {str(Path(sys.executable).resolve().parent)}


def hidden(paths: Iterable[str | Path]) -> list[str]:
    """Of `paths` (their real paths), those that another, unprivileged user cannot reach from /,
    none inside another."""
    found = sorted({str(Path(path).resolve()) for path in paths if not searchable_by_others(Path(path))})
    return [
        path
        for path in found
        if not any(Path(path).is_relative_to(other) for other in found if other != path)
    ]


def unshowable(paths: Iterable[str]) -> list[str]:
    """Of the folders to show (`hidden`), those another user could not read even shown: not
    readable and searchable by others themselves."""
    return [path for path in paths if (os.stat(path).st_mode & 0o005) != 0o005]


def make_undumpable() -> None:
    """Nobody but root may read this process's memory or environment (/proc/PID/mem, environ) or
    ptrace it, even processes of its own user (a function's process under a plain-user runner)."""
    _prctl(PR_SET_DUMPABLE, 0)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (or it is disabled)."""
    try:
        libc = _libc()
    except OSError:
        return 0
    version = ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION)
    abi = libc.syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0), version)
    return max(0, int(abi))


def seccomp_available() -> bool:
    return seccomp.available()


def confine(confinement: Confinement) -> list[str]:
    """Apply `confinement` to this process, for good (nothing here can be undone by it): the
    mechanisms now in force, in words. Raises OSError when one the kernel offers fails, and when
    the process would run as uid 0."""
    applied = []
    if confinement.shown:
        show(confinement.shown)
        applied.append("its Python shown in a mount namespace of its own")
    if confinement.user is not None:
        become(*confinement.user)
    if os.geteuid() == 0 or os.getuid() == 0:
        raise OSError(errno.EPERM, "a function's process never runs as uid 0")
    applied.append("no ptrace by neighbours")
    make_undumpable()  # after the user changed, which sets it again
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    limit = confinement.memory_limit_bytes
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        applied.append(f"RLIMIT_DATA {limit // 2**20} MiB")
    if confinement.max_file_bytes is not None:
        size = confinement.max_file_bytes
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        applied.append(f"RLIMIT_FSIZE {size // 2**20} MiB")
    set_no_new_privs()  # what both below need of an unprivileged process
    abi = landlock_abi()
    if abi:
        restrict_files(abi, confinement)
        applied.append(f"landlock v{abi}")
    if seccomp_available():
        install_seccomp_filter()
        applied.append("seccomp")
    return applied


def show(paths: Iterable[str]) -> None:
    """Give this process (root) a mount namespace of its own where every folder of `paths` is
    reachable by any user at its own path: each folder that hides one (the topmost folder above it
    that others cannot search, /root for a pyenv) is covered by a small tmpfs, searchable by
    everyone, that holds only those paths, bound from the originals. The host's mounts do not
    change (the namespace's are private)."""
    libc = _libc()
    if libc.unshare(ctypes.c_int(CLONE_NEWNS)) != 0:
        _raise("unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    trees: list[tuple[str, bool, int]] = []
    try:
        for path in paths:
            flags = _OPEN_TREE_CLONE | _AT_RECURSIVE | os.O_CLOEXEC
            tree = libc.syscall(
                ctypes.c_long(_OPEN_TREE), ctypes.c_int(_AT_FDCWD), path.encode(), ctypes.c_uint(flags)
            )
            if tree < 0:
                _raise(f"open_tree {path}")
            trees.append((path, os.path.isdir(path), int(tree)))
        for folder in sorted({_hiding(Path(path)) for path, _, _ in trees}):
            mount("fngate-shown", folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for path, is_folder, tree in trees:
            if is_folder:
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                Path(path).touch(0o644)
            moved = libc.syscall(
                ctypes.c_long(_MOVE_MOUNT),
                ctypes.c_int(tree),
                b"",
                ctypes.c_int(_AT_FDCWD),
                path.encode(),
                ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH),
            )
            if moved < 0:
                _raise(f"move_mount {path}")
    finally:
        for _path, _is_folder, tree in trees:
            os.close(tree)


def _hiding(path: Path) -> str:
    """The topmost folder above `path` that others cannot search."""
    for folder in reversed(path.parents):
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return str(folder)
    raise OSError(errno.EINVAL, f"nothing hides {path}")


def become(uid: int, gid: int) -> None:
    """Become `uid`:`gid` with no other groups, for good (every capability goes with uid 0)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def mount(source: str | None, target: str, kind: str | None, flags: int, data: str | None = None) -> None:
    """mount(2); raises OSError."""
    encoded = [None if value is None else value.encode() for value in (source, target, kind, data)]
    if _libc().mount(encoded[0], encoded[1], encoded[2], ctypes.c_ulong(flags), encoded[3]) != 0:
        _raise(f"mount {kind or ''} {target}")


def unmount(target: str) -> None:
    """Detach the mount at `target` (it goes once nothing uses it); raises OSError."""
    if _libc().umount2(target.encode(), ctypes.c_int(MNT_DETACH)) != 0:
        _raise(f"umount {target}")


def set_no_new_privs() -> None:
    """Nothing this process executes gains privileges (setuid bits, file capabilities)."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def function_user() -> tuple[int, int] | None:
    """The user and group a function's process becomes: FUNCTION_UID under a root runner (what of
    the runner's Python that user cannot reach is shown to it: `hidden`); None under any other
    user (the process stays the runner's user)."""
    return (FUNCTION_UID, FUNCTION_GID) if os.geteuid() == 0 else None


def link_targets(folder: Path) -> list[str]:
    """The files that links in `folder` lead to outside it (a version's folder in the artifact
    cache links to the cache's blobs), as paths relative to `folder`: reached from the folder as
    the function's process sees it (perhaps through a descriptor), and readable one by one, so
    that the rest of the cache stays out of its reach."""
    real = folder.resolve()
    targets: set[str] = set()
    for path in folder.rglob("*"):
        if not path.is_symlink():
            continue
        target = path.resolve()
        if not target.is_relative_to(real) and target.is_file():
            targets.add(os.path.relpath(target, real))
    return sorted(targets)


def searchable_by_others(path: Path) -> bool:
    """Whether a process of another, unprivileged user can reach `path`: every folder above it
    searchable by others (and it exists)."""
    try:
        real = path.resolve(strict=True)
    except OSError:
        return False
    for folder in real.parents:
        try:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True


def restrict_files(abi: int, confinement: Confinement) -> None:
    handled_fs = _FS_ABI1
    if abi >= 2:
        handled_fs |= _FS_REFER
    if abi >= 3:
        handled_fs |= _FS_TRUNCATE
    if abi >= 5:
        handled_fs |= _FS_IOCTL_DEV
    fields = [handled_fs]
    if abi >= 4:
        fields.append(_NET_BIND_TCP | _NET_CONNECT_TCP)  # handled, never allowed: no TCP at all
    if abi >= 6:
        fields.append(_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL)
    attr = ctypes.create_string_buffer(struct.pack(f"<{len(fields)}Q", *fields), 8 * len(fields))
    libc = _libc()
    ruleset = libc.syscall(
        ctypes.c_long(_LANDLOCK_CREATE_RULESET), attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)
    )
    if ruleset < 0:
        _raise("landlock_create_ruleset")
    try:
        for path in confinement.readable:
            _allow(libc, ruleset, path, _FS_READ & handled_fs)
        for path in confinement.writable:
            _allow(libc, ruleset, path, handled_fs)
        device_rights = (_FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV) & handled_fs
        for path in [*DEVICES, *_gpu_devices()]:
            _allow(libc, ruleset, path, device_rights)
        restrict = ctypes.c_long(_LANDLOCK_RESTRICT_SELF)
        if libc.syscall(restrict, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            _raise("landlock_restrict_self")
    finally:
        os.close(ruleset)


def _allow(libc: ctypes.CDLL, ruleset: int, path: str, access: int) -> None:
    """A rule for `path` and everything below it; a path that is not there is skipped."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= _FS_FILE_RIGHTS
        rule = ctypes.create_string_buffer(struct.pack("<Qi", access, fd), 12)
        kind = ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH)
        if (
            libc.syscall(
                ctypes.c_long(_LANDLOCK_ADD_RULE), ctypes.c_int(ruleset), kind, rule, ctypes.c_uint32(0)
            )
            < 0
        ):
            _raise(f"landlock_add_rule {path}")
    finally:
        os.close(fd)


def _gpu_devices() -> list[str]:
    try:
        return [f"/dev/{name}" for name in os.listdir("/dev") if name.startswith(GPU_DEVICE_PREFIX)]
    except OSError:
        return []


def install_seccomp_filter() -> None:
    seccomp.install(_prctl)


def _prctl(option: int, *args: int) -> None:
    values = [ctypes.c_ulong(value) for value in (*args, 0, 0, 0, 0)[:4]]
    if _libc().prctl(ctypes.c_int(option), *values) != 0:
        _raise(f"prctl({option})")


_LIBC: list[ctypes.CDLL] = []


def _libc() -> ctypes.CDLL:
    if not _LIBC:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        _LIBC.append(libc)
    return _LIBC[0]


def _raise(what: str) -> None:
    number = ctypes.get_errno()
    raise OSError(number, f"{what}: {os.strerror(number)}")
