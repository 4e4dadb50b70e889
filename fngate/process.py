"""How a component process runs its main coroutine: on uvloop where it is installed, with the
telemetry still buffered flushed at exit."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from fngate import telemetry


def run_forever(main: Coroutine[Any, Any, None]) -> None:
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(main)
        else:
            uvloop.run(main)
    finally:
        telemetry.shutdown()
