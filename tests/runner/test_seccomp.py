"""The seccomp filter of a function's process, installed in a real process: what it refuses, and
that threads, forks and pipes (what a model's libraries use) still work under it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runner import seccomp

pytestmark = pytest.mark.skipif(not seccomp.available(), reason="no seccomp filter for this architecture")

PROBE = r"""
import ctypes, json, os, socket, sys, threading
from runner import confinement

NUMBERS = {
    "x86_64": {"keyctl": 250, "unshare": 272, "setns": 308, "clone": 56, "clone3": 435},
    "aarch64": {"keyctl": 219, "unshare": 97, "setns": 268, "clone": 220, "clone3": 435},
}
number = NUMBERS[os.uname().machine]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def errno_of(action):
    try:
        action()
    except OSError as exc:
        return exc.errno
    return 0


def call(name, *args):
    if libc.syscall(ctypes.c_long(number[name]), *[ctypes.c_long(arg) for arg in args]) < 0:
        raise OSError(ctypes.get_errno(), name)


def in_a_child(action):
    child = os.fork()
    if child == 0:
        os._exit(errno_of(action))
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])


def clone_into_a_user_namespace():
    flags = ctypes.c_long(0x10000000 | 17)  # CLONE_NEWUSER, SIGCHLD
    child = libc.syscall(ctypes.c_long(number["clone"]), flags, None, None, None, None)
    if child == 0:
        os._exit(0)
    if child < 0:
        raise OSError(ctypes.get_errno(), "clone")
    os.waitpid(child, 0)


def sendto_a_path():
    one, other = socket.socketpair()
    with one, other:
        one.sendto(b"x", "/nowhere")


confinement.set_no_new_privs()
confinement.install_seccomp_filter()
ran = []
thread = threading.Thread(target=lambda: ran.append(1))
thread.start()
thread.join()
read, write = os.pipe()
stream = socket.socketpair()
stream[0].sendall(b"through")
print(json.dumps({
    "a thread runs": ran == [1],
    "a fork runs": in_a_child(lambda: None) == 0,
    "a stream socketpair carries": stream[1].recv(16) == b"through",
    "socket": errno_of(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)),
    "datagram socketpair": errno_of(lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)),
    "sendto an address": errno_of(sendto_a_path),
    "connect a socketpair's socket": errno_of(lambda: stream[0].connect("/nowhere")),
    "bind a socketpair's socket": errno_of(lambda: stream[0].bind("/tmp/fngate-nowhere.sock")),
    "keyctl": errno_of(lambda: call("keyctl", 1, 0)),
    "unshare a user namespace": in_a_child(lambda: call("unshare", 0x10000000)),
    "setns": errno_of(lambda: call("setns", 0, 0)),
    "clone into a user namespace": errno_of(clone_into_a_user_namespace),
    "clone3 (the C library falls back to clone)": errno_of(lambda: call("clone3", 0, 0)),
}))
"""


def test_the_filter_refuses_keyrings_namespaces_and_datagrams_and_keeps_threads_and_forks() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "a thread runs": True,
        "a fork runs": True,
        "a stream socketpair carries": True,
        "socket": 1,
        "datagram socketpair": 1,
        "sendto an address": 1,
        "connect a socketpair's socket": 1,
        "bind a socketpair's socket": 1,
        "keyctl": 1,
        "unshare a user namespace": 1,
        "setns": 1,
        "clone into a user namespace": 1,
        "clone3 (the C library falls back to clone)": 38,
    }
