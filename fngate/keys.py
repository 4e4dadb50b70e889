"""Every Redis name fngate uses, built by small functions so that gateway and runner agree."""

from __future__ import annotations

PREFIX = "fngate"
RUNNER_GROUP = "runners"


def invocations(function: str) -> str:
    """The stream of pending invocations of one function, read by the runner group."""
    return f"{PREFIX}:q:{function}"


def dead_letters(function: str) -> str:
    """Invocations that failed too many deliveries, kept for inspection."""
    return f"{PREFIX}:dlq:{function}"


def replies(gateway_id: str) -> str:
    """The reply stream of one gateway process."""
    return f"{PREFIX}:r:{gateway_id}"
