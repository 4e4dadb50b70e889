"""Every Redis name fngate uses, built by small functions so that gateway and runner agree."""

from __future__ import annotations

import hashlib

PREFIX = "fngate"
RUNNER_GROUP = "runners"


LEVELS = ("sync", "async")
"""Priority levels, highest first: a runner fills a batch from a level only with the slots that the
levels before it leave. A level's index is its number in invocations()."""
SYNC, ASYNC = 0, 1


def invocations(function: str, level: int = SYNC, priority: int = 1) -> str:
    """The stream of pending invocations of one function at one priority level, read by the runner
    group. Level 0 (synchronous) keeps the plain name; every other level has its number appended.
    A synchronous invocation of a function with priority levels (its manifest's
    batching.priority_levels, 1 the highest) past the first waits in a stream of its own."""
    if level == SYNC:
        return f"{PREFIX}:q:{function}" if priority <= 1 else f"{PREFIX}:q:{function}:p{priority}"
    return f"{PREFIX}:q:{function}:{level}"


def levels(function: str, priorities: int = 1) -> tuple[str, ...]:
    """The function's invocation streams, highest priority first: one per priority level of its
    synchronous invocations (`priorities`: batching.priorities), then the asynchronous level."""
    synchronous = (invocations(function, SYNC, priority) for priority in range(1, priorities + 1))
    return (*synchronous, invocations(function, ASYNC))


def level_names(priorities: int = 1) -> tuple[str, ...]:
    """What metrics and KEDA triggers call each of levels(function, priorities)."""
    synchronous = ("sync",) if priorities <= 1 else tuple(f"sync-p{p}" for p in range(1, priorities + 1))
    return (*synchronous, LEVELS[ASYNC])


def dead_letters(function: str) -> str:
    """Invocations that failed too many deliveries, kept for inspection."""
    return f"{PREFIX}:dlq:{function}"


def cache_entry(function: str, key_hex: str) -> str:
    """A cached response (a hash of `h` and `b`, with the manifest's TTL)."""
    return f"{cache_prefix(function)}{key_hex}"


def cache_prefix(function: str) -> str:
    """Every cache entry of a function starts with this, so that they can be cleared together."""
    return f"{PREFIX}:c:{function}:"


def in_flight(function: str, key_hex: str) -> str:
    """The invocation now computing this cache key; identical invocations wait for its reply."""
    return f"{PREFIX}:f:{function}:{key_hex}"


def wake_channel() -> str:
    """Pub/sub channel on which gateways name a runner pool that has work and no live runner."""
    return f"{PREFIX}:wake"


def start_failures() -> str:
    """Hash: pool -> why its last runner failed to start (cleared when one starts)."""
    return f"{PREFIX}:start-failures"


def replies(gateway_id: str) -> str:
    """The reply stream of one gateway process."""
    return f"{PREFIX}:r:{gateway_id}"


def gateways() -> str:
    """Sorted set: live gateway process id -> the time (s) its heartbeat expires."""
    return f"{PREFIX}:gateways"


def registry() -> str:
    """Hash: function name -> JSON record of its stored versions, mirrored from the repository."""
    return f"{PREFIX}:registry"


def control() -> str:
    """Stream of model-control operations (load, unload, deploy, remove) that every runner reads."""
    return f"{PREFIX}:control"


def runners() -> str:
    """Sorted set: live runner name -> the time (ms) its heartbeat expires."""
    return f"{PREFIX}:runners"


def runner_models(runner: str) -> str:
    """Hash of one runner: "{function}/{version}" -> JSON load state, plus `_pool` and `_control`."""
    return f"{PREFIX}:models:{runner}"


def statistics(function: str, version: str) -> str:
    """Hash of one function version's counters in Triton's statistics terms (fngate.statistics)."""
    return f"{PREFIX}:stats:{function}:{version}"


def unloaded() -> str:
    """Hash: function name -> when (ms) it was explicitly unloaded; it is served again after a load."""
    return f"{PREFIX}:unloaded"


def api_keys() -> str:
    """Hash: API key id -> JSON record (sha256 of the key, scopes, limits); never the key itself."""
    return f"{PREFIX}:apikeys"


def api_keys_version() -> str:
    """Counter bumped on every change to the API keys, so gateways reload only when it moves."""
    return f"{PREFIX}:apikeys:version"


def key_rate(key_id: str) -> str:
    """Hash of one API key's token bucket: `t` tokens left at `ms` (Redis time)."""
    return f"{PREFIX}:rate:{key_id}"


def key_in_flight(key_id: str) -> str:
    """Sorted set of one API key's invocations in flight on every gateway -> expiry (ms): a gateway
    that dies leaves members that lapse at their expiry."""
    return f"{PREFIX}:busy:{key_id}"


def key_share(key_id: str, function: str) -> str:
    """Sorted set of one API key's invocations of one function, queued or running -> expiry (ms):
    the key's share of that function's queue."""
    return f"{PREFIX}:share:{key_id}:{function}"


def result(invocation_id: str) -> str:
    """Stream of one asynchronous invocation: its submission (state and what the gateway needs to
    answer), then its cancellation, or its end (the result is then kept compactly beside it,
    fngate.queue.stored_result). Always carries a TTL."""
    return f"{PREFIX}:result:{invocation_id}"


def result_quota(key_id: str) -> str:
    """Hash of the bytes one API key's asynchronous results hold, by the minute they expire in, and
    their `total` (with its sorted set of minutes, `...:at`)."""
    return f"{PREFIX}:quota:{key_id or '-'}"


def idempotency(key_id: str, idempotency_key: str) -> str:
    """The asynchronous invocation that an API key's `Idempotency-Key` created (with a TTL). The
    client's key is hashed: it is length-unbounded text chosen by the caller."""
    digest = hashlib.sha256(idempotency_key.encode()).hexdigest()
    return f"{PREFIX}:idem:{len(key_id)}:{key_id}:{digest}"


def callbacks() -> str:
    """Stream of asynchronous invocations that finished and have a callback URL, read by the
    CALLBACK_GROUP of every gateway."""
    return f"{PREFIX}:callbacks"


CALLBACK_GROUP = "gateways"
