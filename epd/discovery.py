"""Discovery: which replicas of each role exist, where they listen, which are healthy, and which
take new work; and how a caller picks one and routes around a dead one.

A deployment has one ``Registry`` (a named, detached Ray actor that Ray restarts). Each replica
registers itself once it serves and repeats it every ``heartbeat_s`` (``Membership``): a replica
Ray restarted registers its new address, and a registry Ray restarted (empty) is filled again
within a heartbeat. The controller marks replicas unhealthy when its probes fail, and draining
when it removes them; a removed name is never re-added by a late heartbeat.

Consumers (the Encoder service for encoder replicas, the router for Encoder services, prefill and
decode, prefill for decode) watch the registry with a ``RegistryWatch``: a thread whose call to
the registry (it carries the acknowledgement and brings endpoints back only when something
changed) waits there until something changes, up to ``LONG_POLL_S``, then at least ``poll_s``
before the next; it keeps its last view while the registry is away, and acknowledges the version
it applied together with the calls it still has in flight to each replica, so a drain knows when
no consumer will pick a draining replica again and none has a call to it on the way (while it has
calls in flight to a draining replica it reads every ``poll_s`` without waiting, so the drain
hears them end). An idle deployment's watchers so cost the machine one call per ``LONG_POLL_S``
each instead of one per ``poll_s``: on shared cores every wake-up of another process stalls a
model forward's thread team (docs/BENCHMARKS.md, "what an idle stack costs").

``Balancer`` is a caller's bookkeeping: the healthy, non-draining replicas, the calls in flight to
each, and a circuit breaker per replica (a failed call keeps it out of rotation for a back-off
that doubles while it keeps failing; then one trial call decides). ``Targets`` is its asyncio face:
a call goes to the least busy allowed replica, and a call whose replica failed (not a client error,
not a failure that replica reported from behind it) is tried once on each other replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import grpc

from epd import errors, logs, prefix, routing, rpc
from epd.breaker import Breaker
from epd.config import DeployConfig
from epd.v1 import epd_pb2, epd_pb2_grpc

log = logging.getLogger(__name__)

REGISTRY_NAME = "registry"
HEARTBEAT_S = DeployConfig.heartbeat_s  # the defaults; the deployment's own come in RoleContext
REFILL_GRACE_S = DeployConfig.refill_grace_s  # after a registry restart, a known replica missing from it is kept this long
WATCHER_STALE_S = 10.0  # a watcher silent this long is gone: a drain no longer waits for its ack
STRANDED_S = 2.0  # a replica that said nothing behind it serves counts as unavailable this long
LONG_POLL_S = 5.0  # a watcher's call waits at the registry this long for a change (< WATCHER_STALE_S)
WARMUP_HEARTBEATS = 3  # a restarted registry is refilled by the replicas' heartbeats within this many


@dataclass(frozen=True)
class View:
    """What the registry says at one moment."""

    epoch: str
    version: int
    endpoints: list
    warming: bool = False
    """The registry started less than its warm-up ago: replicas may still be registering again."""


@dataclass(frozen=True)
class RoleContext:
    """What the controller tells every replica it starts, besides the deployment's config."""

    name: str
    """The replica's name, unique in the deployment (its Ray actor name, e.g. ``prefill-3``)."""
    host: str = "127.0.0.1"
    """Address its servers bind: an IP, or ``NODE_ADDRESS`` for the Ray node's own IP."""
    registry: object = None
    """The deployment's ``Registry`` actor handle."""
    poll_s: float = 0.25
    """The shortest time between two reads of the registry by one of its watchers."""
    heartbeat_s: float = HEARTBEAT_S
    """How often it registers itself again (``DeployConfig.heartbeat_s``)."""
    refill_grace_s: float = REFILL_GRACE_S
    """How long its watchers keep a known replica a restarted registry does not list yet."""

    @property
    def role(self) -> str:
        return self.name.rsplit("-", 1)[0]


@dataclass(frozen=True)
class Load:
    """What a replica reports of its work and caches with every heartbeat (routing reads it; it
    may be up to a heartbeat old)."""

    queued_tokens: int = 0
    """Prefill: prompt tokens queued or part-way through, not yet computed."""
    prefix_summary: bytes = b""
    """Prefill: the prefix snapshots it holds (``epd.prefix.encode_summary``)."""
    prefix_block_size: int = 0
    """Prefill: the block size its prefix keys are made with (0: no prefix cache)."""
    free_kv_tokens: int = -1
    """Decode: tokens its K/V pool has free now (-1: not told)."""
    num_waiting: int = 0
    """Decode: handed-off requests waiting for a place in its batch."""


