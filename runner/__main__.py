"""settings -> asyncio.run(main(settings, stopping)); SIGTERM and SIGINT set `stopping`. With
`--standby`, a runner started ahead of need: its imports done, it waits for its settings."""

from __future__ import annotations

import time

IMPORTS_STARTED = time.perf_counter()
STARTED_MS = int(time.time() * 1000)

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402

from fngate import telemetry  # noqa: E402
from fngate.config import RunnerSettings, unknown_variables  # noqa: E402
from fngate.process import run_forever, schedule  # noqa: E402
from runner.worker import main as worker_main  # noqa: E402

IMPORTS_S = time.perf_counter() - IMPORTS_STARTED


async def run(settings: RunnerSettings, started_ms: int | None = None) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await worker_main(settings, stopping, started_ms)


def await_assignment() -> int | None:
    """A standby runner's wait: one line on stdin, a JSON object of FNGATE_* variables that complete
    its environment (its pool above all), and `assigned_ms`, when the scaler handed it the pool,
    from the scaler. End of input (the scaler stopped or needs it no more): None."""
    line = sys.stdin.readline()
    if not line.strip():
        return None
    assignment = json.loads(line)
    assigned_ms = int(assignment.pop("assigned_ms", time.time() * 1000))
    os.environ.update({str(key): str(value) for key, value in assignment.items()})
    return assigned_ms


def main(settings: RunnerSettings | None = None) -> int:
    started_ms = STARTED_MS
    if sys.argv[1:] == ["--standby"]:
        if os.environ.get("FNGATE_REPO", "").startswith("s3://"):
            from fngate.s3 import S3Repository

            S3Repository.warm_up()  # the repository is the same whatever pool comes
        with contextlib.suppress(ImportError):  # the usual backend's runtime, not to import at load
            import onnxruntime  # noqa: F401
        with contextlib.suppress(Exception):  # pydantic imports more on its first read (0.13 s)
            RunnerSettings()
        assigned_ms = await_assignment()
        if assigned_ms is None:
            return 0
        # A standby starts for its pool when it is handed it (maybe before its imports are done).
        started_ms = max(STARTED_MS, assigned_ms)
    unknown = unknown_variables()
    if unknown:
        print(f"runner: unknown settings variables: {', '.join(unknown)}", file=sys.stderr)
        return 2
    settings = settings or RunnerSettings()
    telemetry.configure("runner", settings.log_level)
    schedule(settings.sched_batch)  # before its backends start threads and processes: they inherit it
    # A cold start pays for these; keep them lean (backends import their runtime only when used).
    logging.getLogger("runner").info("imports took %.3f s", IMPORTS_S)
    run_forever(run(settings, started_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
