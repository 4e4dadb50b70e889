"""Pipeline steps: a finished step's result goes to the next steps' streams instead of a gateway
(FORWARD), and the predecessors of a step that reads several meet in a join (JOIN)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fngate.queue.invocations import PUSH_LUA, Forward, ScriptCall, extra_count, forward_args, queue_bytes

# Pipelines: a finished step's result goes to the next steps' streams instead of a gateway.

# KEYS: the streams of the entries to add, then their byte counters (same order). ARGV: n, then n
# groups of (max queue size, max queue bytes (0: no limit), header, body, step context). All or
# nothing: {'queued', the id of each entry added}, or {'full', index (0-based), 'count'|'bytes'} and
# nothing is added.
FORWARD = (
    PUSH_LUA
    + """
local n = tonumber(ARGV[1])
for i = 0, n - 1 do
  local at = 2 + i * 5
  local limit = full(KEYS[i + 1], KEYS[n + i + 1], ARGV[at], ARGV[at + 1])
  if limit then return {'full', i, limit} end
end
local queued = {'queued'}
for i = 0, n - 1 do
  local at = 2 + i * 5
  queued[#queued + 1] = push(KEYS[i + 1], KEYS[n + i + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4])
end
return queued
"""
)

# KEYS[1]: a join of one pipeline invocation (joins()). ARGV: this predecessor's name, what it
# contributes, how many predecessors the join has, the TTL in ms (to the deadline). Returns every
# contribution once the last one arrives (and forgets them), else nothing.
JOIN = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then
  local all = redis.call('HGETALL', KEYS[1])
  redis.call('DEL', KEYS[1])
  return all
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {}
"""


def joins(invocation_id: str, node: int) -> str:
    """Where the predecessors of a pipeline step (or of its outputs) leave their results."""
    return f"fngate:j:{invocation_id}:{node}"


def forward_call(entries: Sequence[Forward]) -> ScriptCall:
    return ScriptCall(
        keys=[
            *(item.stream for item in entries),
            *(queue_bytes(item.stream) for item in entries),
            *(extra_count(item.stream) for item in entries),  # declared: full() reads them
        ],
        args=[len(entries), *forward_args(entries)],
    )


def parse_forward(raw: Sequence[Any]) -> tuple[int, str] | None:
    """None when queued, else (index of the entry refused, 'count' or 'bytes')."""
    if raw[0] == b"queued":
        return None
    return int(raw[1]), raw[2].decode()


def forwarded_ids(raw: Sequence[Any]) -> list[bytes]:
    """The ids of the entries FORWARD queued, in its entries' order ([] when it refused them)."""
    return list(raw[1:]) if raw[0] == b"queued" else []


def join_call(
    invocation_id: str, node: int, source: str, contribution: bytes, count: int, ttl_ms: int
) -> ScriptCall:
    return ScriptCall(keys=[joins(invocation_id, node)], args=[source, contribution, count, max(ttl_ms, 1)])


def parse_join(raw: Sequence[Any]) -> dict[str, bytes] | None:
    """Every contribution by predecessor once complete, else None."""
    if not raw:
        return None
    return {raw[index].decode(): raw[index + 1] for index in range(0, len(raw), 2)}
