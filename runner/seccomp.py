"""The seccomp filter of a function's process: the system calls it refuses (with EPERM), those it
refuses for some arguments only, and a kill for a system call of another ABI (x32, i386), which
would bypass the numbers checked. Installed by runner.confinement."""

from __future__ import annotations

import ctypes
import dataclasses
import platform
import struct
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Arch:
    """An architecture's audit id and the numbers of the system calls the filter checks."""

    audit: int
    refused: dict[str, int]
    """Refused whatever their arguments."""
    clone: int
    clone3: int
    socketpair: int
    sendto: int


ARCHES = {
    "x86_64": Arch(
        0xC000003E,
        {
            "socket": 41,
            "connect": 42,
            "bind": 49,
            "ptrace": 101,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "unshare": 272,
            "setns": 308,
        },
        clone=56,
        clone3=435,
        socketpair=53,
        sendto=44,
    ),
    "aarch64": Arch(
        0xC00000B7,
        {
            "socket": 198,
            "connect": 203,
            "bind": 200,
            "ptrace": 117,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "unshare": 97,
            "setns": 268,
        },
        clone=220,
        clone3=435,
        socketpair=199,
        sendto=206,
    ),
}
NAMESPACE_FLAGS = 0x7E020000
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: clone() with any is refused."""
SOCK_TYPE_MASK, SOCK_STREAM = 0xF, 1

_X32_SYSCALL_BIT = 0x40000000
_LD_W_ABS, _ALU_AND_K, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x54, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM, _ENOSYS = 1, 38
_NR, _ARCH = 0, 4


def _arg(index: int, high: bool = False) -> int:
    """The offset in seccomp_data of an argument's low (or high) 32 bits (little-endian)."""
    return 16 + 8 * index + (4 if high else 0)


def available() -> bool:
    return platform.machine() in ARCHES


def program(machine: str | None = None) -> bytes:
    """The filter, as the kernel takes it (struct sock_filter, 8 bytes an instruction):

    - socket, connect, bind (nothing of its own to connect: no socket of its own, and socketpair's
      are connected), ptrace, process_vm_readv/writev, the io_uring calls (which would reach sockets
      past the filter), add_key, request_key, keyctl (no keyring: root's user keyring is the host's),
      unshare and setns: EPERM;
    - clone with a namespace flag: EPERM; clone3, whose flags sit in memory the filter cannot read:
      ENOSYS, so that the C library falls back to clone;
    - socketpair of any type but SOCK_STREAM (a datagram socket's sendto names a path: any
      datagram socket of the host's), and sendto with an address: EPERM;
    - a system call of another ABI: the process is killed;
    - everything else: allowed."""
    arch = ARCHES[machine or platform.machine()]
    code: list[tuple[int, int | str, int | str, int]] = []
    labels: dict[str, int] = {}

    def emit(op: int, k: int, jt: int | str = 0, jf: int | str = 0) -> None:
        code.append((op, jt, jf, k))

    emit(_LD_W_ABS, _ARCH)
    emit(_JEQ_K, arch.audit, 0, "kill")
    emit(_LD_W_ABS, _NR)
    if (machine or platform.machine()) == "x86_64":
        emit(_JGE_K, _X32_SYSCALL_BIT, "kill", 0)
    for number in arch.refused.values():
        emit(_JEQ_K, number, "eperm", 0)
    emit(_JEQ_K, arch.clone3, "enosys", 0)
    emit(_JEQ_K, arch.clone, "clone", 0)
    emit(_JEQ_K, arch.socketpair, "socketpair", 0)
    emit(_JEQ_K, arch.sendto, "sendto", 0)
    emit(_RET_K, _RET_ALLOW)
    labels["clone"] = len(code)
    emit(_LD_W_ABS, _arg(0))
    emit(_JSET_K, NAMESPACE_FLAGS, "eperm", "allow")
    labels["socketpair"] = len(code)
    emit(_LD_W_ABS, _arg(1))
    emit(_ALU_AND_K, SOCK_TYPE_MASK)
    emit(_JEQ_K, SOCK_STREAM, "allow", "eperm")
    labels["sendto"] = len(code)
    emit(_LD_W_ABS, _arg(4))
    emit(_JEQ_K, 0, 0, "eperm")
    emit(_LD_W_ABS, _arg(4, high=True))
    emit(_JEQ_K, 0, "allow", "eperm")
    for name, action in (
        ("allow", _RET_ALLOW),
        ("eperm", _RET_ERRNO | _EPERM),
        ("enosys", _RET_ERRNO | _ENOSYS),
        ("kill", _RET_KILL_PROCESS),
    ):
        labels[name] = len(code)
        emit(_RET_K, action)

    def offset(at: int, target: int | str) -> int:
        if isinstance(target, int):
            return target
        jump = labels[target] - at - 1
        assert 0 <= jump < 256, f"a jump of {jump} to {target}"
        return jump

    return b"".join(
        struct.pack("<HBBI", op, offset(at, jt), offset(at, jf), k) for at, (op, jt, jf, k) in enumerate(code)
    )


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(prctl: Callable[..., None]) -> None:
    """Install the filter on the calling thread (and the threads and processes it starts from
    now on); `prctl` raises OSError when the kernel refuses. Needs no_new_privs (or CAP_SYS_ADMIN)."""
    code = program()
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog))


PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
