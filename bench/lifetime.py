"""`python -m bench.lifetime`: what a hostile Python function can leave behind or take, through the
real python backend (runner.backends.python): a double-forked setsid daemon after its unload and
after its runner is SIGKILLed (and the next runner has started), how many processes it can fork,
how much it can write into its working folder, what its uid-0 tries reach, and the runner's peak
memory when its process answers 1 GiB. Opt-in: not in `python -m bench`; docs/isolation.md quotes
a run."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from fngate.manifest import parse_manifest
from runner.backends.python import PythonBackend

MODEL = r'''
import ctypes, json, os, signal, socket, sys, time
import numpy as np

KEYCTL = {"x86_64": 250, "aarch64": 219}
UNSHARE = {"x86_64": 272, "aarch64": 97}
CLONE_NEWUSER = 0x10000000


def attempt(action):
    try:
        return f"done: {action()!r}"[:120]
    except Exception as exc:
        return f"refused: {type(exc).__name__}: {exc}"[:160]


def syscall(number, *args):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args]) < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return 0


def in_a_child(action):
    """`action` in a forked child (single-threaded, as unshare of a user namespace needs)."""
    child = os.fork()
    if child == 0:
        try:
            action()
        except OSError as exc:
            os._exit(exc.errno or 1)
        os._exit(0)
    status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if status:
        raise OSError(status, os.strerror(status))
    return 0


def datagram(path):
    one, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with one, other:
        return one.sendto(b"from a function", path)


class Model:
    def __init__(self, directory):
        pass

    def infer(self, inputs):
        x = inputs["x"]
        what, size = int(x[0, 0]), int(x[0, 1])
        machine = os.uname().machine
        if what == 1:  # a double-forked setsid daemon: its pid
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
            return {"y": np.full((1, 1), int(os.read(read, 32)), dtype=np.int64)}
        if what == 2:  # fork until refused (at most `size`): how many
            forked = 0
            try:
                while forked < size:
                    if os.fork() == 0:
                        signal.pause()
                        os._exit(0)
                    forked += 1
            except OSError:
                pass
            return {"y": np.full((1, 1), forked, dtype=np.int64)}
        if what == 3:  # write `size` MiB into the working folder: how many bytes it could
            written = 0
            chunk = b"x" * 2**20
            try:
                with open("filler", "wb") as out:
                    while written < size * 2**20:
                        written += out.write(chunk)
                        out.flush()
            except OSError:
                pass
            os.unlink("filler")
            return {"y": np.full((1, 1), written, dtype=np.int64)}
        if what == 4:  # what uid 0 (or its user) reaches
            target = os.environ["LIFETIME_SOCKET"]
            tried = {
                "read /etc/shadow": attempt(lambda: open("/etc/shadow", "rb").read(16)),
                "keyctl (join a session keyring)": attempt(lambda: syscall(KEYCTL[machine], 1, 0)),
                "unshare a user namespace": attempt(
                    lambda: in_a_child(lambda: syscall(UNSHARE[machine], CLONE_NEWUSER))
                ),
                "datagram to a host socket": attempt(lambda: datagram(target)),
            }
            return {"y": np.array([[json.dumps(tried)]], dtype=object)}
        if what == 5:  # answer `size` MiB
            return {"y": np.ones((1, size * 2**20), dtype=np.uint8)}
        return {"y": np.zeros((1, 1), dtype=np.int64)}
'''


def _backend(folder: Path, datatype: str = "INT64", **model: Any) -> PythonBackend:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL)
    manifest = parse_manifest(
        {
            "name": "lifetime",
            "model": {"backend": "python", "path": "model.py", "execution_timeout_ms": 60_000, **model},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
            "outputs": [{"name": "y", "datatype": datatype, "shape": [-1, -1]}],
        },
        "lifetime.yaml",
    )
    return PythonBackend(manifest, folder)


def _ask(backend: PythonBackend, what: int, size: int = 0) -> Any:
    outputs = backend.run({"x": np.array([[what, size]], dtype=np.float32)}, ["y"], [1])
    return outputs["y"][0, 0]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def _processes_of(name: str) -> list[int]:
    """Live processes whose command line is a function process's of `name` (forks share it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"runner.sandbox --function " + name.encode() + b" " in cmdline and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _start_runner_side() -> None:
    """What the runner does at its start, where this version of it has that step."""
    try:
        from runner.backends.python import prepare
    except ImportError:
        return
    prepare()


def daemon_after_unload(folder: Path) -> str:
    backend = _backend(folder / "unload")
    daemon = int(_ask(backend, 1))
    backend.close()
    gone = _wait_gone(daemon, 10)
    if not gone:
        os.kill(daemon, signal.SIGKILL)
    return "gone" if gone else "survives (10 s after the unload)"


