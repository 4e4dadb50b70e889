"""The machine's cost of waking another process: two processes pass one byte back and forth over a
Unix socket pair, pinned to one CPU, then to two. Each hop of an invocation between processes
(client, gateway, Redis, runner) is such a wake, so this is the floor under a hop on this machine.
`python -m bench.wake` prints both."""

from __future__ import annotations

import os
import socket
import time

ROUND_TRIPS = 20_000


def measure(cpus: tuple[int, int], round_trips: int = ROUND_TRIPS) -> dict[str, float]:
    """Round trips between this process on cpus[0] and a child on cpus[1], per round trip in µs:
    the wall time, and the CPU time of both processes together."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echo: plain system calls, then out without Python's exit handlers
        try:
            ours.close()
            os.sched_setaffinity(0, {cpus[1]})
            while theirs.recv(1):
                theirs.send(b"y")
        finally:
            os._exit(0)
    theirs.close()
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpus[0]})
        ours.send(b"x")  # the child is pinned and answering before the clock starts
        ours.recv(1)
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(round_trips):
            ours.send(b"x")
            ours.recv(1)
        wall_s, our_cpu_s = time.perf_counter() - started, time.process_time() - cpu
    finally:
        os.sched_setaffinity(0, before)
        ours.close()  # the child reads b"" and exits
        _, _, usage = os.wait4(pid, 0)
    child_cpu_s = usage.ru_utime + usage.ru_stime
    return {
        "round_trip_us": wall_s / round_trips * 1e6,
        "cpu_us_per_round_trip": (our_cpu_s + child_cpu_s) / round_trips * 1e6,
    }


def both() -> dict[str, dict[str, float]]:
    """On one CPU (a wake is a context switch) and across two (the sleeping CPU is woken)."""
    cpus = sorted(os.sched_getaffinity(0))
    found = {"one CPU": measure((cpus[0], cpus[0]))}
    if len(cpus) > 1:
        found["two CPUs"] = measure((cpus[0], cpus[1]))
    return found


if __name__ == "__main__":
    for where, figures in both().items():
        print(
            f"{where}: a round trip takes {figures['round_trip_us']:.1f} µs, "
            f"{figures['cpu_us_per_round_trip']:.1f} µs of CPU"
        )
