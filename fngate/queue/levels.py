"""Priority levels: where an invocation waits (its function's stream for its request priority, the
queue policy of that level) and how runners read them, each level only for the room the levels
before it left."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fngate import keys

if TYPE_CHECKING:  # fngate.manifest is the schema; this module only reads its batching policy
    from fngate.manifest import BatchingSpec

# --- Priority levels ------------------------------------------------------------------------------
# KEYS: a function's invocation streams, highest priority first (keys.levels). ARGV: the group, the
# consumer, then the room of each level in KEYS' order (fewer: the last one holds for the rest):
# how many entries this consumer may still take of that level and the levels above it together.
# Reads new entries from each level only for the room that the levels before it left. Answers
# {level, entries} pairs.
READ_LEVELS = """
local taken = 0
local out = {}
for i, key in ipairs(KEYS) do
  local room = tonumber(ARGV[math.min(2 + i, #ARGV)]) - taken
  if room <= 0 then break end
  local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', room, 'STREAMS', key, '>')
  if got then
    local entries = got[1][2]
    taken = taken + #entries
    out[#out + 1] = {i - 1, entries}
  end
end
return out
"""


def level_entries(reply: Any, streams: Sequence[str]) -> list[tuple[int, bytes, dict[bytes, bytes] | None]]:
    """(level, id, fields) of READ_LEVELS' answer or of a blocking XREADGROUP over `streams`;
    fields None for an entry deleted after delivery."""
    found = []
    for name, entries in reply or ():
        level = name if isinstance(name, int) else streams.index(name.decode())
        for entry_id, flat in entries:
            fields = dict(zip(flat[::2], flat[1::2], strict=True)) if flat is not None else None
            found.append((level, entry_id, fields))
    return found


def rooms(read_ahead: int, held: Sequence[int], count: int) -> list[int]:
    """The room of each of `count` levels for READ_LEVELS: `read_ahead` less what this consumer
    holds (`held`: the level of each entry read and not yet taken into a batch) of that level and
    the levels above it. Entries of a lower level never use up a higher level's room, so a burst
    of low-priority work read ahead does not keep a high-priority invocation in Redis."""
    out = []
    total = 0
    for level in range(count):
        total += sum(1 for item in held if item == level)
        out.append(read_ahead - total)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where one synchronous invocation waits, and how long (Triton's priority queue policy)."""

    priority: int
    """Its level, 1 the highest (1 for a function without priority levels)."""
    stream: str
    max_queue_size: int
    queue_timeout_ms: int = 0
    """Its queue timeout from its enqueue; 0: none (its deadline alone holds)."""
    delay: bool = False
    """Past its queue timeout it is served after the level's others (DELAY), not refused."""


def place(
    function: str, batching: BatchingSpec, priority: int = 0, timeout_us: int | None = None
) -> Placement:
    """The placement of an invocation of `function` that asks for `priority` (0, or a level outside
    1..priority_levels: the default level, as Triton does) and a queue timeout of `timeout_us`
    (Triton's `timeout` request parameter: honoured only where the level's policy allows an
    override, and then only to shorten the policy's own timeout)."""
    levels = batching.priority_levels
    level = priority if levels and 1 <= priority <= levels else (batching.default_priority_level or 1)
    policy = batching.policy(level)
    timeout = policy.timeout_us
    if policy.allow_timeout_override and timeout_us and (not timeout or timeout_us < timeout):
        timeout = timeout_us
    return Placement(
        level,
        keys.invocations(function, keys.SYNC, level),
        batching.queue_limit(level),
        math.ceil(timeout / 1000) if timeout else 0,
        policy.timeout_action == "delay",
    )
