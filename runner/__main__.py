"""settings -> asyncio.run(main(settings, stopping)); SIGTERM and SIGINT set `stopping`."""

from __future__ import annotations

import asyncio
import signal
import sys

from fngate import telemetry
from fngate.config import RunnerSettings, unknown_variables
from fngate.process import run_forever
from runner.worker import main as worker_main


async def run(settings: RunnerSettings) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await worker_main(settings, stopping)


def main(settings: RunnerSettings | None = None) -> int:
    unknown = unknown_variables()
    if unknown:
        print(f"runner: unknown settings variables: {', '.join(unknown)}", file=sys.stderr)
        return 2
    settings = settings or RunnerSettings()
    telemetry.configure("runner", settings.log_level)
    run_forever(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
