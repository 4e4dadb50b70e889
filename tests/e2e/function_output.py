"""What Python functions print, as their runners log it (runner.output: one record a line, naming
the function and version): read back from the logs of runner processes (runner_process writes
tmp_path/runner-N.log) and, for runners in the test's own process, from caplog."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest


class FunctionOutput:
    def __init__(self, caplog: pytest.LogCaptureFixture, logs: Path) -> None:
        self._caplog = caplog
        self._logs = logs

    def records(self) -> list[dict[str, Any]]:
        """Every function output record so far: its fields (function, version, stream, line)."""
        found = [
            record.__dict__["fields"] for record in self._caplog.records if record.name == "runner.function"
        ]
        for log in sorted(self._logs.glob("runner-*.log")):
            for raw in log.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue
                if (
                    isinstance(record, dict)
                    and record.get("logger") == "runner.function"
                    and "line" in record
                ):
                    found.append(record)
        return found

    def lines(self, function: str | None = None) -> list[str]:
        return [
            record["line"] for record in self.records() if function is None or record["function"] == function
        ]

    def executions(self, count: int, timeout_s: float = 10) -> list[str]:
        """The x[0] of each row the probe's model executed ("executed 5"; PROBE_LOG set), once there
        are `count` of them (the lines reach the log a moment after their batch's answer)."""
        deadline = time.monotonic() + timeout_s
        while True:
            executed = [line.split()[1] for line in self.lines() if line.startswith("executed ")]
            if len(executed) >= count or time.monotonic() > deadline:
                return executed
            time.sleep(0.02)

    async def wait_for_any(self, function: str, line: str | None = None, timeout_s: float = 10) -> None:
        """Until `function` has printed something (`line`, if given)."""
        deadline = time.monotonic() + timeout_s
        while not (printed := self.lines(function)) or (line is not None and line not in printed):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{function} printed nothing (or not {line!r}) in {timeout_s} s")
            await asyncio.sleep(0.05)

    async def wait_for(self, line: str, count: int = 1, timeout_s: float = 60) -> None:
        """Until a function has printed `line` `count` times."""
        deadline = time.monotonic() + timeout_s
        while self.lines().count(line) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no function printed {line!r} {count} times in {timeout_s} s")
            await asyncio.sleep(0.05)
