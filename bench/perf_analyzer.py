"""perf_analyzer from its pip package, in a cache folder of its own; where the system's C library is
older than the 2.38 it was built for, beside Debian trixie's libc6 and libstdc++6, unpacked from
their .deb files (never installed) and used through their own dynamic loader.

`provide()` answers the command line that runs it, or the reason it cannot (the test skips).
`python -m bench.perf_analyzer ARGS` runs it so, for a person on such a system."""

from __future__ import annotations

import csv
import io
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGE = "perf-analyzer"
PLATFORM = "manylinux_2_38_x86_64"
DEBS = ("libc6", "libstdc++6", "libgcc-s1")
TRIXIE = """Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "fngate-tests" / "perf-analyzer"


def provide() -> tuple[list[str], str]:
    """(command prefix, '') or ([], why not)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return [], "perf_analyzer's wheel is for x86-64 Linux only"
    folder = cache_dir()
    binary = folder / "site" / "perf_analyzer" / "bin" / "perf_analyzer"
    if not binary.is_file():
        why = _pip_install(folder / "site")
        if why:
            return [], why
        binary.chmod(0o755)
    if _runs([str(binary), "--version"]):
        return [str(binary)], ""
    libs = folder / "trixie" / "usr" / "lib" / "x86_64-linux-gnu"
    loader = libs / "ld-linux-x86-64.so.2"
    if not loader.is_file():
        why = _unpack_trixie(folder)
        if why:
            return [], why
    command = [
        str(loader),
        "--library-path",
        f"{libs}:/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu",
        str(binary),
    ]
    if not _runs([*command, "--version"]):
        return [], "perf_analyzer does not start, even beside trixie's C library"
    return command, ""


def _runs(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=20, check=False).returncode == 0
    except OSError:
        return False


def _pip_install(target: Path) -> str:
    """The wheel is tagged for glibc 2.38: pip installs it here only when told the platform."""
    command = [
        sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--only-binary=:all:",
        "--platform", PLATFORM, "--target", str(target), PACKAGE,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return f"pip install {PACKAGE} took over 120 s (offline?)"
    if done.returncode != 0:
        return f"pip install {PACKAGE} failed: {done.stderr.strip().splitlines()[-1:]}"
    return ""


def _unpack_trixie(folder: Path) -> str:
    """apt-get with private lists (the system's sources stay as they are), dpkg-deb -x only."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        return "perf_analyzer needs glibc 2.38, and this system has neither it nor apt-get to fetch it"
    apt = folder / "apt"
    for sub in ("parts", "lists/partial", "cache/archives/partial", "debs"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    (apt / "parts" / "trixie.sources").write_text(TRIXIE)
    options = [
        "-o", "Dir::Etc::SourceList=/dev/null", "-o", f"Dir::Etc::SourceParts={apt / 'parts'}",
        "-o", f"Dir::State::Lists={apt / 'lists'}", "-o", f"Dir::Cache={apt / 'cache'}",
        "-o", "Dir::State::status=/dev/null", "-o", "APT::Sandbox::User=root", "-qq",
    ]  # fmt: skip
    try:
        for step in (["update"], ["download", *DEBS]):
            done = subprocess.run(
                ["apt-get", *options, *step],
                cwd=apt / "debs",
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            if done.returncode != 0:
                return f"apt-get {step[0]} from trixie failed: {done.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired:
        return "apt-get took over 120 s (offline?)"
    staging = folder / "trixie.partial"
    shutil.rmtree(staging, ignore_errors=True)
    for deb in sorted((apt / "debs").glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True, timeout=60)
    shutil.rmtree(folder / "trixie", ignore_errors=True)
    staging.rename(folder / "trixie")
    return ""


if __name__ == "__main__":
    prefix, why = provide()
    if not prefix:
        print(f"perf_analyzer: {why}", file=sys.stderr)
        sys.exit(1)
    sys.exit(subprocess.run([*prefix, *sys.argv[1:]], check=False).returncode)


def point(command: list[str], args: list[str], measure_s: float, logs: Path, name: str) -> dict[str, Any]:
    """One measured point (`args`: the model, server, protocol and load): what was answered per
    second and the client's latency percentiles (ms), or the error; its CSV and output kept in
    `logs` as `name`.csv and .txt."""
    report = logs / f"{name}.csv"
    run = [
        *command, *args,
        "--measurement-interval", str(int(measure_s * 1000)),
        # Any spread passes, but perf_analyzer still wants three windows it accepts in a row: with
        # only three tries, one window it rejected (it rejected one in 2 of 4 runs against
        # Triton at 500 req/s) lost the whole point.
        "--stability-percentage", "999", "--max-trials", "6",
        "--percentile", "99",
        "-f", str(report),
    ]  # fmt: skip
    done = subprocess.run(run, capture_output=True, text=True, timeout=300, check=False)
    (logs / f"{name}.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not report.is_file():
        return {"errors": 1, "error_sample": (done.stdout + done.stderr).strip()[-200:]}
    (line,) = list(csv.DictReader(io.StringIO(report.read_text())))
    return {
        "req_per_s": float(line["Inferences/Second"]),
        "p50_ms": float(line["p50 latency"]) / 1000,
        "p90_ms": float(line["p90 latency"]) / 1000,
        "p99_ms": float(line["p99 latency"]) / 1000,
        "errors": 0,
    }
