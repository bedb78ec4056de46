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


class DeploymentFailed(RuntimeError):
    """The deployment stopped itself (a role cannot start); the message says why. Here, not in
    ``control.controller``, so a command can name it before ray is imported."""


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

    def history(self) -> dict:
        """The events and their counts, as JSON (``control.history`` keeps them across a
        controller restart)."""
        return {"events": self.recent(self.events.maxlen or len(self.events)),
                "counts": [[role, kind, n] for (role, kind), n in sorted(self.counts.items())]}

    def restore(self, history: dict) -> None:
        """Carry on the ``history`` a previous controller of the deployment kept."""
        self.events.extend(Event(**event) for event in history.get("events", []))
        for role, kind, n in history.get("counts", []):
            self.counts[(role, kind)] += n

    def note(self, role: str, name: str, kind: str, detail: str = "") -> None:
        """An event of the deployment itself (the controller restarted), not of a replica."""
        self.events.append(Event(time.time(), role, name, kind, 0.0, detail))
        self.counts[(role, kind)] += 1

    def _event(self, now: float, replica: Replica, kind: str, seconds: float = 0.0, detail: str = "") -> None:
        self.events.append(Event(time.time(), replica.role, replica.name, kind, round(seconds, 3), detail))
        self.counts[(replica.role, kind)] += 1


class StartFailures:
    """Replicas whose constructor raised, per role, in a row (plain Python; the controller acts).

    Ray does not restart an actor whose constructor raised, and a new one fails the same way when
    the cause is in the checkpoint or the configuration. After ``limit`` in a row, none of the
    role's replicas joining in between: with none of the role serving the deployment cannot serve,
    so it stops (``"stop"``); with some serving, those go on and no more are started (``"hold"``)
    until `epd scale` asks again (``reset``). Before the limit: ``"replace"``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row: Counter[str] = Counter()
        self.holding: dict[str, str] = {}  # role -> why no more of its replicas are started

    def failed(self, role: str, reason: str, serving: int) -> tuple[str, str]:
        """One more replica of ``role`` failed to start; what to do, and why (for the log and status)."""
        self.in_a_row[role] += 1
        if self.in_a_row[role] < self.limit:
            return "replace", ""
        why = f"{role} replicas failed to start {self.in_a_row[role]} times in a row, last: {reason}"
        if not serving:
            return "stop", why
        self.holding[role] = why
        return "hold", why

    def reset(self, role: str) -> None:
        """A replica of ``role`` joined, or `epd scale` asks for the role again."""
        self.in_a_row[role] = 0
        self.holding.pop(role, None)


def unplaced(pending: list[tuple[dict[str, float], int]], shapes: dict[str, dict[str, float]],
             waiting: dict[str, list[str]], nodes: list[dict[str, float]]) -> list[dict]:
    """Which roles have replicas Ray cannot place now, and why.

    ``pending`` is what Ray's GCS still has to place (resource shape, count: the demands it shows
    an autoscaler), ``shapes`` what one replica of each role asks for, ``waiting`` the replicas of
    each role that are not serving, ``nodes`` the total resources of every alive node. A pending
    shape is put down to the roles that ask for exactly it and have replicas waiting (a demand of
    another deployment with the same shape cannot be told apart; ``count`` is capped at the
    waiting replicas). Why: no alive node offers the shape (say, only a lost machine did), or every
    node that offers it has it in use. Ray places the replica by itself once a node offers it free.
    """
    found = []
    for shape, count in pending:
        roles = [role for role, asks in shapes.items() if _same_shape(asks, shape) and waiting.get(role)]
        if not roles:
            continue
        replicas = sorted(name for role in roles for name in waiting[role])
        offering = sum(all(total.get(key, 0.0) >= amount for key, amount in shape.items()) for total in nodes)
        wanted = ", ".join(f"{key}: {amount:g}" for key, amount in sorted(shape.items()))
        if offering:
            reason = (f"the {offering} alive node(s) offering {{{wanted}}} have it all in use; it is placed when "
                      "one frees it or a node that offers it joins")
        else:
            reason = f"no alive node offers {{{wanted}}}; it is placed when a node that offers it joins"
        found.append({"roles": roles, "count": min(count, len(replicas)), "resources": dict(shape),
                      "replicas": replicas, "reason": reason})
    return found


def _same_shape(a: dict[str, float], b: dict[str, float]) -> bool:
    a = {k: v for k, v in a.items() if v}
    b = {k: v for k, v in b.items() if v}
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-6 for k in a)
