"""Who may call what: the in-memory table of API keys (refreshed from Redis) and `authorize()` (pure,
a few microseconds, callable from any request path). Each front end's routes say the scope they
need (gateway.http.app, gateway.grpc.service)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import random
import re
import time
from collections.abc import Iterable
from fnmatch import translate
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import apikeys, keys
from fngate.backoff import stop_if_cancelled
from fngate.errors import PermissionDenied, Unauthenticated
from gateway.validation import shown

log = logging.getLogger(__name__)

INVOKE, READ, DEPLOY, ADMIN = apikeys.SCOPES
ANY = ""
"""Any valid key: for paths no route serves (they answer 404 only to a caller with a key)."""
BROWSE = "browse"
"""Any key that may read some function: for the routes that list only the functions a key may read."""
INVOKER = "invoker"
"""Any key that may invoke some function: for what only serves invocations (shared memory regions)."""
BEARER = "bearer "
KEY_HEAD = f"{apikeys.KEY_PREFIX}_"
ID_END = len(KEY_HEAD) + 12
MAX_BACKOFF_S = 10.0
MISSING_S = 1.0
"""A key id that Redis does not hold is not looked up again for this long."""
MAX_MISSING = 10_000


class UnknownKey(Unauthenticated):
    """A well-formed key whose id the table does not hold (yet): `KeyTable.authorize_async` looks it
    up in Redis before refusing, so that a key is usable as soon as it is created."""

    def __init__(self, message: str, key_id: str) -> None:
        super().__init__(message)
        self.key_id = key_id


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """A caller the table knows: its key's id, hash, scopes and limits."""

    key_id: str
    digest: bytes
    scopes: frozenset[str]
    invoke: re.Pattern[str] | None
    """Function names the key may invoke; None: none."""
    rps: float = 0.0
    burst: int = 0
    max_in_flight: int = 0
    max_queued: int = 0
    compute_s_per_min: float = 0.0

    @property
    def limited(self) -> bool:
        return self.rps > 0 or self.max_in_flight > 0 or self.max_queued > 0 or self.compute_s_per_min > 0

    def allows(self, scope: str, function: str | None) -> bool:
        if ADMIN in self.scopes or scope == ANY:
            return True
        if scope == BROWSE:
            return READ in self.scopes or self.invoke is not None
        if scope == INVOKER:
            return self.invoke is not None
        if scope == INVOKE or (scope == READ and READ not in self.scopes):
            return self.invoke is not None and function is not None and bool(self.invoke.match(function))
        return scope in self.scopes


def principal_of(record: apikeys.KeyRecord) -> Principal:
    plain = frozenset(scope for scope in record.scopes if ":" not in scope)
    globs = [scope.partition(":")[2] or "*" for scope in record.scopes if scope.startswith(INVOKE)]
    pattern = re.compile("|".join(f"(?:{translate(glob)})" for glob in globs)) if globs else None
    burst = record.burst or max(1, int(record.rps + 0.999))
    return Principal(
        record.id,
        bytes.fromhex(record.sha256),
        plain,
        pattern,
        record.rps,
        burst,
        record.max_in_flight,
        record.max_queued,
        record.compute_s_per_min,
    )


OPEN = Principal("", b"", frozenset({ADMIN}), None)
"""The caller when auth is off."""


