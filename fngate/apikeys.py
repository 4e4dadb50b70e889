"""API keys: their format, scopes and limits, and the records in Redis that hold only their hashes.
Shared by the gateway (which reads the records), the CLI (`fngate keys`) and `fngate up`."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import redis

from fngate import clients, keys
from fngate.errors import FunctionNotFound, InvalidArgument

KEY_PREFIX = "fng"
SCOPES = ("invoke", "read", "deploy", "admin")
"""invoke[:glob]: infer and v1 invoke of matching functions (and their metadata); read: metadata,
function list, repository index; deploy: the deploy API; admin: everything, including model
load/unload and /metrics."""
_ID = re.compile(r"[0-9a-f]{12}")
_GLOB = re.compile(r"[a-z0-9*?\[\]!-]+")


@dataclasses.dataclass(frozen=True, slots=True)
class KeyRecord:
    """What Redis holds about one key. `sha256` is the hex digest of the whole key string: the key
    is random (256 bits), so a fast hash is enough; a slow one (bcrypt) guards guessable passwords."""

    id: str
    sha256: str
    scopes: tuple[str, ...]
    name: str = ""
    rps: float = 0.0
    """Sustained invocations per second across all gateways; 0: no limit."""
    burst: int = 0
    """Invocations allowed at once above the rate (the bucket's size); 0: max(1, rps)."""
    max_in_flight: int = 0
    """Invocations of this key in flight at once across all gateways; 0: no limit."""
    max_queued: int = 0
    """Invocations of one function this key may have queued or running at once: its share of the
    function's max_queue_size, so that one caller cannot fill a queue; 0: no limit."""
    created_s: float = 0.0
    compute_s_per_min: float = 0.0
    """Seconds of batch time a minute charged to it on every runner, past which its invocations
    get 429 until the minute ends; 0: no budget."""

    def encode(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> KeyRecord:
        doc: dict[str, Any] = orjson.loads(raw)
        return cls(
            id=str(doc["id"]),
            sha256=str(doc["sha256"]),
            scopes=tuple(str(scope) for scope in doc["scopes"]),
            name=str(doc.get("name", "")),
            rps=float(doc.get("rps", 0.0)),
            burst=int(doc.get("burst", 0)),
            max_in_flight=int(doc.get("max_in_flight", 0)),
            max_queued=int(doc.get("max_queued", 0)),
            created_s=float(doc.get("created_s", 0.0)),
            compute_s_per_min=float(doc.get("compute_s_per_min", 0.0)),
        )


def new_key() -> tuple[str, str]:
    """A fresh key and its id: `fng_<id>_<secret>`, the id (12 hex digits) is public, the secret
    is 32 random bytes."""
    key_id = secrets.token_hex(6)
    return f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}", key_id


def key_id(key: str) -> str | None:
    """The id part of a well-formed key, or None."""
    prefix, _, rest = key.partition("_")
    candidate = rest[:12]
    if prefix != KEY_PREFIX or rest[12:13] != "_" or not _ID.fullmatch(candidate):
        return None
    return candidate


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def check_scope(scope: str) -> str:
    """A scope as written on the command line; raises InvalidArgument naming the problem."""
    base, colon, glob = scope.partition(":")
    if base not in SCOPES:
        raise InvalidArgument(f"unknown scope {scope!r}: use one of invoke[:glob], read, deploy, admin")
    if colon and (base != "invoke" or not _GLOB.fullmatch(glob)):
        raise InvalidArgument(f"scope {scope!r}: only invoke takes a glob of function names (invoke:name*)")
    return scope


def create(
    client: redis.Redis,
    scopes: list[str],
    name: str = "",
    rps: float = 0.0,
    burst: int = 0,
    max_in_flight: int = 0,
    max_queued: int = 0,
    compute_s_per_min: float = 0.0,
) -> tuple[str, KeyRecord]:
    """Store a new key's record; returns the key (shown once, never stored) and its record."""
    if not scopes:
        raise InvalidArgument("a key needs at least one scope")
    if min(rps, burst, max_in_flight, max_queued, compute_s_per_min) < 0:
        raise InvalidArgument("limits are 0 (none) or positive")
    key, ident = new_key()
    record = KeyRecord(
        ident,
        hash_key(key).hex(),
        tuple(check_scope(scope) for scope in scopes),
        name,
        rps,
        burst,
        max_in_flight,
        max_queued,
        round(time.time(), 3),
        compute_s_per_min,
    )
    _commit(client, lambda pipe: pipe.hset(keys.api_keys(), ident, record.encode()))
    return key, record


def records(client: redis.Redis) -> list[KeyRecord]:
    raw: dict[bytes, bytes] = client.hgetall(keys.api_keys())  # type: ignore[assignment]
    return sorted((KeyRecord.decode(value) for value in raw.values()), key=lambda r: r.created_s)


def revoke(client: redis.Redis, ident: str) -> None:
    """Delete a key's record; every gateway refuses the key once it next refreshes (about 1 s)."""

    def change(pipe: Any) -> None:
        pipe.hdel(keys.api_keys(), ident)
        pipe.delete(keys.key_rate(ident), keys.key_in_flight(ident))

    removed, *_ = _commit(client, change)
    if not removed:
        raise FunctionNotFound(f"no API key with id {ident!r}")


def hashed_admins(value: str) -> list[KeyRecord]:
    """The admin keys named by `<key id>:<sha256 hex>` items, separated by commas or white space
    (GatewaySettings.admin_key_hash)."""
    found = []
    for item in value.replace(",", " ").split():
        ident, _, digest = item.partition(":")
        if not _ID.fullmatch(ident) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise InvalidArgument("an admin key hash is '<12 hex digits>:<64 hex digits>' (fngate keys hash)")
        found.append(KeyRecord(ident, digest, ("admin",), "admin_key_hash"))
    return found


def hash_line(key: str) -> str:
    """`<key id>:<sha256 hex>` of a key, for GatewaySettings.admin_key_hash."""
    ident = key_id(key.strip())
    if ident is None:
        raise InvalidArgument("that is not an fngate API key (fng_<id>_<secret>)")
    return f"{ident}:{hash_key(key.strip()).hex()}"


def admin_key(client: redis.Redis, path: Path) -> tuple[str, bool]:
    """The admin key kept in the file `path` (mode 0600), registered in Redis; a new one, written
    there, when the file does not exist. Returns the key and whether it was created now."""
    created = False
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = ""
    ident = key_id(key)
    if ident is None:
        key, ident = new_key()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(key + "\n")
        created = True
    if client.hget(keys.api_keys(), ident) is None:
        record = KeyRecord(
            ident, hash_key(key).hex(), ("admin",), "fngate up", created_s=round(time.time(), 3)
        )
        _commit(client, lambda pipe: pipe.hset(keys.api_keys(), ident, record.encode()))
    return key, created


def _commit(client: redis.Redis, change: Callable[[Any], Any]) -> list[Any]:
    """`change(pipeline)`, then the bump of the keys' version that makes every gateway reload them:
    one transaction on one Redis. On a Redis Cluster (the two are in different slots) the change
    first and the bump once it is done, so that no gateway reloads before it."""
    if clients.is_cluster_client(client):
        with client.pipeline(transaction=False) as pipe:
            change(pipe)
            done: list[Any] = pipe.execute()
        return [*done, client.incr(keys.api_keys_version())]
    with client.pipeline(transaction=True) as pipe:
        change(pipe)
        pipe.incr(keys.api_keys_version())
        answers: list[Any] = pipe.execute()
    return answers


ALL_FUNCTIONS = "_all"
"""A minute's usage field: the key's seconds over every function (what its budget is held to)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """What one key was charged for one function: batch time and, where the function's backend
    measures it (a process of its own), CPU time; over a window of minutes and ever."""

    record: KeyRecord
    function: str
    window_s: float
    total_s: float
    window_cpu_s: float | None
    total_cpu_s: float | None


def usage(client: redis.Redis, minutes: int) -> list[Usage]:
    """Per key and function: the seconds of batch time (and of CPU time) charged to it over the last
    `minutes` minutes (this one included) and ever, as runners charge them (runner.accounting)."""
    now = int(time.time() // 60)
    found = []
    for record in records(client):
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(keys.key_usage(record.id))
        pipe.hgetall(keys.key_cpu(record.id))
        for minute in range(now - minutes + 1, now + 1):
            pipe.hgetall(keys.key_usage_minute(record.id, minute))
            pipe.hgetall(keys.key_cpu_minute(record.id, minute))
        total, total_cpu, *minutely = pipe.execute()
        window, window_cpu = _summed(minutely[0::2]), _summed(minutely[1::2])
        ever_cpu = _summed([total_cpu])
        for function, seconds in sorted(total.items()):
            name = function.decode()
            cpu = ever_cpu.get(name)
            found.append(
                Usage(
                    record,
                    name,
                    window.get(name, 0.0),
                    float(seconds),
                    None if cpu is None else window_cpu.get(name, 0.0),
                    cpu,
                )
            )
    return found


def _summed(hashes: list[dict[bytes, bytes]]) -> dict[str, float]:
    """function -> its seconds over `hashes` (a minute's total over every function left out)."""
    summed: dict[str, float] = {}
    for hashed in hashes:
        for function, seconds in hashed.items():
            if function != ALL_FUNCTIONS.encode():
                summed[function.decode()] = summed.get(function.decode(), 0.0) + float(seconds)
    return summed
