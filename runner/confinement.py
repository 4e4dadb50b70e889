"""What a function's process may reach, and the Linux mechanisms that hold it there: Landlock (the
files it may read and write, no TCP, no signals or abstract sockets beyond itself), a seccomp filter
(no sockets, no other process's memory, no io_uring), resource limits (its memory, no core dumps)
and no ptrace of it by its neighbours. The process applies them to itself (runner.sandbox) before it
loads the function's code; the runner describes them (runner.backends.python) and, when it runs as
root, starts the process under an unprivileged user (FUNCTION_UID)."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import resource
import stat
import struct
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import orjson

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
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SECCOMP_MODE_FILTER = 2
_SECBITS_NO_ROOT = 0xC3
"""noroot, no ambient raise, both locked: an exec never gives uid 0 its capabilities back."""
_CAPSET = {"x86_64": 126, "aarch64": 91}
_CAPABILITY_VERSION_3 = 0x20080522

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

# seccomp: the architecture's audit id and its numbers of the system calls the filter refuses
# (socket, ptrace, process_vm_readv, process_vm_writev, io_uring_setup/enter/register).
_SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, (41, 101, 310, 311, 425, 426, 427)),
    "aarch64": (0xC00000B7, (198, 117, 270, 271, 425, 426, 427)),
}
_X32_SYSCALL_BIT = 0x40000000
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_SECCOMP_RET_KILL_PROCESS, _SECCOMP_RET_ERRNO, _SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM = 1


@dataclasses.dataclass(frozen=True, slots=True)
class Confinement:
    """Where one function's process may read and write, and its memory limit."""

    readable: tuple[str, ...]
    """Folders (and files) it may read, list and execute from."""
    writable: tuple[str, ...]
    """Folders it may also write, create and remove in (its working folder)."""
    memory_limit_bytes: int | None = None
    """RLIMIT_DATA: what it may map for data (heap, anonymous and private writable mappings)."""

    def encode(self) -> str:
        return orjson.dumps(dataclasses.asdict(self)).decode()

    @classmethod
    def decode(cls, raw: str) -> Confinement:
        doc = orjson.loads(raw)
        return cls(tuple(doc["readable"]), tuple(doc["writable"]), doc.get("memory_limit_bytes"))


def function_confinement(
    function_directory: Path,
    workdir: Path,
    code: Iterable[Path],
    memory_limit_bytes: int | None,
    linked: Iterable[str] = (),
) -> Confinement:
    """The confinement of a function's process: it reads the system, the Python installation,
    fngate's own code (`code`: the packages it imports), its function's folder and the files its
    links lead to (`linked`: link_targets, relative to that folder), and writes only its working
    folder."""
    python = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    python |= {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    readable = [*SYSTEM_READABLE, *sorted(python), *(str(path) for path in code), str(function_directory)]
    readable += [str(function_directory / target) for target in linked]  # each file alone
    return Confinement(tuple(readable), (str(workdir),), memory_limit_bytes)


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
    return platform.machine() in _SECCOMP_ARCHES


def confine(confinement: Confinement) -> list[str]:
    """Apply `confinement` to this process, for good (nothing here can be undone by it): the
    mechanisms now in force, in words. Raises OSError when one the kernel offers fails."""
    applied = ["no ptrace by neighbours"]
    make_undumpable()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    limit = confinement.memory_limit_bytes
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        applied.append(f"RLIMIT_DATA {limit // 2**20} MiB")
    if os.geteuid() == 0:  # a root runner whose Python FUNCTION_UID cannot read: root, powerless
        drop_capabilities()
        applied.append("no capabilities")
    set_no_new_privs()  # what both below need of an unprivileged process
    abi = landlock_abi()
    if abi:
        restrict_files(abi, confinement)
        applied.append(f"landlock v{abi}")
    if seccomp_available():
        install_seccomp_filter()
        applied.append("seccomp")
    return applied


def set_no_new_privs() -> None:
    """Nothing this process executes gains privileges (setuid bits, file capabilities)."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def drop_capabilities() -> None:
    """Every capability gone from this process (uid 0 included) and from whatever it executes."""
    _prctl(PR_SET_SECUREBITS, _SECBITS_NO_ROOT)
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for capability in range(last + 1):
        _prctl(PR_CAPBSET_DROP, capability)
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header = ctypes.create_string_buffer(struct.pack("<Ii", _CAPABILITY_VERSION_3, 0), 8)
    data = ctypes.create_string_buffer(bytes(24), 24)  # effective, permitted, inheritable: x2, all 0
    number = _CAPSET.get(platform.machine())
    if number is None or _libc().syscall(ctypes.c_long(number), header, data) != 0:
        _raise("capset")


def function_user(paths: Iterable[Path]) -> tuple[int, int] | None:
    """The user and group a root runner starts a function's process as: FUNCTION_UID, when it can
    reach every one of `paths` (the Python installation it runs); else None (it stays uid 0 and
    drops every capability instead)."""
    if os.geteuid() != 0:
        return None
    for path in paths:
        if not searchable_by_others(path):
            return None
    return FUNCTION_UID, FUNCTION_GID


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


def seccomp_program() -> bytes:
    """The filter: refuse socket, ptrace, process_vm_readv/writev and io_uring with EPERM, allow
    everything else, and kill the process for a system call of another ABI (x32, i386), which
    would bypass the numbers checked."""
    audit_arch, refused = _SECCOMP_ARCHES[platform.machine()]
    errno_at = 3 + (platform.machine() == "x86_64") + len(refused) + 1
    kill_at = errno_at + 1
    program = [(_BPF_LD_W_ABS, 0, 0, 4)]  # seccomp_data.arch
    program.append((_BPF_JEQ_K, 0, kill_at - 2, audit_arch))
    program.append((_BPF_LD_W_ABS, 0, 0, 0))  # seccomp_data.nr
    if platform.machine() == "x86_64":
        program.append((_BPF_JGE_K, errno_at - len(program) - 1, 0, _X32_SYSCALL_BIT))
    for number in refused:
        program.append((_BPF_JEQ_K, errno_at - len(program) - 1, 0, number))
    program.append((_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW))
    program.append((_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | _EPERM))
    program.append((_BPF_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS))
    assert len(program) == kill_at + 1
    return b"".join(struct.pack("<HBBI", *instruction) for instruction in program)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_seccomp_filter() -> None:
    code = seccomp_program()
    buffer = ctypes.create_string_buffer(code, len(code))
    program = _SockFprog(len(code) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(program))


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