class KeyTable:
    """Every key's Principal by key id, in memory. `run()` reloads it from Redis when the keys'
    version counter moves (checked every `refresh_s`), and keeps the last table through outages."""

    def __init__(
        self, refresh_s: float = 1.0, enabled: bool = True, fixed: Iterable[apikeys.KeyRecord] = ()
    ) -> None:
        self.enabled = enabled
        self.refresh_s = refresh_s
        self.healthy = True
        self._fixed = {record.id: principal_of(record) for record in fixed}
        """Keys from settings (a Kubernetes Secret), accepted whatever Redis holds."""
        self._by_id: dict[str, Principal] = dict(self._fixed)
        self._version: Any = None
        self._redis: aioredis.Redis | None = None
        self._missing: dict[str, float] = {}
        """Key ids looked up and not found, until when they are not looked up again."""

    def load(self, records: Iterable[apikeys.KeyRecord]) -> None:
        self._by_id = {**{record.id: principal_of(record) for record in records}, **self._fixed}

    def authorize(self, header: str | None, scope: str, function: str | None = None) -> Principal:
        """The caller named by an `Authorization` header value, if it may use `scope` (on
        `function`); raises Unauthenticated (no or unknown key) or PermissionDenied (scope missing)."""
        if not self.enabled:
            return OPEN
        header = header.lstrip() if header else header  # gRPC metadata keeps the space after `name:`
        if not header or header[:7].lower() != BEARER:
            raise Unauthenticated("this endpoint needs an API key: send 'Authorization: Bearer <key>'")
        key = header[7:].strip()
        principal = self._by_id.get(key[len(KEY_HEAD) : ID_END]) if key.startswith(KEY_HEAD) else None
        if principal is None and apikeys.key_id(key) is not None:
            raise UnknownKey("the API key is not valid (unknown or revoked)", key[len(KEY_HEAD) : ID_END])
        # The digest of a random 256-bit key is compared in constant time all the same.
        if principal is None or not hmac.compare_digest(
            hashlib.sha256(key.encode()).digest(), principal.digest
        ):
            raise Unauthenticated("the API key is not valid (unknown or revoked)")
        if not principal.allows(scope, function):
            wanted = f"{scope}:{shown(function)}" if scope == INVOKE and function else scope
            if scope == INVOKER:
                wanted = f"{INVOKE} (of some function)"
            raise PermissionDenied(f"the API key {principal.key_id} lacks the scope {wanted}")
        return principal

    async def authorize_async(self, header: str | None, scope: str, function: str | None = None) -> Principal:
        """`authorize`, after looking up in Redis a key the table does not hold yet (created since
        its last refresh)."""
        try:
            return self.authorize(header, scope, function)
        except UnknownKey as exc:
            if not await self.look_up(exc.key_id):
                raise
        return self.authorize(header, scope, function)

    async def look_up(self, key_id: str) -> bool:
        """Add the key `key_id` from Redis, if it is there; whether it was."""
        now = time.monotonic()
        if self._redis is None or self._missing.get(key_id, 0.0) > now:
            return False
        try:
            raw: Any = await self._redis.hget(keys.api_keys(), key_id)
            record = apikeys.KeyRecord.decode(raw) if raw is not None else None
        except (RedisError, ValueError, KeyError, TypeError):
            return False
        if record is None:
            if len(self._missing) >= MAX_MISSING:
                self._missing.clear()
            self._missing[key_id] = now + MISSING_S
            return False
        self._by_id = {**self._by_id, record.id: principal_of(record)}
        return True

    async def refresh(self, redis: aioredis.Redis) -> bool:
        """Reload when the version moved; True when it did. Raises RedisError."""
        self._redis = redis
        version = await redis.get(keys.api_keys_version())
        if version is not None and version == self._version:
            return False
        raw: Any = await redis.hgetall(keys.api_keys())
        records = []
        for ident, value in raw.items():
            try:
                records.append(apikeys.KeyRecord.decode(value))
            except (ValueError, KeyError, TypeError):
                log.warning(
                    "API key %s has an unreadable record; it is refused", ident.decode(errors="replace")
                )
        self.load(records)
        self._version = version
        return True

    async def run(self, redis: aioredis.Redis) -> None:
        """Refresh forever; a Redis error is retried with backoff and jitter, the last table stays."""
        failures = 0
        while True:
            try:
                await self.refresh(redis)
            except RedisError as exc:
                stop_if_cancelled(exc)
                failures += 1
                if self.healthy:
                    log.warning(
                        "API keys could not be refreshed (%s); keeping the last %d", exc, len(self._by_id)
                    )
                self.healthy = False
                await asyncio.sleep(min(MAX_BACKOFF_S, self.refresh_s * 2**failures) * random.uniform(0.5, 1))
                continue
            failures = 0
            self.healthy = True
            await asyncio.sleep(self.refresh_s)
