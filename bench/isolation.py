"""`python -m bench.isolation`: what each Linux mechanism that confines a Python function's process
(runner.confinement) adds to the process's start, measured one at a time in fresh processes, and
the start of a confined process as the runner makes it (spawn to ready). Opt-in: not in
`python -m bench`; docs/isolation.md quotes a run.

Mechanisms: the runner made non-dumpable (PR_SET_DUMPABLE), an unprivileged user for the process
(setuid at spawn, and the process becoming FUNCTION_UID itself, as the sandbox does; root only),
the runner's Python shown in a mount namespace of the process's own (root only), a network
namespace (unshare(CLONE_NEWNET), through ctypes as Python 3.11 has no os.unshare; root only), the
seccomp filter, the Landlock ruleset, RLIMIT_DATA, a working folder's tmpfs, and a function
process's cgroups, made, joined, killed and removed (root only)."""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from runner import confinement
from runner.backends.python import CODE, PythonBackend
from runner.cgroup import FunctionCgroup
from runner.workdir import WorkingFolder

CLONE_NEWNET = 0x40000000
MODEL = """class Model:
    def __init__(self, directory):
        pass

    def infer(self, inputs):
        return inputs
"""


def _probe(mechanism: str) -> float:
    """In a fresh process (this one, started for the purpose): µs that `mechanism` takes."""
    import runner.sandbox  # noqa: F401  # what the function's process has imported by then

    folder = Path(tempfile.mkdtemp())
    plan = confinement.function_confinement(folder, folder, CODE, None)
    if mechanism == "libc":
        started = time.perf_counter()
        ctypes.CDLL(None, use_errno=True)
        return (time.perf_counter() - started) * 1e6
    steps: dict[str, Callable[[], object]] = {
        "PR_SET_DUMPABLE": confinement.make_undumpable,
        "RLIMIT_DATA": lambda: resource.setrlimit(resource.RLIMIT_DATA, (2**33, 2**33)),
        "landlock": lambda: confinement.restrict_files(confinement.landlock_abi(), plan),
        "seccomp": confinement.install_seccomp_filter,
        "network namespace": _unshare_network,
        "Python shown in a mount namespace": _show_python,
        "become FUNCTION_UID": lambda: confinement.become(confinement.FUNCTION_UID, confinement.FUNCTION_GID),
    }
    confinement.landlock_abi()  # libc loaded (once per process, for all of them), not timed here
    if mechanism in ("landlock", "seccomp"):
        confinement.set_no_new_privs()
    started = time.perf_counter()
    steps[mechanism]()
    return (time.perf_counter() - started) * 1e6


def _show_python() -> None:
    """What the sandbox does when FUNCTION_UID cannot reach the Python (a pyenv in /root); where it
    can, nothing is shown and this costs the unshare and the remount alone."""
    confinement.show(confinement.hidden([*confinement.python_paths(), *CODE]))


def _unshare_network() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")


