"""The controller's bookkeeping of every replica's life, plain Python (the probes are the
controller's I/O; this only decides what they mean).

A replica is *starting* until it first registers, then *healthy* or *unhealthy* by its probes:
its gRPC health check (the serving path itself) or, for encoder replicas, a call through Ray. A
probe that cannot reach it marks it unhealthy at once (callers have already routed around it);
when it answers again it is healthy again, and if it came back as a new process (Ray restarted
it: a new incarnation) that is a *restart*. When Ray reports the actor dead for good (its restarts
spent, its node gone) it is *dead*: the controller removes it and starts a *replacement*, whose
time from the death to its first registration is recorded. Every transition is one ``Event``.
"""

from __future__ import annotations

import enum
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass


class Probe(enum.Enum):
    SERVING = "serving"
    NOT_SERVING = "not_serving"  # up, but cannot serve now (e.g. nothing behind it): not taking work
    UNREACHABLE = "unreachable"  # no answer: dead, restarting, or wedged
    DEAD = "dead"  # Ray says the actor is gone for good


@dataclass
class Replica:
    name: str
    role: str
    created_at: float
    registered: bool = False
    incarnation: str = ""
    healthy: bool = False
    down_since: float | None = None
    replaces: str = ""  # the dead replica this one replaces
    replaces_dead_at: float = 0.0
    last_probe: str = ""  # what the last probe said (Probe value)


@dataclass(frozen=True)
class Event:
    time: float  # wall clock (durations are measured on the monotonic clock)
    role: str
    name: str
    kind: str  # joined, unhealthy, recovered, restarted, died, replaced, removed
    seconds: float = 0.0  # downtime (recovered, restarted) or time from a death to its replacement
    detail: str = ""


class Fleet:
    def __init__(self, history: int = 500) -> None:
        self.replicas: dict[str, Replica] = {}
        self.events: deque[Event] = deque(maxlen=history)
        self.counts: Counter[tuple[str, str]] = Counter()  # (role, kind) -> events ever

    def add(self, name: str, role: str, now: float, replaces: str = "", replaces_dead_at: float = 0.0) -> None:
        self.replicas[name] = Replica(name, role, now, replaces=replaces, replaces_dead_at=replaces_dead_at)

    def remove(self, name: str, now: float, reason: str = "") -> None:
        replica = self.replicas.pop(name, None)
        if replica is not None and reason:
            self._event(now, replica, "removed", detail=reason)

    def observe(self, name: str, probe: Probe, incarnation: str, now: float) -> list[Event]:
        """What one probe of ``name`` means; returns the events it caused."""
        replica = self.replicas.get(name)
        if replica is None:
            return []
        replica.last_probe = probe.value
        before = len(self.events)
        if probe is Probe.DEAD:
            self._event(now, replica, "died")
            replica.healthy = False
            replica.down_since = replica.down_since or now
        elif probe is Probe.UNREACHABLE or not incarnation:
            if replica.registered and replica.healthy:
                self._event(now, replica, "unhealthy", detail=probe.value)
                replica.down_since = now
            replica.healthy = False
        else:  # it answers
            self._answered(replica, probe, incarnation, now)
        return list(self.events)[before:]

    def _answered(self, replica: Replica, probe: Probe, incarnation: str, now: float) -> None:
        if not replica.registered:
            replica.registered, replica.incarnation = True, incarnation
            if replica.replaces:
                self._event(now, replica, "replaced", seconds=now - replica.replaces_dead_at,
                            detail=f"replaces {replica.replaces}")
            else:
                self._event(now, replica, "joined", seconds=now - replica.created_at)
        elif incarnation != replica.incarnation:
            downtime = now - replica.down_since if replica.down_since is not None else 0.0
            self._event(now, replica, "restarted", seconds=downtime)
            replica.incarnation, replica.down_since = incarnation, None
        healthy = probe is Probe.SERVING
        if healthy and not replica.healthy and replica.down_since is not None:
            self._event(now, replica, "recovered", seconds=now - replica.down_since)
            replica.down_since = None
        elif not healthy and replica.healthy:
            self._event(now, replica, "unhealthy", detail=probe.value)
            replica.down_since = now
        replica.healthy = healthy

    def dead_since(self, name: str) -> float:
        replica = self.replicas.get(name)
        return replica.down_since if replica is not None and replica.down_since is not None else 0.0

    def healthy_count(self, role: str) -> int:
        return sum(r.healthy for r in self.replicas.values() if r.role == role)

    def count(self, role: str, kind: str) -> int:
        return self.counts[(role, kind)]

    def recent(self, limit: int = 100) -> list[dict]:
        return [asdict(e) for e in list(self.events)[-limit:]]

    def _event(self, now: float, replica: Replica, kind: str, seconds: float = 0.0, detail: str = "") -> None:
        self.events.append(Event(time.time(), replica.role, replica.name, kind, round(seconds, 3), detail))
        self.counts[(replica.role, kind)] += 1
