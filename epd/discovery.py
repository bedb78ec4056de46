"""Discovery: which replicas of each role exist, where they listen, and which take new work.

A deployment has one ``Registry`` (a named Ray actor in the deployment's namespace). A replica is
registered once it is serving; one being removed is marked *draining* first, so its consumers stop
sending it work while it finishes what it holds, and is dropped from the registry when it exits.
Consumers (the Encoder service for encoder replicas, the router for the Encoder service and
prefill, prefill for decode) watch the registry with a ``RegistryWatch``: a thread that re-reads
it every ``poll_s`` and acknowledges the version it has seen, so whoever drains a replica knows
when no consumer will pick it again. Nothing is restarted when a replica joins or leaves.

``Balancer`` is the bookkeeping a consumer uses to pick an endpoint: the live one with the fewest
calls in flight. The ``*Targets`` classes are the gRPC faces of it that the router and prefill
take at construction.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import grpc

from epd import rpc
from epd.v1 import epd_pb2_grpc

log = logging.getLogger(__name__)

REGISTRY_NAME = "registry"


@dataclass(frozen=True)
class RoleContext:
    """What the controller tells every replica it starts, besides the deployment's config."""

    name: str
    """The replica's name, unique in the deployment (its Ray actor name, e.g. ``prefill-3``)."""
    host: str = "127.0.0.1"
    """Address its servers bind: an IP, or ``NODE_ADDRESS`` for the Ray node's own IP."""
    registry: object = None
    """The deployment's ``Registry`` actor handle (``epd.discovery``)."""
    poll_s: float = 0.25
    """How often its watchers re-read the registry."""


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
    handle: object = None
    """The Ray actor handle (encoder replicas are called through it)."""
    draining: bool = False
    """Being removed: it finishes what it holds but takes no new work."""


class Registry:
    """The deployment's directory of endpoints (wrapped in ``ray.remote`` by the controller).

    ``version`` grows with every change; watchers acknowledge the version they have applied, so
    ``acked(role, version)`` tells a drain when every consumer of ``role`` has stopped picking the
    draining replica.
    """

    def __init__(self) -> None:
        self._endpoints: dict[str, Endpoint] = {}
        self._version = 0
        self._acks: dict[str, tuple[str, int]] = {}  # watcher id -> (role watched, version seen)

    def register(self, endpoint: Endpoint) -> int:
        self._endpoints[endpoint.name] = endpoint
        return self._bump()

    def drain(self, name: str) -> int:
        endpoint = self._endpoints.get(name)
        if endpoint is not None:
            self._endpoints[name] = replace(endpoint, draining=True)
        return self._bump()

    def remove(self, name: str) -> int:
        self._endpoints.pop(name, None)
        # A removed replica's own watchers will never acknowledge again.
        for watcher in [w for w in self._acks if w.startswith(name + "/")]:
            del self._acks[watcher]
        return self._bump()

    def snapshot(self, watcher: str = "", role: str = "") -> tuple[int, list[Endpoint]]:
        """Every endpoint and the version; a watcher is known from its first read on, so a drain
        waits for it even before it has acknowledged anything."""
        if watcher:
            self._acks.setdefault(watcher, (role, -1))
        return self._version, list(self._endpoints.values())

    def ack(self, watcher: str, role: str, version: int) -> None:
        self._acks[watcher] = (role, version)

    def forget_watcher(self, watcher: str) -> None:
        self._acks.pop(watcher, None)

    def acked(self, role: str, version: int) -> bool:
        """Every watcher of ``role`` has applied ``version`` (or a later one)."""
        return all(seen >= version for watched, seen in self._acks.values() if watched == role)

    def _bump(self) -> int:
        self._version += 1
        return self._version


