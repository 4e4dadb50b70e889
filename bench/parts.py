"""A wheel too big for one call to the GPU machine, in parts of one call each: cut, checked as they
come, put together and checked again (scripts/gpu_check.py pack and device). Standard library only:
it runs before anything is installed."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


def split(wheel: Path, folder: Path, first_bytes: int, part_bytes: int) -> dict[str, Any]:
    """Cut `wheel` into parts in `folder`: the first of at most `first_bytes` (it travels beside
    the other wheels), the rest of at most `part_bytes`; returns the record reassembly checks."""
    parts: list[dict[str, Any]] = []
    with wheel.open("rb") as source:
        limit = first_bytes
        while chunk := source.read(limit):
            part = folder / f"part-{len(parts) + 1}"
            part.write_bytes(chunk)
            parts.append(
                {"name": part.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()}
            )
            limit = part_bytes
    return {"wheel": wheel.name, "bytes": wheel.stat().st_size, "sha256": sha256(wheel), "parts": parts}


def received(folder: Path, record: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the parts here, whole and unchanged; those still to come)."""
    here: list[str] = []
    missing: list[str] = []
    for part in record["parts"]:
        path = folder / part["name"]
        whole = path.is_file() and path.stat().st_size == part["bytes"] and sha256(path) == part["sha256"]
        (here if whole else missing).append(part["name"])
    return here, missing


def reassemble(folder: Path, record: dict[str, Any], target: Path) -> Path:
    """The wheel put together from its parts into `target`, checked against its sha256."""
    wheel: Path = target / str(record["wheel"])
    with wheel.open("wb") as sink:
        for part in record["parts"]:
            with (folder / part["name"]).open("rb") as source:
                shutil.copyfileobj(source, sink, 2**22)
    found = sha256(wheel)
    if found != record["sha256"]:
        wheel.unlink()
        raise ValueError(f"{record['wheel']} put together is {found}, not {record['sha256']}")
    return wheel


def calls(record: dict[str, Any] | None, has_wheels: bool, has_redis: bool) -> list[list[str]]:
    """The `carry` of each call in order: the first carries fngate's wheels and redis-server and
    runs the serving path at once; each later call one part alone (no part is named by two calls,
    so the machine keeps each), the last of them running what needs the whole wheel."""
    first = [".gpu/parts.json"] if record else []
    first += [".gpu/wheels"] if has_wheels else []
    first += [".gpu/redis"] if has_redis else []
    parts = [f".gpu/{part['name']}" for part in record["parts"]] if record else []
    return [first, *([".gpu/parts.json", part] for part in parts)]


def lost(record: dict[str, Any], here: Sequence[str], wheels_here: int) -> bool:
    """Whether something an earlier call carried is missing: a part before one that is here (each
    call after the first carries the next part), or some of the wheels `pack` counted (the first
    call's)."""
    order = [part["name"] for part in record["parts"]]
    latest = max((order.index(name) for name in here), default=0)  # none here: call 1's
    return any(name not in here for name in order[:latest]) or wheels_here < record.get("wheels", 0)
