"""Test function: tries to outlive its process, to take more than its limits, and to reach what a
function must not. The first row's x[0] says what it does, x[1] how much:

0  answers b"ok" on every row
1  starts a double-forked setsid daemon; answers its pid
2  forks (each child waits for ever) until refused, at most x[1] times; raises, saying how far it got
3  answers x[1] bytes on each row (each row its own x[1])
4  writes x[1] MiB into its working folder; answers how much it could, and why not more (JSON)
5  tries what a function must not reach (/etc/shadow, a keyring, a user namespace, a datagram to
   the host's socket at $ESCAPEE_SOCKET); answers the outcome of each (JSON)
6  writes, past its process's own framing, an answer that declares x[1] MiB and sends them
"""

import ctypes
import json
import os
import signal
import socket
import struct
import time
from pathlib import Path

import numpy as np

KEYCTL = {"x86_64": 250, "aarch64": 219}
UNSHARE = {"x86_64": 272, "aarch64": 97}
KEYCTL_JOIN_SESSION_KEYRING = 1
CLONE_NEWUSER = 0x10000000


def attempt(action):
    try:
        result = action()
    except Exception as exc:
        return f"refused: {type(exc).__name__}: {exc}"
    return f"done: {result!r}"[:200]


def syscall(number, *args):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(number), *[ctypes.c_long(arg) for arg in args]) < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return 0


def in_a_child(action):
    """`action` in a forked child: single-threaded, as unshare of a user namespace needs."""
    child = os.fork()
    if child == 0:
        try:
            action()
        except OSError as exc:
            os._exit(exc.errno or 1)
        os._exit(0)
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if code:
        raise OSError(code, os.strerror(code))
    return 0


def datagram(path):
    one, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with one, other:
        return one.sendto(b"from a function", path)


def rows(values, count):
    return np.array([[value] for value in values] if count is None else [[values]] * count, dtype=object)


class Model:
    def __init__(self, directory: Path) -> None:
        pass

    def infer(self, inputs):
        x = inputs["x"]
        what, size = int(x[0, 0]), int(x[0, 1])
        count = len(x)
        if what == 1:
            return {"y": rows(str(self.daemon()).encode(), count)}
        if what == 2:
            self.fork_bomb(size)
        if what == 3:
            return {"y": rows([b"x" * int(row[1]) for row in x], None)}
        if what == 4:
            return {"y": rows(json.dumps(self.fill(size)).encode(), count)}
        if what == 5:
            return {"y": rows(json.dumps(self.reach()).encode(), count)}
        if what == 6:
            self.forge(size)
        return {"y": rows(b"ok", count)}

    def daemon(self):
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(write, str(os.getpid()).encode())
                while True:
                    time.sleep(1)
            os._exit(0)
        os.waitpid(child, 0)
        return int(os.read(read, 32))

    def fork_bomb(self, most):
        forked = 0
        try:
            while forked < most:
                if os.fork() == 0:
                    signal.pause()
                    os._exit(0)
                forked += 1
        except OSError as exc:
            raise RuntimeError(f"forked {forked} processes, then: {exc}") from None
        raise RuntimeError(f"forked {forked} processes, and none was refused")

    def fill(self, mib):
        written, chunk = 0, b"x" * 2**20
        try:
            with open("filler", "wb") as out:
                while written < mib * 2**20:
                    written += out.write(chunk)
                    out.flush()
        except OSError as exc:
            return {"written": written, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            Path("filler").unlink(missing_ok=True)
        return {"written": written, "error": None}

    def reach(self):
        machine = os.uname().machine
        keyctl = KEYCTL[machine]
        return {
            "read /etc/shadow": attempt(lambda: Path("/etc/shadow").read_bytes()[:16]),
            "join a session keyring": attempt(lambda: syscall(keyctl, KEYCTL_JOIN_SESSION_KEYRING, 0)),
            "unshare a user namespace": attempt(
                lambda: in_a_child(lambda: syscall(UNSHARE[machine], CLONE_NEWUSER))
            ),
            "send a datagram to the host's socket": attempt(lambda: datagram(os.environ["ESCAPEE_SOCKET"])),
        }

    def forge(self, mib):
        header = json.dumps({"tensors": [["y", "UINT8", [1, mib * 2**20], mib * 2**20]]}).encode()
        os.write(3, struct.pack("<IQ", len(header), mib * 2**20) + header)  # fd 3: where answers go
        chunk = b"\0" * 2**20
        for _ in range(mib):
            os.write(3, chunk)
        while True:
            time.sleep(1)
