"""What KEDA 2.x asks Redis for a `redis-streams` trigger, and what it makes of the answer, written
after kedacore/keda v2.20.2: pkg/scalers/redis_streams_scaler.go (`Validate`, `createEntriesCountFn`,
`GetMetricsAndActivity`) with github.com/redis/go-redis/v9 v9.19.0, which it builds with (a nil lag
in XINFO GROUPS reads as -1), and pkg/scaling/executor/scale_scaledobjects.go (`RequestScale`).
Imported by name, like deploy_files."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import redis

Mode = Literal["lag", "pending", "length"]
NIL_LAG = -1
"""go-redis's XInfoGroup.Lag when Redis answers nil (it cannot compute the lag)."""


@dataclasses.dataclass(frozen=True)
class Trigger:
    """One redis-streams trigger's metadata as KEDA's `Validate` reads it: with a consumerGroup, lag
    mode when lagCount is nonzero, else pending mode; without one, stream-length mode."""

    name: str
    stream: str
    group: str
    target: int
    activation: int
    mode: Mode

    @classmethod
    def from_object(cls, trigger: dict[str, Any]) -> Trigger:
        metadata = trigger["metadata"]
        group = metadata.get("consumerGroup", "")
        lag = int(metadata.get("lagCount", "0"))
        mode: Mode = ("lag" if lag else "pending") if group else "length"
        if mode == "lag":
            target = lag
        else:
            key = "pendingEntriesCount" if mode == "pending" else "streamLength"
            target = int(metadata.get(key, "5"))
        activation = int(metadata.get("activationLagCount", "0"))  # every mode's, in KEDA 2.20
        return cls(trigger["name"], metadata["stream"], group, target, activation, mode)

    def count(self, client: redis.Redis) -> int:
        """The metric, by KEDA's queries; raises what Redis raises, as KEDA reports a trigger error."""
        if self.mode == "length":
            return int(client.xlen(self.stream))  # XLEN key: 0 for a stream not made yet
        if self.mode == "pending":
            summary: Any = client.xpending(self.stream, self.group)  # XPENDING key group
            return int(summary["pending"])
        info: Any = client.info("server")  # INFO: lag needs Redis 7
        if int(str(info["redis_version"]).split(".")[0]) < 7:
            raise RuntimeError("redis version 7+ required for lag")
        try:
            groups: Any = client.xinfo_groups(self.stream)
        except redis.ResponseError as exc:
            if str(exc) == "no such key":  # KEDA: a stream not created yet has no lag
                return 0
            raise
        for group in groups:
            if _text(group["name"]) == self.group:
                lag = group.get("lag")
                return NIL_LAG if lag is None else int(lag)
        return int(client.xlen(self.stream))  # a stream without the group: its length

    def is_active(self, count: int) -> bool:
        return count > self.activation


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclasses.dataclass(frozen=True)
class Decision:
    counts: dict[str, int]
    replicas: int


def decide(scaled_object: dict[str, Any], client: redis.Redis) -> Decision:
    """The replicas a ScaledObject asks for now, as KEDA and the HPA it feeds compute them once the
    cooldown has passed: no active trigger scales to minReplicaCount (zero); otherwise each
    trigger's AverageValue metric asks for ceil(count / target) replicas, the largest wins, bounded
    by max(minReplicaCount, 1) and maxReplicaCount. A trigger that errors raises: KEDA would then
    scale nothing, to zero least of all."""
    spec = scaled_object["spec"]
    triggers = [Trigger.from_object(trigger) for trigger in spec["triggers"]]
    counts = {trigger.name: trigger.count(client) for trigger in triggers}
    return Decision(counts, replicas(triggers, counts, spec["minReplicaCount"], spec["maxReplicaCount"]))


def replicas(triggers: Sequence[Trigger], counts: dict[str, int], minimum: int, maximum: int) -> int:
    if not any(trigger.is_active(counts[trigger.name]) for trigger in triggers):
        return minimum
    wanted = max(math.ceil(counts[trigger.name] / trigger.target) for trigger in triggers)
    return min(max(wanted, minimum, 1), maximum)