@dataclass(frozen=True)
class Endpoint:
    """One replica of a role, as the registry lists it."""

    name: str
    """The replica's Ray actor name, unique in the namespace (``encoder-3``)."""
    role: str
    address: str = ""
    """``host:port`` of its gRPC server; empty for encoder replicas, which are called as Ray actors."""
    node_id: str = ""
    """The Ray node it runs on."""
    incarnation: str = ""
    """Differs each time the replica's process starts (a Ray restart gives a new one)."""
    pid: int = 0
    """Its process id on its node (operators and fault tests find the process with it)."""
    draining: bool = False
    """Being removed: it finishes what it holds but takes no new work."""
    healthy: bool = True
    """False while the controller's probes fail."""
    http_address: str = ""
    """``host:port`` of its OpenAI-compatible HTTP front (routers started with one); empty: none."""
    capacity_tokens: int = 0
    """Decode replicas: the tokens their K/V pool holds (a request that needs more is refused
    before prefill); 0: not told."""
    load: Load = Load()
    """Its work and caches as of its last heartbeat."""
    also_roles: tuple[str, ...] = ()
    """Roles it serves besides its own: an aggregated prefill replica (``epd serve --aggregate``)
    is a decode endpoint too, and those watching decode replicas list it."""

    @property
    def takes_work(self) -> bool:
        return self.healthy and not self.draining

    def serves(self, role: str) -> bool:
        return self.role == role or role in self.also_roles


@dataclass
class _Watcher:
    role: str
    version: int = -1
    outstanding: dict[str, int] = field(default_factory=dict)
    seen_at: float = field(default_factory=time.monotonic)