class RegistryWatch:
    """Keeps a consumer's view of one role current: calls ``on_change(endpoints)`` with the
    role's endpoints whenever the registry changed, then acknowledges the version."""

    def __init__(self, registry, role: str, watcher: str, on_change: Callable[[list[Endpoint]], None],
                 poll_s: float = 0.25) -> None:
        self.registry = registry
        self.role = role
        self.watcher = f"{watcher}/{role}"
        self.on_change = on_change
        self.poll_s = poll_s
        self.version = -1
        self._stop = threading.Event()
        self.sync()
        self._thread = threading.Thread(target=self._loop, name=f"watch-{role}", daemon=True)
        self._thread.start()

    def sync(self) -> int:
        import ray

        version, endpoints = ray.get(self.registry.snapshot.remote(self.watcher, self.role), timeout=30)
        if version != self.version:
            self.on_change([e for e in endpoints if e.role == self.role])
            self.version = version
        self.registry.ack.remote(self.watcher, self.role, version)
        return version

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.sync()
            except Exception as error:  # noqa: BLE001 - the registry is briefly away: keep the last view
                log.warning("registry watch for %s failed: %s", self.role, error)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self.registry.forget_watcher.remote(self.watcher)


class Balancer:
    """Bookkeeping only: the live endpoints of a role and the calls in flight to each.

    ``lease`` picks the live endpoint with the fewest calls in flight (ties go to the one used
    least recently), so concurrent calls spread over replicas. A draining endpoint keeps its
    in-flight count until those calls end but is never picked.
    """

    def __init__(self, role: str) -> None:
        self.role = role
        self._live: dict[str, str] = {}  # name -> address
        self._outstanding: dict[str, int] = {}
        self._last_pick: dict[str, int] = {}
        self._picks = 0
        self._lock = threading.Lock()

    def update(self, endpoints: list[Endpoint]) -> None:
        with self._lock:
            self._live = {e.name: e.address for e in endpoints if not e.draining}

    def pick(self) -> tuple[str, str]:
        with self._lock:
            if not self._live:
                raise rpc.RpcFailure(grpc.StatusCode.UNAVAILABLE, f"no {self.role} replica is registered")
            name = min(self._live, key=lambda n: (self._outstanding.get(n, 0), self._last_pick.get(n, -1)))
            self._outstanding[name] = self._outstanding.get(name, 0) + 1
            self._picks += 1
            self._last_pick[name] = self._picks
            return name, self._live[name]

    def release(self, name: str) -> None:
        with self._lock:
            self._outstanding[name] -= 1

    @contextlib.contextmanager
    def lease(self) -> Iterator[str]:
        name, address = self.pick()
        try:
            yield address
        finally:
            self.release(name)

    def outstanding(self) -> dict[str, int]:
        with self._lock:
            return dict(self._outstanding)


class _Targets:
    """A role's endpoints from the registry, balanced, with one gRPC stub per address."""

    def __init__(self, role: str, make_stub: Callable[[grpc.Channel], object], context: RoleContext) -> None:
        self.balancer = Balancer(role)
        self.stubs = rpc.StubCache(make_stub)
        self._watch = RegistryWatch(context.registry, role, context.name, self.balancer.update, context.poll_s)

    def close(self) -> None:
        self._watch.close()


class EncoderTargets(_Targets):
    """The Encoder service(s), as the router calls them: ``Encode`` goes to the least busy."""

    def __init__(self, context: RoleContext) -> None:
        super().__init__("encode", epd_pb2_grpc.EncoderStub, context)

    def Encode(self, request, timeout=None):  # noqa: N802 - the stub's method name
        with self.balancer.lease() as address:
            return self.stubs.get(address).Encode(request, timeout=timeout)


class PrefillTargets(_Targets):
    """The prefill replicas, as the router calls them: ``Prefill`` goes to the least busy."""

    def __init__(self, context: RoleContext) -> None:
        super().__init__("prefill", epd_pb2_grpc.PrefillStub, context)

    def Prefill(self, request, timeout=None):  # noqa: N802 - the stub's method name
        with self.balancer.lease() as address:
            return self.stubs.get(address).Prefill(request, timeout=timeout)


class DecodeTargets(_Targets):
    """The decode replicas, as prefill hands off to them: each handoff goes to the decode with
    the fewest handoffs in flight, and ``handoff`` says which one took it (the router streams
    the tokens from there)."""

    def __init__(self, context: RoleContext) -> None:
        super().__init__("decode", epd_pb2_grpc.DecodeStub, context)

    def handoff(self, chunks, timeout=None) -> str:
        with self.balancer.lease() as address:
            self.stubs.get(address).Handoff(chunks, timeout=timeout)
            return address


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