def daemon_after_runner_kill(folder: Path) -> str:
    holder = subprocess.Popen(
        [sys.executable, "-m", "bench.lifetime", "--hold", str(folder / "killed")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    daemon = int(holder.stdout.readline())
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    survived = not _wait_gone(daemon, 3)
    _start_runner_side()
    gone = _wait_gone(daemon, 10)
    if not gone:
        os.kill(daemon, signal.SIGKILL)
    if gone:
        return "gone at the next runner's start" if survived else "gone with its runner"
    return "survives its runner's SIGKILL and the next runner's start"


def fork_count(folder: Path, tries: int) -> str:
    backend = (
        _backend(folder / "forks", pids_limit=64) if _knows("pids_limit") else _backend(folder / "forks")
    )
    try:
        forked = int(_ask(backend, 2, tries))
    except Exception as exc:
        forked = -1
        print(f"  (fork batch failed: {exc})", file=sys.stderr)
    backend.close()
    time.sleep(1)
    left = _processes_of("lifetime")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return f"{forked} of {tries} forks; {len(left)} of its processes alive 1 s after the unload"


def folder_write(folder: Path, mib: int) -> str:
    if _knows("working_folder_limit_mb"):
        backend = _backend(folder / "write", working_folder_limit_mb=64)
    else:
        backend = _backend(folder / "write")
    started = time.perf_counter()
    written = int(_ask(backend, 3, mib))
    took = time.perf_counter() - started
    backend.close()
    return f"{written / 2**20:.0f} MiB of {mib} MiB written in {took:.1f} s"


def reach(folder: Path) -> dict[str, str]:
    place = Path(tempfile.mkdtemp(prefix="fngate-lifetime-"))
    place.chmod(0o755)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = place / "host.sock"
    listener.bind(str(path))
    path.chmod(0o777)
    os.environ["LIFETIME_SOCKET"] = str(path)
    backend = _backend(folder / "reach", datatype="BYTES")
    try:
        report: dict[str, str] = json.loads(_ask(backend, 4))
    finally:
        backend.close()
    listener.setblocking(False)
    try:
        report["the host socket received"] = repr(listener.recv(64))
    except BlockingIOError:
        report["the host socket received"] = "nothing"
    listener.close()
    path.unlink()
    place.rmdir()
    return report


def big_answer(folder: Path, mib: int) -> str:
    """In a fresh process: the runner's peak RSS (VmHWM) over one batch whose process answers `mib` MiB."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.lifetime", "--answer", str(folder / "answer"), str(mib)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def _answer(folder: Path, mib: int) -> None:
    backend = _backend(folder, datatype="UINT8")
    before = _peak_rss_bytes()
    started = time.perf_counter()
    try:
        _ask(backend, 5, mib)
        outcome = "answered"
    except Exception as exc:
        outcome = f"refused: {exc}"
    took = time.perf_counter() - started
    after = _peak_rss_bytes()
    backend.close()
    print(
        f"peak RSS {before / 2**20:.0f} MiB before, {after / 2**20:.0f} MiB after ({took:.1f} s); {outcome}"
    )


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _knows(field: str) -> bool:
    from fngate.manifest import ModelSpec

    return field in ModelSpec.model_fields


def _hold(folder: Path) -> None:
    backend = _backend(folder)
    print(int(_ask(backend, 1)), flush=True)
    time.sleep(3600)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lifetime", description=__doc__)
    parser.add_argument("--forks", type=int, default=1000)
    parser.add_argument("--write-mib", type=int, default=2048)
    parser.add_argument("--answer-mib", type=int, default=1024)
    parser.add_argument("--hold", help=argparse.SUPPRESS)
    parser.add_argument("--answer", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold:
        _hold(Path(args.hold))
        return 0
    if args.answer:
        _answer(Path(args.answer[0]), int(args.answer[1]))
        return 0
    folder = Path(tempfile.mkdtemp(prefix="fngate-bench-lifetime-"))
    folder.chmod(0o755)
    print(f"as uid {os.geteuid()}")
    try:
        print(f"  setsid daemon, after its unload:          {daemon_after_unload(folder)}")
        print(f"  setsid daemon, after its runner's SIGKILL: {daemon_after_runner_kill(folder)}")
        print(f"  forks:                                    {fork_count(folder, args.forks)}")
        print(f"  working folder:                           {folder_write(folder, args.write_mib)}")
        for what, outcome in reach(folder).items():
            print(f"  {what + ':':<42}{outcome}")
        print(f"  a {args.answer_mib} MiB answer: runner {big_answer(folder, args.answer_mib)}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