def _in_fresh_processes(mechanism: str, runs: int) -> float:
    """The median µs of `mechanism` over `runs` fresh processes."""
    timings = []
    for _ in range(runs):
        probe = [sys.executable, "-m", "bench.isolation", "--probe", mechanism]
        out = subprocess.run(probe, check=False, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{mechanism}: {out.stderr.strip()[-300:]}")
        timings.append(float(out.stdout))
    return statistics.median(timings)


def _spawn_us(runs: int, **identity: object) -> float:
    """The median µs of starting /bin/true and reaping it (as another user, with `identity`)."""
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(["/bin/true"], check=True, **identity)  # type: ignore[call-overload]
        timings.append((time.perf_counter() - started) * 1e6)
    return statistics.median(timings)


def _network_namespace_exit_us(runs: int) -> float:
    """What a process's own network namespace adds to its whole life (made, then torn down when it
    exits): `unshare -n /bin/true` against `/bin/true` through the same binary."""
    with_namespace = _spawn_us_of(["unshare", "-n", "/bin/true"], runs)
    without = _spawn_us_of(["unshare", "/bin/true"], runs)
    return with_namespace - without


def _spawn_us_of(command: list[str], runs: int) -> float:
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(command, check=True)
        timings.append((time.perf_counter() - started) * 1e6)
    return statistics.median(timings)


def _cgroup_us(runs: int) -> float | None:
    timings = []
    for _ in range(runs):
        process = subprocess.Popen(["sleep", "60"])
        started = time.perf_counter()
        cgroup = FunctionCgroup.create("bench", 2**30, 1024)
        if cgroup is None:
            process.kill()
            process.wait()
            return None
        cgroup.add(process.pid)
        cgroup.remove()  # the process killed with it
        timings.append((time.perf_counter() - started) * 1e6)
        process.wait()
    return statistics.median(timings)


def _tmpfs_us(runs: int) -> float:
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        folder = WorkingFolder.make("bench", 2**26, (confinement.FUNCTION_UID, confinement.FUNCTION_GID))
        folder.remove()
        timings.append((time.perf_counter() - started) * 1e6)
    return statistics.median(timings)


def _backend_start_ms(runs: int) -> float:
    from fngate.manifest import parse_manifest

    folder = Path(tempfile.mkdtemp())
    folder.chmod(0o755)  # its process's user (FUNCTION_UID under root) reads it
    (folder / "model.py").write_text(MODEL)
    manifest = parse_manifest(
        {
            "name": "bench",
            "model": {"backend": "python", "path": "model.py"},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        },
        "bench.yaml",
    )
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        backend = PythonBackend(manifest, folder)
        timings.append((time.perf_counter() - started) * 1000)
        backend.close()
    return statistics.median(timings)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.isolation", description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(f"{_probe(args.probe):.1f}")
        return 0
    root = os.geteuid() == 0
    rows: list[tuple[str, str]] = []
    started = time.perf_counter()
    timed = [sys.executable, "-X", "importtime", "-c", "import ctypes"]
    report = subprocess.run(timed, check=True, capture_output=True, text=True).stderr
    import_us = float(report.strip().splitlines()[-1].split("|")[1])
    rows.append(("import ctypes (the child's, once)", f"{import_us:.0f} us (cumulative, -X importtime)"))
    rows.append(("load libc through ctypes (once)", f"{_in_fresh_processes('libc', args.runs):.0f} us"))
    mechanisms = ["PR_SET_DUMPABLE", "RLIMIT_DATA", "seccomp", "landlock"]
    if root:
        mechanisms += ["network namespace", "Python shown in a mount namespace", "become FUNCTION_UID"]
    for mechanism in mechanisms:
        rows.append((mechanism, f"{_in_fresh_processes(mechanism, args.runs):.0f} us"))
    if root:
        plain = _spawn_us(args.runs)
        other = _spawn_us(
            args.runs, user=confinement.FUNCTION_UID, group=confinement.FUNCTION_GID, extra_groups=[]
        )
        rows.append(("another user (setuid at spawn)", f"{other - plain:.0f} us (spawn {plain:.0f} us)"))
        rows.append(
            ("network namespace, made and torn down", f"{_network_namespace_exit_us(args.runs):.0f} us")
        )
        rows.append(("working folder: a tmpfs mounted and unmounted", f"{_tmpfs_us(args.runs):.0f} us"))
        cgroup = _cgroup_us(args.runs)
        rows.append(
            ("cgroups (made, joined, killed, removed)", "none here" if cgroup is None else f"{cgroup:.0f} us")
        )
    rows.append(("a confined process, spawn to ready", f"{_backend_start_ms(max(3, args.runs // 4)):.0f} ms"))
    print(
        f"landlock ABI {confinement.landlock_abi()}, {'root' if root else 'uid ' + str(os.geteuid())}, "
        f"median of {args.runs} ({time.perf_counter() - started:.0f} s)"
    )
    for what, cost in rows:
        print(f"  {what:<42} {cost}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
