"""Process-wide telemetry set-up: logging now; traces and metrics hang off the same call."""

from __future__ import annotations

import logging
import sys


def configure(service: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service}[%(process)d] %(name)s: %(message)s",
    )
