"""What a quiet machine pays for `fngate up`: each process's resident memory and CPU while nothing
is invoked, read from /proc (Linux).

    python -m bench.idle [--settle-s 20] [--window-s 30] [-- fngate up flags...]

Starts `fngate up` (auth on, as a user runs it) on free ports with a state folder of its own, waits
`--settle-s` after it is ready, then measures each process of its tree over `--window-s`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass(frozen=True)
class Sample:
    pid: int
    role: str
    rss_bytes: int
    cpu_ticks: int


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port: int = sock.getsockname()[1]
    return port


def descendants(root: int) -> list[int]:
    """`root` and every process below it, from /proc's parent links."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    return sorted(found)


def sample(pid: int) -> Sample | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        statm = Path(f"/proc/{pid}/statm").read_text().split()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return Sample(pid, role(command), int(statm[1]) * PAGE_BYTES, int(stat[11]) + int(stat[12]))


def role(command: list[bytes]) -> str:
    words = [word.decode(errors="replace") for word in command if word]
    text = " ".join(words)
    if "redis-server" in text:
        return "redis-server"
    for module in ("gateway", "runner"):
        if f"-m {module}" in text:
            return f"{module} {' '.join(words[words.index(module) + 1 :])}".strip()
    if " up" in text:
        return "fngate up"
    return text[:40]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.idle", description=__doc__)
    parser.add_argument("--settle-s", type=float, default=20.0, help="wait this long once it is ready")
    parser.add_argument("--window-s", type=float, default=30.0, help="measure CPU over this long")
    parser.add_argument("up_flags", nargs="*", help="more flags of fngate up (after --)")
    args = parser.parse_args(argv)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="fngate-idle-") as folder:
        command = [str(Path(sys.executable).with_name("fngate")), "up", "--port", str(port)]
        command += ["--metrics-port", str(_free_port()), "--grpc-port", str(_free_port())]
        command += ["--state-dir", folder, *args.up_flags]
        up = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or up.poll() is not None:
                    print("fngate up did not become ready", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            time.sleep(args.settle_s)
            first = {found.pid: found for pid in descendants(up.pid) if (found := sample(pid))}
            time.sleep(args.window_s)
            last = {found.pid: found for pid in descendants(up.pid) if (found := sample(pid))}
        finally:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=60)
    print(f"{'PID':>7}  {'RSS MB':>7}  {'CPU %':>6}  PROCESS")
    total_rss = total_cpu = 0.0
    for pid, now in sorted(last.items(), key=lambda item: -item[1].rss_bytes):
        before = first.get(pid)
        cpu = 100 * (now.cpu_ticks - before.cpu_ticks) / TICKS_PER_S / args.window_s if before else 0.0
        total_rss += now.rss_bytes
        total_cpu += cpu
        print(f"{pid:>7}  {now.rss_bytes / 1e6:>7.1f}  {cpu:>6.2f}  {now.role}")
    print(f"{'all':>7}  {total_rss / 1e6:>7.1f}  {total_cpu:>6.2f}  ({len(last)} processes, one core = 100%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
