"""What KEDA 2.x asks Redis for a `redis-streams` trigger, and what it makes of the answer, written
after kedacore/keda v2.17.1: pkg/scalers/redis_streams_scaler.go (`createEntriesCountFn`,
`GetMetricsAndActivity`; the same file in v2.20.2) and pkg/scaling/executor/scale_scaledobjects.go
(`RequestScale`; rewritten by v2.20.2, same decisions). Imported by name, like deploy_files."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import redis


@dataclasses.dataclass(frozen=True)
class Trigger:
    """One redis-streams trigger's metadata as KEDA reads it (`redisStreamsMetadata.Validate`):
    a consumer group with a nonzero lagCount is lag mode, a group without one pending mode."""

    name: str
    stream: str
    group: str
    target: int
    activation: int
    lag_mode: bool

    @classmethod
    def from_object(cls, trigger: dict[str, Any]) -> Trigger:
        metadata = trigger["metadata"]
        lag = int(metadata.get("lagCount", "0"))
        target = lag or int(metadata.get("pendingEntriesCount", "5"))
        activation = int(metadata.get("activationLagCount", "0"))
        return cls(
            trigger["name"], metadata["stream"], metadata["consumerGroup"], target, activation, lag != 0
        )

    def count(self, client: redis.Redis) -> int:
        """The metric, by KEDA's queries; raises what Redis raises, as KEDA reports a trigger error."""
        if not self.lag_mode:
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
                # Redis answers nil when it cannot tell the lag; go-redis reads nil as 0.
                return int(group.get("lag") or 0)
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