class Registry:
    """The deployment's directory of endpoints (wrapped in ``ray.remote`` by the controller).

    ``epoch`` changes when the registry starts (a Ray restart); ``version`` grows with every
    change. Watchers acknowledge the (epoch, version) they applied."""

    def __init__(self, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.epoch = uuid.uuid4().hex
        self._started = time.monotonic()
        self._warmup_s = WARMUP_HEARTBEATS * heartbeat_s
        self._endpoints: dict[str, Endpoint] = {}
        self._removed: set[str] = set()
        self._version = 0
        self._role_changed: dict[str, int] = {}  # the version at which each role's endpoints last changed
        self._watchers: dict[str, _Watcher] = {}
        self._changes: dict[str, asyncio.Event] = {}  # by role: what ``watch`` waits on, set at its next change

    def register(self, endpoint: Endpoint) -> int:
        """A replica that serves (again): new ones join healthy; a draining one stays draining."""
        if endpoint.name in self._removed:
            return self._version
        known = self._endpoints.get(endpoint.name)
        if known is not None and known.incarnation == endpoint.incarnation and known.address == endpoint.address:
            if known.load == endpoint.load:
                return self._version  # a heartbeat: nothing changed
            self._endpoints[endpoint.name] = replace(known, load=endpoint.load)  # health and drain stay as judged
            return self._bump(endpoint)
        draining = known.draining if known is not None else False
        self._endpoints[endpoint.name] = replace(endpoint, draining=draining, healthy=True)
        return self._bump(endpoint, known)

    def mark(self, name: str, healthy: bool, incarnation: str = "") -> int:
        """The controller's verdict on a replica, about the process it probed (``incarnation``):
        a verdict on a process Ray has since restarted is stale and changes nothing (it would take
        the new process out of rotation until the next probe)."""
        endpoint = self._endpoints.get(name)
        if endpoint is None or (incarnation and endpoint.incarnation != incarnation):
            return self._version
        if endpoint.healthy != healthy:
            self._endpoints[name] = replace(endpoint, healthy=healthy)
            return self._bump(endpoint)
        return self._version

    def drain(self, name: str) -> int:
        endpoint = self._endpoints.get(name)
        if endpoint is not None:
            self._endpoints[name] = replace(endpoint, draining=True)
        return self._bump(endpoint)

    def remove(self, name: str) -> int:
        endpoint = self._endpoints.pop(name, None)
        self._removed.add(name)
        # A removed replica's own watchers will never acknowledge again.
        for watcher in [w for w in self._watchers if w.startswith(name + "/")]:
            del self._watchers[watcher]
        return self._bump(endpoint)

    def snapshot(self, watcher: str = "", role: str = "") -> View:
        """Every endpoint, with the epoch and version; a watcher is known from its first read on,
        so a drain waits for it even before it has acknowledged anything."""
        if watcher and watcher not in self._watchers:
            self._watchers[watcher] = _Watcher(role)
        endpoints = [e for e in self._endpoints.values() if not role or e.serves(role)]  # a watcher needs its role only
        return View(self.epoch, self._version, endpoints, warming=time.monotonic() - self._started < self._warmup_s)

    def poll(self, watcher: str, role: str, epoch: str, version: int, outstanding: dict[str, int]) -> View | None:
        """A watcher's periodic call, one round trip: it acknowledges the (``epoch``, ``version``)
        it applied with its calls in flight, and gets ``role``'s endpoints back only when they
        changed since (None otherwise), so a steady deployment's polls carry no endpoint lists. A
        watcher that has ``role``'s latest endpoints is up to date whatever else changed: it
        counts as having applied the current version (``acked``)."""
        current = epoch == self.epoch and version >= self._role_changed.get(role, 0)
        if epoch == self.epoch:
            self._watchers[watcher] = _Watcher(role, self._version if current else version, dict(outstanding))
        elif watcher not in self._watchers:
            self._watchers[watcher] = _Watcher(role)
        if current:
            return None
        return View(self.epoch, self._version, [e for e in self._endpoints.values() if e.serves(role)],
                    warming=time.monotonic() - self._started < self._warmup_s)

    async def watch(self, watcher: str, role: str, epoch: str, version: int, outstanding: dict[str, int],
                    wait_s: float) -> View | None:
        """``poll``, except that when ``role``'s endpoints did not change since (``epoch``,
        ``version``) the call waits here up to ``wait_s`` for their next change and returns the
        view then (None if none came): another role's changes (its replicas' load reports under
        load) wake nobody watching this one. Waiting calls cost this actor nothing: an ``async``
        method makes Ray run it as an asyncio actor, whose plain methods run one at a time on its
        event loop as before."""
        view = self.poll(watcher, role, epoch, version, outstanding)
        if view is not None or wait_s <= 0:
            return view
        changed = self._changes.setdefault(role, asyncio.Event())
        try:
            await asyncio.wait_for(changed.wait(), wait_s)
        except asyncio.TimeoutError:
            if watcher in self._watchers:  # it was here all along: not silent (``WATCHER_STALE_S``)
                self._watchers[watcher].seen_at = time.monotonic()
            return None
        if watcher not in self._watchers:  # forgotten while it waited (its consumer closed)
            return None
        return self.poll(watcher, role, epoch, version, outstanding)

    def ack(self, watcher: str, role: str, epoch: str, version: int, outstanding: dict[str, int]) -> None:
        if epoch == self.epoch:
            self._watchers[watcher] = _Watcher(role, version, dict(outstanding))

    def forget_watcher(self, watcher: str) -> None:
        self._watchers.pop(watcher, None)

    def acked(self, role: str, version: int, name: str = "") -> bool:
        """Every live watcher of ``role`` has applied ``version`` (or a later one) and, when
        ``name`` is given, has no call to ``name`` in flight. A watcher silent for
        ``WATCHER_STALE_S`` is gone (its replica died) and no longer counts."""
        now = time.monotonic()
        for watcher in self._watchers.values():
            if watcher.role != role or now - watcher.seen_at > WATCHER_STALE_S:
                continue
            if watcher.version < version or (name and watcher.outstanding.get(name, 0) > 0):
                return False
        return True

    def _bump(self, *endpoints: Endpoint | None) -> int:
        """A new version, in which the roles ``endpoints`` serve changed; wakes their watchers."""
        self._version += 1
        for endpoint in endpoints:
            for role in (endpoint.role, *endpoint.also_roles) if endpoint is not None else ():
                self._role_changed[role] = self._version
                event = self._changes.pop(role, None)
                if event is not None:
                    event.set()  # the watchers waiting in ``watch`` on this role
        return self._version


class Membership:
    """A replica's own entry in the registry: registered now, then again every ``heartbeat_s``
    (which refills a registry that Ray restarted). ``load`` (if given) is asked for the replica's
    ``Load`` at every heartbeat; ``report_soon`` sends it now-ish (at most every
    ``MIN_REPORT_S``) instead of at the next beat, e.g. when prefill has just stored a snapshot."""

    MIN_REPORT_S = 0.1

    def __init__(self, context: RoleContext, address: str = "",
                 http_address: str = "", capacity_tokens: int = 0, load: Callable[[], Load] | None = None,
                 also_roles: tuple[str, ...] = ()) -> None:
        import ray

        self.registry = context.registry
        self.heartbeat_s = context.heartbeat_s
        self._load = load
        self.endpoint = Endpoint(name=context.name, role=context.role, address=address,
                                 node_id=ray.get_runtime_context().get_node_id(),
                                 incarnation=uuid.uuid4().hex, pid=os.getpid(), http_address=http_address,
                                 capacity_tokens=capacity_tokens, also_roles=also_roles)
        ray.get(self.registry.register.remote(self._current()), timeout=60)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="membership", daemon=True)
        self._thread.start()

    def report_soon(self) -> None:
        self._wake.set()

    def _current(self) -> Endpoint:
        if self._load is None:
            return self.endpoint
        try:
            return replace(self.endpoint, load=self._load())
        except Exception:  # noqa: BLE001 - a report must never stop the heartbeat
            log.exception("load report failed; registering without it")
            return self.endpoint

    def _loop(self) -> None:
        import ray

        while not self._stop.is_set():
            self._wake.wait(self.heartbeat_s)
            if self._stop.wait(self.MIN_REPORT_S if self._wake.is_set() else 0):
                return
            self._wake.clear()
            try:
                ray.get(self.registry.register.remote(self._current()), timeout=10)
            except Exception as error:  # noqa: BLE001 - the registry is restarting: try again next beat
                log.info("registry unreachable (%s); will register again", type(error).__name__)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()


