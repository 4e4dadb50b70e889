"""Every Redis name fngate uses, built by small functions so that gateway and runner agree.

Names carry a hash tag (the part in braces) where scripts meet: everything a script touches shares
its tag, so on a Redis Cluster each script call lands in one slot (docs/deployment.md). A
function's streams, counters, cache entries and in-flight markers carry `{function}`; a gateway's
reply stream `{gateway id}`; an API key's limits `{key id}`; an asynchronous result a tag chosen
in its invocation id, so that it lives in the slot of the stream it was queued on (`result_id`).
One Redis ignores the braces. The rest (registry, control, heartbeats) are single keys.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import os

PREFIX = "fngate"
RUNNER_GROUP = "runners"
SLOTS = 16384
"""A Redis Cluster's hash slots."""
RESULT_TAG_DIGITS = 6
"""The leading digits of an asynchronous invocation's id that tag its result (keys.result)."""


def hash_tag(key: str) -> str:
    """What a key hashes by on a Redis Cluster: its hash tag (what lies between its first '{' and
    the next '}', when that is not empty), else the whole key."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def slot(key: str | bytes) -> int:
    """A key's Redis Cluster hash slot: CRC16 (XMODEM, binascii.crc_hqx) of its hash tag, mod SLOTS."""
    text = key.decode() if isinstance(key, bytes) else key
    return binascii.crc_hqx(hash_tag(text).encode(), 0) % SLOTS


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
        if priority <= 1:
            return f"{PREFIX}:q:{{{function}}}"
        return f"{PREFIX}:q:{{{function}}}:p{priority}"
    return f"{PREFIX}:q:{{{function}}}:{level}"


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
    return f"{PREFIX}:dlq:{{{function}}}"


def cache_entry(function: str, key_hex: str) -> str:
    """A cached response (a hash of `h` and `b`, with the manifest's TTL)."""
    return f"{cache_prefix(function)}{key_hex}"


def cache_prefix(function: str) -> str:
    """Every cache entry of a function starts with this, so that they can be cleared together."""
    return f"{PREFIX}:c:{{{function}}}:"


def in_flight(function: str, key_hex: str) -> str:
    """The invocation now computing this cache key; identical invocations wait for its reply."""
    return f"{PREFIX}:f:{{{function}}}:{key_hex}"


def sequence(function: str, sequence_id: int | str) -> str:
    """A live sequence of a function (fngate.sequences): present from its start to its end, or
    until it is idle past the function's idle timeout; in the function's slot."""
    return f"{PREFIX}:seq:{{{function}}}:{sequence_id!r}"


def live_sequences(function: str) -> str:
    """Sorted set of a function's live sequences (their keys) -> the latest each may live to (ms,
    Redis time): how many are live, for `sequence.max_live`; in the function's slot."""
    return f"{PREFIX}:seqs:{{{function}}}"


def left_channel(function: str) -> str:
    """Pub/sub channel on which gateways name the entries (`<stream> <entry id>`) of the function's
    invocations whose callers left after a runner read them: the runner answers them unrun. In the
    function's slot (a shard channel on a Redis Cluster, published from its streams' scripts)."""
    return f"{PREFIX}:left:{{{function}}}"


def wake_channel() -> str:
    """Pub/sub channel on which gateways name a runner pool that has work and no live runner."""
    return f"{PREFIX}:wake"


def woken(pool: str) -> str:
    """String: the queue time (ms since the epoch) of the earliest invocation for which a gateway
    woke the pool, with no live runner, and heard a scaler listen (so it waits past the invocation's
    deadline for the start); set if absent, for as long as a gateway takes a heard wake for a start
    on its way. The pool's first runner takes it: the invocations queued before its start count
    their wait for it from then (runner.models.LoadedModels.deadline_ms)."""
    return f"{PREFIX}:woken:{pool}"


def start_failures() -> str:
    """Hash: pool -> why its last runner failed to start (cleared when one starts)."""
    return f"{PREFIX}:start-failures"


def replies(gateway_id: str) -> str:
    """The reply stream of one gateway process."""
    return f"{PREFIX}:r:{{{gateway_id}}}"


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
    return f"{PREFIX}:stats:{{{function}}}:{version}"


def custom_metrics(function: str, version: str) -> str:
    """Hash of one function version's custom metrics (a Triton Python model's pb_utils.MetricFamily,
    fngate.custom_metrics), added to by every runner."""
    return f"{PREFIX}:custom:{{{function}}}:{version}"


def unloaded() -> str:
    """Hash: function name -> when (ms) it was explicitly unloaded; it is served again after a load."""
    return f"{PREFIX}:unloaded"


def api_keys() -> str:
    """Hash: API key id -> JSON record (sha256 of the key, scopes, limits); never the key itself."""
    return f"{PREFIX}:apikeys"


def api_keys_version() -> str:
    """Counter bumped on every change to the API keys, so gateways reload only when it moves."""
    return f"{PREFIX}:apikeys:version"


def key_usage(key_id: str) -> str:
    """Hash of one API key's compute: function -> seconds of batch time charged to it, ever."""
    return f"{PREFIX}:usage:{{{key_id}}}"


def key_usage_minute(key_id: str, minute: int) -> str:
    """Hash of one API key's compute in one minute (since the epoch): function -> seconds; kept
    USAGE_KEPT_S."""
    return f"{PREFIX}:usage:{{{key_id}}}:{minute}"


