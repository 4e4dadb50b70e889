"""`fngate traffic` and `fngate rollback`: unpinned invocations moved between versions already
stored, make before break (fngate.deployment.route, one sequence for both ways in), directly on
the repository and Redis, or through a gateway's deploy API with a `deploy` key."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import orjson
from redis.exceptions import RedisError

from fngate import clients
from fngate.cli.deploy import call_gateway
from fngate.deployment import previous_version, route
from fngate.errors import FunctionError, FunctionNotFound, InvalidArgument
from fngate.repository import FunctionRecord, Repository


class RolloutError(Exception):
    """The user's mistake: exit code 2."""


def parse_weights(items: Sequence[str]) -> dict[str, int]:
    """`3=90 4=10` as {"3": 90, "4": 10}; raises RolloutError naming a malformed item."""
    weights: dict[str, int] = {}
    for item in items:
        version, _, weight = item.partition("=")
        if not version.isdigit() or not weight.isdigit():
            raise RolloutError(f"{item!r} is not VERSION=WEIGHT (e.g. 3=90)")
        weights[str(int(version))] = int(weight)
    return weights


def rollback_weights(
    traffic: Mapping[str, int], stored: Sequence[str], version: str | None
) -> dict[str, int]:
    """Everything to `version`, by default the one before the newest that takes traffic now."""
    target = version or previous_version(traffic, stored)
    if target is None:
        raise RolloutError(f"no version before {max(traffic, key=int)} is stored: nothing to roll back to")
    return {target: 100}


def route_direct(
    repository: Repository,
    redis_url: str,
    name: str,
    weights: Mapping[str, int] | None,
    version: str | None,
    out: TextIO,
) -> int:
    """`weights` for `fngate traffic`; None for `fngate rollback [version]`. Raises RolloutError
    or FunctionError."""
    before = repository.get(name)
    wanted = (
        weights if weights is not None else rollback_weights(before.traffic, list(before.versions), version)
    )

    async def run() -> tuple[FunctionRecord, str]:
        async with clients.connect(redis_url, socket_connect_timeout=3) as redis:
            return await route(repository, redis, name, wanted)

    try:
        record, note = asyncio.run(run())
    except (RedisError, OSError) as exc:
        raise FunctionError(f"the registry at {redis_url} is unreachable ({exc}); nothing changed") from exc
    report(name, before.traffic, record.traffic, record.served, note, out)
    return 0


def route_through(
    gateway: str,
    api_key: str,
    name: str,
    weights: Mapping[str, int] | None,
    version: str | None,
    out: TextIO,
    err: TextIO,
) -> int:
    """The same through the deploy API: GET /v1/functions/NAME, then PUT .../traffic."""
    base = gateway.rstrip("/")
    auth = {"Authorization": f"Bearer {api_key}"}
    command = "fngate traffic" if weights is not None else "fngate rollback"
    answer = call_gateway(
        urllib.request.Request(f"{base}/v1/functions/{name}", headers=auth), 30, command, base, err
    )
    if answer is None:
        return 1
    before: dict[str, Any] = orjson.loads(answer)
    stored = [item["version"] for item in before["versions"]]
    wanted = weights if weights is not None else rollback_weights(before["traffic"], stored, version)
    request = urllib.request.Request(
        f"{base}/v1/functions/{name}/traffic",
        data=orjson.dumps({"traffic": wanted}),
        method="PUT",
        headers={**auth, "Content-Type": "application/json"},
    )
    answer = call_gateway(request, 600, command, base, err)
    if answer is None:
        return 1
    after: dict[str, Any] = orjson.loads(answer)
    report(name, before["traffic"], after["traffic"], after["served"], after.get("note", ""), out)
    return 0


def report(
    name: str,
    before: Mapping[str, int],
    after: Mapping[str, int],
    served: Sequence[str],
    note: str,
    out: TextIO,
) -> None:
    print(
        f"{name}: traffic {_split(after)} (was {_split(before)}); serving versions {', '.join(served)}",
        file=out,
    )
    if note:
        print(f"{name}: {note} before the traffic moved", file=out)


def exit_code(exc: FunctionError) -> int:
    """The user's mistake (2), or a service that failed (1)."""
    return 2 if isinstance(exc, InvalidArgument | FunctionNotFound) else 1


def _split(traffic: Mapping[str, int]) -> str:
    return ", ".join(f"version {version}: {weight}%" for version, weight in sorted(traffic.items()))