def refill(known: list[Endpoint], listed: list[Endpoint], warming: bool, since_s: float,
           grace_s: float = REFILL_GRACE_S) -> list[Endpoint] | None:
    """A watcher's view while a restarted registry is refilled by the replicas' heartbeats: what it
    lists, plus the replicas the watcher knew that it does not list yet; None once nothing known is
    missing, or once the registry is past its warm-up and ``grace_s`` have passed (what is
    still missing then is gone). A heartbeat can take seconds to land on a loaded machine: a
    replica must not leave rotation only because the registry lost its memory."""
    names = {e.name for e in listed}
    missing = [e for e in known if e.name not in names]
    if not missing or (not warming and since_s >= grace_s):
        return None
    return listed + missing


class RegistryWatch:
    """Keeps a consumer's view of one role current: calls ``on_change(endpoints)`` with the
    role's endpoints whenever the registry changed, then acknowledges the version together with
    ``outstanding()`` (calls in flight per replica). Each call waits at the registry for a change
    (up to ``long_poll_s``); consecutive calls are at least ``poll_s`` apart."""

    def __init__(self, registry, role: str, watcher: str, on_change: Callable[[list[Endpoint]], None],
                 poll_s: float = 0.25, outstanding: Callable[[], dict[str, int]] = dict,
                 refill_grace_s: float = REFILL_GRACE_S, long_poll_s: float = LONG_POLL_S) -> None:
        self.registry = registry
        self.role = role
        self.watcher = f"{watcher}/{role}"
        self.on_change = on_change
        self.outstanding = outstanding
        self.poll_s = poll_s
        self.refill_grace_s = refill_grace_s
        self.long_poll_s = long_poll_s
        self.seen: tuple[str, int] = ("", -1)
        self._applied: list[Endpoint] = []  # what on_change last got
        self._refill_since: float | None = None  # when this watcher first saw a restarted registry
        self._stop = threading.Event()
        self.sync()
        self._thread = threading.Thread(target=self._loop, name=f"watch-{role}", daemon=True)
        self._thread.start()

    def sync(self, wait_s: float = 0.0) -> None:
        """One poll: acknowledges what this watcher applied, and applies what changed (waiting up
        to ``wait_s`` at the registry for a change). The first call (``seen`` empty) always gets
        the registry's view at once."""
        import ray

        call = self.registry.watch.remote(self.watcher, self.role, *self.seen, self.outstanding(), wait_s)
        view = ray.get(call, timeout=wait_s + 30)
        if view is None or self._stop.is_set():
            return  # nothing changed; the poll carried the acknowledgement
        endpoints = [e for e in view.endpoints if e.serves(self.role)]
        if self.seen[0] and view.epoch != self.seen[0]:  # Ray restarted the registry
            now = time.monotonic()
            self._refill_since = self._refill_since or now
            kept = refill(self._applied, endpoints, view.warming, now - self._refill_since, self.refill_grace_s)
            if kept is not None:  # replicas it knew are not back in it yet: keep them meanwhile
                if kept != self._applied:
                    log.info("registry restarted: keeping %s in rotation until they register again",
                             ", ".join(sorted({e.name for e in self._applied} - {e.name for e in endpoints})))
                    self._apply(kept)
                self.registry.ack.remote(self.watcher, self.role, view.epoch, view.version, self.outstanding())
                return  # ``seen`` keeps the old epoch: the next poll gets the full view again
        self._refill_since = None
        self._apply(endpoints)
        self.seen = (view.epoch, view.version)
        # acknowledged now rather than at the next poll: a drain waits on it
        self.registry.ack.remote(self.watcher, self.role, view.epoch, view.version, self.outstanding())

    def _apply(self, endpoints: list[Endpoint]) -> None:
        self.on_change(endpoints)
        self._applied = endpoints

    def _wait_s(self) -> float:
        """How long the next call may wait at the registry: not at all while this consumer has
        calls in flight to a draining replica (the drain waits to hear that they ended)."""
        outstanding = self.outstanding()
        if any(e.draining and outstanding.get(e.name, 0) > 0 for e in self._applied):
            return 0.0
        return self.long_poll_s

    def _loop(self) -> None:
        failing = False
        while not self._stop.wait(self.poll_s):
            try:
                self.sync(self._wait_s())
                failing = False
            except Exception as error:  # noqa: BLE001 - the registry is briefly away: keep the last view
                if not failing:
                    log.warning("registry watch for %s failed (%s); keeping the last view", self.role,
                                type(error).__name__)
                failing = True

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self.registry.forget_watcher.remote(self.watcher)


