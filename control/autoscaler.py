"""The encoder autoscaler's loop: every ``interval_s`` it reads the Encoder services' load, asks
the policy (``control.autoscale``, plain Python) and has the controller scale the encoders."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray

from control.autoscale import AutoscalePolicy, Decision
from epd.config import AutoscaleConfig

log = logging.getLogger("control.controller")  # the controller's log, whichever of its modules writes


class Autoscaler:
    """``services()``: the Encoder services' handles now; ``current()``: the encoder count;
    ``scale(n)``: set it (waits until reached). ``decisions`` keeps the last 1000 (epd status)."""

    def __init__(self, config: AutoscaleConfig, services: Callable[[], list], current: Callable[[], int],
                 scale: Callable[[int], object], metrics, stop: threading.Event) -> None:
        self.config = config
        self._services, self._current, self._scale = services, current, scale
        self.metrics = metrics
        self._stop = stop
        self.decisions: list[dict] = []

    def run(self) -> None:
        policy = AutoscalePolicy(self.config, time.monotonic())
        while not self._stop.wait(self.config.interval_s):
            try:
                queued = sum(q for q, _ in ray.get([s.load.remote() for s in self._services()], timeout=30))
                decision = policy.decide(self._current(), queued, time.monotonic())
                self.metrics.observe(decision, policy.desired(queued))
                if decision.direction != "hold":
                    self._record(decision)
                    self._scale(decision.target)
            except Exception:  # noqa: BLE001 - one failed look must not stop autoscaling
                log.exception("autoscaler step failed")

    def _record(self, decision: Decision) -> None:
        entry = {"time": time.time(), "from": decision.current, "to": decision.target,
                 "direction": decision.direction, "queued": decision.queued, "reason": decision.reason}
        self.decisions.append(entry)
        del self.decisions[:-1000]
        log.info("autoscale encoders %d -> %d: %s", decision.current, decision.target, decision.reason)
        self.metrics.decision(decision)
