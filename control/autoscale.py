"""Encoder autoscaling policy: how many encoder replicas the load asks for. Plain Python, no Ray.

The load signal is queue depth: images queued or running at the Encoder service(s), per replica.
The target count is ``ceil(queued / target_queue_per_replica)`` within ``[min, max]``. Scaling up
happens at once (a burst should not wait); scaling down only after the load has stayed below the
current count for ``cooldown_s``, and never sooner than ``cooldown_s`` after the last change, so a
gap between two bursts does not tear replicas down and start them again.

The controller (``control.controller``) acts on a decision by creating encoder actors that ask Ray for
the role's resources: where the cluster lacks them, the actor waits and Ray's cluster autoscaler
adds a node of a type that has them (``deploy/*.yaml``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from epd.config import AutoscaleConfig


@dataclass(frozen=True)
class Decision:
    current: int
    target: int
    queued: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down" if self.target < self.current else "hold"


class AutoscalePolicy:
    def __init__(self, config: AutoscaleConfig, now: float) -> None:
        self.config = config
        self.last_change_at = now
        self.last_busy_at = now  # last time the load wanted at least the current count

    def desired(self, queued: int) -> int:
        wanted = math.ceil(queued / self.config.target_queue_per_replica)
        return max(self.config.min_replicas, min(self.config.max_replicas, wanted))

    def decide(self, current: int, queued: int, now: float) -> Decision:
        desired = self.desired(queued)
        if desired >= current:
            self.last_busy_at = now
        if desired > current:
            return self._change(current, desired, queued, now,
                                f"{queued} images in flight over {current} replicas > "
                                f"{self.config.target_queue_per_replica:g} per replica")
        quiet_s = now - self.last_busy_at
        since_change_s = now - self.last_change_at
        if desired < current and quiet_s >= self.config.cooldown_s and since_change_s >= self.config.cooldown_s:
            return self._change(current, desired, queued, now,
                                f"load below {current} replicas for {quiet_s:.1f}s (cool-down {self.config.cooldown_s:g}s)")
        return Decision(current, current, queued, "hold")

    def _change(self, current: int, target: int, queued: int, now: float, reason: str) -> Decision:
        self.last_change_at = now
        return Decision(current, target, queued, reason)