class Balancer:
    """Bookkeeping only: the replicas of a role that take work, the calls in flight to each, and
    a breaker per replica. ``pick`` chooses the allowed replica with the fewest calls in flight
    (ties go to the one used least recently). A draining or unhealthy replica keeps its in-flight
    count until those calls end but is never picked."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._live: dict[str, Endpoint] = {}  # replicas that take work, by name
        self._names: dict[str, str] = {}  # address -> name, of every replica listed (draining too)
        self._outstanding: dict[str, int] = {}
        self._breakers: dict[str, Breaker] = {}
        self._last_pick: dict[str, int] = {}
        self._picks = 0
        self._stranded: dict[str, float] = {}  # name -> when it last said nothing behind it serves
        self._sent_tokens: dict[str, int] = {}  # routed calls in flight: the work they carry, by replica
        self._held: dict[str, tuple[bytes, frozenset[bytes]]] = {}  # name -> (its summary, decoded)
        self._holders: dict[bytes, set[str]] = {}  # summary key -> the replicas holding it
        # name -> the incarnation last listed, kept while the replica is unlisted: a restart that
        # re-registers after its dead incarnation left the listing still gets a clean slate
        self._incarnations: dict[str, str] = {}
        self._lock = threading.Lock()

    def update(self, endpoints: list[Endpoint]) -> None:
        with self._lock:
            live = {e.name: e for e in endpoints if e.takes_work}
            self._names = {e.address: e.name for e in endpoints}
            for endpoint in endpoints:
                known = self._incarnations.get(endpoint.name)
                if known is not None and known != endpoint.incarnation:
                    # a restarted replica: a clean slate (its dead incarnation's breaker could
                    # otherwise keep it out for up to Breaker.max_s after it is back)
                    self._breakers.pop(endpoint.name, None)
                    self._stranded.pop(endpoint.name, None)
                self._incarnations[endpoint.name] = endpoint.incarnation
            for name, endpoint in live.items():
                summary = endpoint.load.prefix_summary
                if self._held.get(name, (None,))[0] != summary:
                    self._hold(name, summary)
            self._live = live
            for name in [n for n in self._held if n not in live]:
                self._hold(name, None)

    def _hold(self, name: str, summary: bytes | None) -> None:
        """Record ``name``'s prefix summary (None: forget it), in the index from key to holders too."""
        _, old = self._held.pop(name, (b"", frozenset()))
        new = prefix.decode_summary(summary) if summary is not None else frozenset()
        for key in old - new:
            holding = self._holders[key]
            holding.discard(name)
            if not holding:
                del self._holders[key]
        for key in new - old:
            self._holders.setdefault(key, set()).add(name)
        if summary is not None:
            self._held[name] = (summary, new)

    def note_stored(self, address: str, keys: bytes) -> None:
        """The replica at ``address`` said in its reply that it stored these prefix snapshots
        (summary keys, ``epd.prefix.summary_key``): it holds them from now on, not from its next
        report (0.1-0.35 s later, more on a loaded machine, often after the conversation's next
        turn was routed). Its next changed report replaces what it is known to hold, these included
        if it still holds them."""
        if not keys:
            return
        with self._lock:
            name = next((n for n, e in self._live.items() if e.address == address), None)
            if name is None:
                return
            summary, held = self._held.get(name, (b"", frozenset()))
            added = prefix.decode_summary(keys) - held
            if not added:
                return
            self._held[name] = (summary, held | added)  # the same summary: an unchanged report keeps them
            for key in added:
                self._holders.setdefault(key, set()).add(name)

    def pick(self, exclude: set[str] | frozenset[str] = frozenset(),
             route: routing.Route | None = None) -> tuple[str, Endpoint]:
        """The allowed replica with the fewest calls in flight (ties: the one picked least
        recently), or the one ``route`` chooses among the allowed ones in that order; a routed
        call's work counts against its replica until ``release``."""
        now = time.monotonic()
        with self._lock:
            allowed = [n for n in self._live if n not in exclude and self._breaker(n).allows(now)]
            if not allowed:
                raise errors.Unavailable(self._none_left(exclude), downstream=True)
            allowed.sort(key=lambda n: (self._outstanding.get(n, 0), self._last_pick.get(n, -1)))
            name = allowed[0]
            if route is not None:
                choice = route.choose([self._replica(n) for n in allowed], self._holders)
                name = choice.replica.name
                self._sent_tokens[name] = self._sent_tokens.get(name, 0) + choice.work_tokens
            self._breaker(name).begin()
            self._outstanding[name] = self._outstanding.get(name, 0) + 1
            self._picks += 1
            self._last_pick[name] = self._picks
            return name, self._live[name]

    def hold(self, address: str) -> str | None:
        """A call starts to the replica at ``address`` that an earlier ``pick`` chose (a follow-up
        on the same replica): counted in flight like a picked call, so a drain waits for it too.
        Returns the replica's name for ``release``, or None when the registry no longer lists it."""
        with self._lock:
            name = self._names.get(address)
            if name is not None:
                self._breaker(name).begin()
                self._outstanding[name] = self._outstanding.get(name, 0) + 1
            return name

    def _replica(self, name: str) -> routing.Replica:
        load = self._live[name].load
        return routing.Replica(name, self._outstanding.get(name, 0), self._sent_tokens.get(name, 0),
                               load.queued_tokens, load.prefix_block_size, self._held.get(name, (b"", frozenset()))[1],
                               load.free_kv_tokens, load.num_waiting)

    def block_sizes(self) -> set[int]:
        """The prefix block sizes the replicas that take work report (0: none told)."""
        with self._lock:
            return {e.load.prefix_block_size for e in self._live.values()}

    def replicas(self) -> list[routing.Replica]:
        """Every replica that takes work, as a route sees it (status and tests read this)."""
        with self._lock:
            return [self._replica(n) for n in self._live]

    def same_incarnation(self, tried: dict[str, str]) -> set[str]:
        """The names in ``tried`` (name -> incarnation) whose replica is still that incarnation: a
        replica Ray restarted since it failed may be tried again."""
        with self._lock:
            return {name for name, incarnation in tried.items()
                    if name not in self._live or self._live[name].incarnation == incarnation}

    WAIT_POLL_S = 0.2  # how often a call waiting for a replica looks again

    async def pick_or_wait(self, tried: dict[str, str], until: float, wait: bool = True,
                           route: routing.Route | None = None) -> tuple[str, Endpoint]:
        """``pick`` passing over the replicas in ``tried`` (name -> the incarnation that failed this
        call) that are still that incarnation. When none is left (the only one died), and ``wait``,
        look again every ``WAIT_POLL_S`` until one is, a restarted replica included (a new
        incarnation), or until ``until`` (``time.monotonic()``): a lone replica's restart is a
        pause. Raises ``errors.Unavailable`` when none is left in time."""
        while True:
            try:
                return self.pick(exclude=self.same_incarnation(tried), route=route)
            except errors.Unavailable:
                left = until - time.monotonic()
                if left <= 0 or not wait:
                    raise
                await asyncio.sleep(min(self.WAIT_POLL_S, left))

    def any_allowed(self, exclude: set[str] | frozenset[str] = frozenset()) -> bool:
        """Whether ``pick(exclude)`` would find a replica (without picking it)."""
        now = time.monotonic()
        with self._lock:
            return any(n not in exclude and self._breaker(n).allows(now) for n in self._live)

    def release(self, name: str, ok: bool | None, work_tokens: int = 0) -> None:
        """The call to ``name`` ended: ``ok`` True/False is the replica's own verdict (a client
        error or a downstream failure is ``None``: neutral); ``work_tokens``: what its route
        counted against the replica at ``pick``."""
        now = time.monotonic()
        with self._lock:
            self._outstanding[name] -= 1
            if work_tokens:
                self._sent_tokens[name] -= work_tokens
            breaker = self._breaker(name)
            breaker.end(ok, now)
            if ok:
                self._stranded.pop(name, None)
            if ok is False:
                log.warning("%s %s failed; out of rotation for %.1f s", self.role, name, breaker.retry_at - now)

    def suspect(self, name: str) -> bool:
        """The replica failed lately (a call to it now is the trial that decides)."""
        with self._lock:
            return not self._breaker(name).closed

    def num_available(self) -> int:
        """Replicas that would take a call now and, as far as their last answer tells, could
        serve it (health reports read this)."""
        now = time.monotonic()
        with self._lock:
            return sum(self._breaker(n).allows(now) and now - self._stranded.get(n, -STRANDED_S) >= STRANDED_S
                       for n in self._live)

    def stranded(self, name: str) -> None:
        """``name`` answered that nothing behind it serves (UNAVAILABLE from downstream): it is
        not at fault and stays in rotation, but for ``STRANDED_S`` (or until it next answers)
        it does not count as available, so health tells the truth in the seconds before the
        controller's probes see the dead replica behind it. A time limit, not a latch: a router
        that no traffic reaches must not report NOT_SERVING for ever."""
        with self._lock:
            self._stranded[name] = time.monotonic()

    def outstanding(self) -> dict[str, int]:
        with self._lock:
            return {name: count for name, count in self._outstanding.items() if count}

    def capacity_tokens(self) -> int:
        """The smallest K/V pool (in tokens) among the replicas that take work and said theirs; 0:
        none did. A request must fit whichever replica it lands on."""
        with self._lock:
            known = [e.capacity_tokens for e in self._live.values() if e.capacity_tokens]
        return min(known, default=0)

    def _breaker(self, name: str) -> Breaker:
        breaker = self._breakers.get(name)
        if breaker is None:
            breaker = self._breakers[name] = Breaker()
        return breaker

    def _none_left(self, exclude) -> str:
        if not self._live:
            return f"{self.role}: no healthy {self.role} replica is registered"
        if exclude:
            return f"{self.role}: every {self.role} replica failed this request ({len(exclude)} tried)"
        return f"{self.role}: every {self.role} replica is failing; retrying them shortly"