def key_cpu(key_id: str) -> str:
    """Hash of one API key's CPU time: function -> CPU seconds charged to it, ever (functions whose
    backend measures them: those in a process of their own)."""
    return f"{PREFIX}:usage:{{{key_id}}}:cpu"


def key_cpu_minute(key_id: str, minute: int) -> str:
    """Hash of one API key's CPU time in one minute (since the epoch): function -> CPU seconds;
    kept USAGE_KEPT_S."""
    return f"{PREFIX}:usage:{{{key_id}}}:{minute}:cpu"


USAGE_KEPT_S = 2 * 24 * 3600


def key_rate(key_id: str) -> str:
    """Hash of one API key's token bucket: `t` tokens left at `ms` (Redis time)."""
    return f"{PREFIX}:rate:{{{key_id}}}"


def key_in_flight(key_id: str) -> str:
    """Sorted set of one API key's invocations in flight on every gateway -> expiry (ms): a gateway
    that dies leaves members that lapse at their expiry."""
    return f"{PREFIX}:busy:{{{key_id}}}"


def config_overrides() -> str:
    """Hash of the configurations given with Triton load requests: Triton model name -> the
    configuration as JSON, served in place of its folder's config.pbtxt until a load without one
    (gateway.control)."""
    return f"{PREFIX}:overrides"


def auto_completed() -> str:
    """Hash of the Python models of a folder repository that have no config.pbtxt: folder name ->
    JSON {"digest", "config"} (what the model's auto_complete_config answered) or {"digest",
    "error"} (runner.triton.complete records them)."""
    return f"{PREFIX}:autocompleted"


def shared_memory(key_id: str) -> str:
    """Hash of one API key's system shared memory regions: name -> JSON {name, key, offset,
    byte_size} (gateway.shared_memory)."""
    return f"{PREFIX}:shm:{{{key_id}}}"


def key_share(key_id: str, function: str) -> str:
    """Sorted set of one API key's invocations of one function, queued or running -> expiry (ms):
    the key's share of that function's queue."""
    return f"{PREFIX}:share:{{{key_id}}}:{function}"


def result(invocation_id: str) -> str:
    """Stream of one asynchronous invocation: its submission (state and what the gateway needs to
    answer), then its cancellation, or its end (the result is then kept compactly beside it,
    fngate.queue.stored_result). Always carries a TTL. Tagged by the id's first RESULT_TAG_DIGITS
    digits (RESULT_KEY_LUA builds the same name in a script)."""
    tag, rest = invocation_id[:RESULT_TAG_DIGITS], invocation_id[RESULT_TAG_DIGITS:]
    return f"{PREFIX}:result:{{{tag}}}{rest}"


RESULT_KEY_LUA = f"""
local function result_key(id)
  local cut = {RESULT_TAG_DIGITS}
  return '{PREFIX}:result:{{' .. string.sub(id, 1, cut) .. '}}' .. string.sub(id, cut + 1)
end
"""
"""result_key(id) in Lua: keys.result(id)."""


def result_id(stream: str) -> str:
    """A new asynchronous invocation's id (32 hexadecimal digits) whose result (keys.result) has the
    slot of `stream`, so that the script that queues it there and creates its result touches one
    slot of a Redis Cluster: its first RESULT_TAG_DIGITS digits are chosen, the rest (104 bits) are
    random."""
    return _slot_tag(slot(stream)) + os.urandom(16).hex()[RESULT_TAG_DIGITS:]


@functools.cache
def _slot_tag(target: int) -> str:
    """RESULT_TAG_DIGITS digits whose slot is `target`. Solved, not searched: CRC16 without an initial
    value is linear over GF(2), so flipping bits of a string changes its CRC by the CRC of the flips
    alone. Flipping the low three bits of a '0' keeps it a digit ('0' to '7'): 18 bits to flip,
    whose changes span all 14 bits of a slot (_pivots); elimination picks the flips that lead from
    the slot of '000000' to `target`."""
    base = b"0" * RESULT_TAG_DIGITS
    need, flips = target ^ slot(base), 0
    for top, (change, made_by) in sorted(_pivots().items(), reverse=True):
        if need >> top & 1:
            need, flips = need ^ change, flips ^ made_by
    if need:
        raise ValueError(f"slot {target} is out of range")
    return bytes(char ^ (flips >> (3 * index) & 7) for index, char in enumerate(base)).decode()


@functools.cache
def _pivots() -> dict[int, tuple[int, int]]:
    """The slot changes of the 18 flips in echelon form: highest bit -> (the change, the flips
    that make it, one bit per flip)."""
    pivots: dict[int, tuple[int, int]] = {}
    for bit in range(3 * RESULT_TAG_DIGITS):
        flip = bytearray(RESULT_TAG_DIGITS)
        flip[bit // 3] = 1 << (bit % 3)
        change, made_by = slot(bytes(flip)), 1 << bit
        for top in sorted(pivots, reverse=True):
            if change >> top & 1:
                change, made_by = change ^ pivots[top][0], made_by ^ pivots[top][1]
        if change:
            pivots[change.bit_length() - 1] = (change, made_by)
    return pivots


def result_quota(key_id: str) -> str:
    """Hash of the bytes one API key's asynchronous results hold, by the minute they expire in, and
    their `total` (with its sorted set of minutes, `...:at`)."""
    return f"{PREFIX}:quota:{{{key_id or '-'}}}"


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
