"""Priority levels: a runner reads each level's stream only for the room the levels before it left."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# --- Priority levels ------------------------------------------------------------------------------
# KEYS: a function's invocation streams, highest priority first (keys.levels). ARGV: the group, the
# consumer, the room. Reads up to `room` new entries, from each level only the room that the levels
# before it left. Answers {level, entries} pairs.
READ_LEVELS = """
local room = tonumber(ARGV[3])
local out = {}
for i, key in ipairs(KEYS) do
  if room <= 0 then break end
  local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', room, 'STREAMS', key, '>')
  if got then
    local entries = got[1][2]
    room = room - #entries
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