class Targets:
    """A role's replicas from the registry, as an asyncio caller sees them: ``call`` sends to the
    least busy allowed replica and tries the others when the replica itself fails."""

    def __init__(self, role: str, make_stub: Callable[[grpc.aio.Channel], object], context: RoleContext,
                 transport: rpc.Transport, wait_s: float = 0.0) -> None:
        self.role = role
        self.wait_s = wait_s  # how long a call waits for a replica when none is left
        self.balancer = Balancer(role)
        self.stubs = rpc.StubCache(make_stub, transport)
        self._metadata = transport.metadata
        self._watch = RegistryWatch(context.registry, role, context.name, self.balancer.update, context.poll_s,
                                    self.balancer.outstanding, context.refill_grace_s)

    @property
    def metadata(self) -> tuple:
        """What every call to this role sends: the transport's token, and the current request's id
        (``epd.logs.with_request_id``), so a direct stub call carries it as ``call`` does."""
        return logs.with_request_id(self._metadata)

    async def call(self, method: str, request_or_factory, timeout: float | None, retry: bool = True,
                   busy_next: bool = False, route: routing.Route | None = None):
        """``await stub.<method>(request)`` on one replica after another until one answers; returns
        (reply, address). ``request_or_factory`` may be a callable that makes the request anew for
        each attempt (a client stream). ``busy_next``: a replica that answers RESOURCE_EXHAUSTED
        (full, not broken) is passed over for the next one too; when every one is full the last
        answer is raised. When no replica is left (the only one died), the call waits up to
        ``wait_s`` (and its timeout) for one to come back, a restarted replica included (it has a
        new incarnation, so having failed before does not rule it out): a lone replica's restart is
        a pause. Raises ``RpcFailure`` with the status (hop-prefixed) when the call fails for
        another reason, or ``errors.Unavailable`` when no replica is left in time. ``route``: each
        attempt's replica is the one it chooses (``Balancer.pick``)."""
        tried: dict[str, str] = {}  # name -> the incarnation that failed this call
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        give_up = min(start + self.wait_s, deadline if deadline is not None else float("inf"))
        while True:
            name, endpoint = await self.balancer.pick_or_wait(tried, give_up, wait=not tried or retry, route=route)
            address = endpoint.address
            ok = None
            try:
                request = request_or_factory() if callable(request_or_factory) else request_or_factory
                remaining = None if deadline is None else max(0.05, deadline - time.monotonic())
                reply = await getattr(self.stubs.get(address), method)(
                    request, timeout=remaining, metadata=self.metadata)  # token and request id
                ok = True
                return reply, address
            except grpc.aio.AioRpcError as error:
                if error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and busy_next:
                    # Full, not failing: another replica may have room (neutral for the breaker).
                    tried[name] = endpoint.incarnation
                    if self.balancer.any_allowed(exclude=self.balancer.same_incarnation(tried)):
                        continue
                    raise rpc.RpcFailure.from_rpc_error(error, self.role) from None
                if not rpc.peer_failed(error):
                    if error.code() is grpc.StatusCode.UNAVAILABLE:
                        self.balancer.stranded(name)
                    raise rpc.RpcFailure.from_rpc_error(error, self.role) from None
                ok = False
                tried[name] = endpoint.incarnation
                if not retry:
                    raise rpc.RpcFailure.from_rpc_error(error, self.role) from None
                log.warning("%s %s at %s failed (%s); trying another", self.role, name, address, error.details())
            finally:
                self.balancer.release(name, ok, route.chosen.work_tokens if route is not None else 0)

    async def call_at(self, address: str, method: str, request, timeout: float | None):
        """``method`` on the replica at ``address``, which an earlier ``call`` chose (a
        reservation's follow-up): never sent elsewhere, but counted in flight and judged by the
        breaker as ``call``'s are. Raises the ``grpc.aio.AioRpcError`` for the caller to judge."""
        name = self.balancer.hold(address)
        ok = None
        try:
            reply = await getattr(self.stubs.get(address), method)(request, timeout=timeout, metadata=self.metadata)
            ok = True
            return reply
        except grpc.aio.AioRpcError as error:
            if rpc.peer_failed(error):
                ok = False
            raise
        finally:
            if name is not None:
                self.balancer.release(name, ok)

    def close(self) -> None:
        self._watch.close()


def encoder_targets(context: RoleContext, transport: rpc.Transport, wait_s: float = 0.0) -> Targets:
    """The Encoder service(s), as the router calls them."""
    return Targets("encode", epd_pb2_grpc.EncoderStub, context, transport, wait_s)


def prefill_targets(context: RoleContext, transport: rpc.Transport, wait_s: float = 0.0) -> Targets:
    return Targets("prefill", epd_pb2_grpc.PrefillStub, context, transport, wait_s)


def decode_targets(context: RoleContext, transport: rpc.Transport, wait_s: float = 0.0) -> Targets:
    return Targets("decode", epd_pb2_grpc.DecodeStub, context, transport, wait_s)


async def drop_handoff(decode: Targets, address: str, request_id: str, timeout_s: float = 10.0) -> None:
    """Claim the handed-off request ``request_id`` at the decode worker at ``address`` and drop it
    at once: its slot and K/V blocks are freed now, not when its lease runs out. For a handoff no
    stream will ever claim (its client left while it was handed off, or a stop string in its first
    token). Nothing happens where the request is not held."""
    call = decode.stubs.get(address).Stream(epd_pb2.StreamRequest(request_id=request_id), timeout=timeout_s,
                                            metadata=decode.metadata)
    try:
        await call.read()  # the claim has reached decode once anything comes back
    except grpc.aio.AioRpcError:
        pass  # already gone (finished, dropped, never arrived): nothing to free
    finally:
        call.cancel()


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
