"""One deployment on a Ray cluster: the controller that places, watches, replaces, scales and
autoscales the roles.

``Controller`` is a Ray actor (named ``controller`` in the deployment's namespace; detached for
``epd deploy``; Ray restarts it if its process dies). Every role replica and the ``Registry`` are
detached actors with restarts of their own, so serving goes on while the controller is away:
replicas keep serving and callers keep their last view of the registry. A restarted controller
adopts the replicas it finds (by name) and carries on.

Each role actor asks Ray for the resources its role is given in the deploy file
(``deploy/roles.toml``): custom resources or GPUs decide which nodes take which role; nothing in
the code names a node. Each replica registers itself in the registry once it serves.

The reconcile loop (every ``probe_interval_s``) probes every replica (``control.fleet`` says
what each probe means): a replica that stops answering is marked unhealthy in the registry (its
callers' breakers have usually routed around it already), Ray restarts its process (it registers
its new address), and one that Ray reports dead for good is removed and replaced, so each role
keeps its declared count. Scaling down drains: the registry marks the replica draining, every
consumer acknowledges it and has no call to it on the way, the replica finishes what it holds,
and only then is it stopped. Shutting down drains the routers first (``drain_routers``).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import ray
from grpc_health.v1 import health_pb2

from control.autoscale import AutoscalePolicy, Decision
from control.fleet import DeploymentFailed, Fleet, Probe, StartFailures, unplaced  # noqa: F401 - DeploymentFailed for callers
from epd import discovery, rpc
from epd.config import ROLES, DeployConfig

log = logging.getLogger(__name__)

CONTROLLER_NAME = "controller"
ROLE_ACTORS = {
    "encoder": "encode_svc.engine:EncoderEngine",
    "encode": "encode_svc.server:EncodeServer",
    "prefill": "prefill_svc.server:PrefillServer",
    "decode": "decode_svc.server:DecodeServer",
    "router": "router_svc.server:RouterServer",
}
"""The class each role's replicas run as: every one takes ``(ServeConfig, RoleContext)``."""
REPLICA_NAME = re.compile(rf"^({'|'.join(ROLES)})-(\d+)$")
MAX_RESTARTS = DeployConfig.max_restarts
"""The default of ``DeployConfig.max_restarts`` (Ray restarts a dead replica's process this many
times; after that the controller replaces it)."""


class Controller:
    """Places the roles, keeps them healthy and counted, scales on request, autoscales encoders."""

    def __init__(self, config: DeployConfig) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.config = config
        self.registry = ray.remote(discovery.Registry).options(
            name=discovery.REGISTRY_NAME, lifetime="detached", get_if_exists=True, max_restarts=-1,
            max_task_retries=-1, num_cpus=0, scheduling_strategy=_here()).remote(config.heartbeat_s)
        self.fleet = Fleet()
        self._registry_epoch = ("", 0.0)  # the registry's epoch, and when this controller first saw it
        self._handles: dict[str, ray.actor.ActorHandle] = {}
        self._desired = {role: config.replicas(role) for role in ROLES}
        self._lock = threading.RLock()
        self._role_locks = {role: threading.Lock() for role in ROLES}
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._probes = ThreadPoolExecutor(8, thread_name_prefix="probe")
        self._internal = rpc.internal_transport(config.serve.security)  # how the probes reach internal servers
        self.decisions: list[dict] = []
        self.unplaced: list[dict] = []  # replicas Ray cannot place now, by role, with why (control.fleet.unplaced)
        self._fixed_ports_holder = ""  # the router given the configured --port / --http-port
        # Replicas whose constructor raised (Ray does not restart those): name -> the error's last
        # line. A role whose new replicas fail so ``max_start_failures`` times in a row will not
        # get better by trying again: with none of it serving the deployment stops with why, else
        # no more of it are started (``control.fleet.StartFailures``).
        self._init_failed: dict[str, str] = {}
        self._start_failures = StartFailures(config.max_start_failures)
        self.failed = ""  # why the deployment stopped itself ("" while it runs)
        self.metrics = _Metrics(self._host_for_metrics(), config.metrics_port, self)
        self._adopt()
        self._threads = [threading.Thread(target=self._reconcile_loop, name="reconcile", daemon=True)]
        if config.autoscale.enabled:
            self._threads.append(threading.Thread(target=self._autoscale_loop, name="autoscaler", daemon=True))
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> list[str]:
        """Wait until every role has its replicas serving; returns the routers' addresses."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while not all(self.fleet.healthy_count(role) >= self._desired[role] for role in ROLES):
            if self.failed:
                raise DeploymentFailed(self.failed)
            for role, why in list(self._start_failures.holding.items()):
                if self.fleet.healthy_count(role) < self._desired[role]:  # starting: cannot reach its count
                    raise DeploymentFailed(why)
            if time.monotonic() > deadline:
                missing = {r: self._desired[r] - self.fleet.healthy_count(r) for r in ROLES
                           if self.fleet.healthy_count(r) < self._desired[r]}
                raise TimeoutError(f"replicas not serving after {self.config.start_timeout_s:.0f}s: {missing}")
            time.sleep(0.2)
        return self.router_addresses()

    def drain_routers(self, timeout_s: float | None = None) -> dict:
        """Graceful shutdown's first step: every router stops taking requests and finishes (or,
        after ``timeout_s``, by default the deployment's ``drain_timeout_s``, cuts) the ones it carries.
        Reconciling and autoscaling stop first: a router that says NOT_SERVING now is leaving, not failing."""
        self._stop.set()
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            routers = [h for n, h in self._handles.items() if n.startswith("router-")]
        results = ray.get([h.drain.remote(timeout_s) for h in routers], timeout=timeout_s + 60)
        totals = {key: sum(r[key] for r in results) for key in ("in_flight", "finished", "cut")}
        log.info("routers drained: %s", totals)
        return totals

    def shutdown(self) -> None:
        """Kill every role actor (routers first) and the registry."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        for role in ("router", "prefill", "decode", "encode", "encoder"):
            with self._lock:
                names = [n for n in self._handles if n.startswith(role + "-")]
            for name in names:
                self._kill(name)
        ray.kill(self.registry, no_restart=True)
        self._probes.shutdown(wait=False)
        self.metrics.close()

    # ------------------------------------------------------------ queries

    def router_addresses(self) -> list[str]:
        """The serving routers' gRPC addresses, oldest first (the first holds the configured ports)."""
        return [e.address for e in self._routers()]

    def http_addresses(self) -> list[str]:
        """The routers' OpenAI-compatible HTTP fronts (none unless the deployment has ``--http-port``)."""
        return [e.http_address for e in self._routers() if e.http_address]

    def _routers(self) -> list[discovery.Endpoint]:
        return sorted((e for e in self._endpoints() if e.role == "router" and e.takes_work), key=lambda e: _seq_of(e.name))

    def status(self) -> dict:
        """Replicas per role (name, address, node, health), their life events, autoscaling."""
        roles: dict[str, list] = {role: [] for role in ROLES}
        registered = {e.name: e for e in self._endpoints()}
        node_ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        with self._lock:
            replicas = list(self.fleet.replicas.values())
        waiting = {name for entry in self.unplaced if entry["count"] == len(entry["replicas"])
                   for name in entry["replicas"]}
        in_flight = self._work_in_flight()
        kv = self._kv_usage()
        for replica in replicas:
            e = registered.get(replica.name)
            roles[replica.role].append({
                "name": replica.name, "address": e.address if e else "", "node_id": e.node_id if e else "",
                "node_ip": node_ips.get(e.node_id, "") if e else "", "pid": e.pid if e else 0,
                "http_address": e.http_address if e else "",
                "draining": bool(e and e.draining), "healthy": replica.healthy,
                "in_flight": in_flight.get(replica.name),
                **({"kv": kv[replica.name]} if replica.name in kv else {}),
                "state": "unplaced" if replica.name in waiting else _state(replica)})
        counts = {role: {kind: self.fleet.count(role, kind) for kind in ("died", "restarted", "replaced", "unhealthy",
                                                                              "recovered")}
                  for role in ROLES}
        return {"namespace": self.config.namespace, "time": time.time(), "roles": roles, "desired": dict(self._desired),
                "metrics": self.metrics.address, "events": self.fleet.recent(100), "counts": counts,
                "failed": self.failed, "not_replacing": dict(self._start_failures.holding),
                "unplaced": list(self.unplaced),
                "autoscale": {"enabled": self.config.autoscale.enabled,
                              "min_replicas": self.config.autoscale.min_replicas,
                              "max_replicas": self.config.autoscale.max_replicas},
                "decisions": list(self.decisions[-50:])}

    def failure(self) -> str:
        """Why the deployment stopped itself ("" while it runs): `epd serve` watches this."""
        return self.failed

    def num_replicas(self, role: str) -> int:
        with self._lock:
            return sum(r.role == role for r in self.fleet.replicas.values())

    # ------------------------------------------------------------ scaling

    def scale(self, role: str, count: int) -> int:
        """Set ``role``'s replica count (``epd scale``); returns the count once reached."""
        if role not in ROLES:
            raise ValueError(f"cannot scale {role!r}; roles are {', '.join(ROLES)}")
        if role == "encoder" and self.config.autoscale.enabled:
            raise ValueError("encoders are autoscaled between "
                             f"{self.config.autoscale.min_replicas} and {self.config.autoscale.max_replicas}; "
                             "redeploy without autoscaling to set their count by hand")
        if not 1 <= count <= 256:
            raise ValueError(f"replica count must be in [1, 256], got {count}")
        return self._scale(role, count)

    def _scale(self, role: str, count: int) -> int:
        with self._role_locks[role]:
            with self._lock:
                self._desired[role] = count
                names = sorted((n for n, r in self.fleet.replicas.items() if r.role == role), key=_seq_of)
            if count < len(names):
                self._remove(role, names[count - len(names):])  # the newest go first
            else:
                with self._lock:  # asked again: try again
                    self._start_failures.reset(role)
                self._fill(role)
                deadline = time.monotonic() + self.config.start_timeout_s
                while self.fleet.healthy_count(role) < count and time.monotonic() < deadline:
                    if self.failed or role in self._start_failures.holding:
                        raise RuntimeError(self.failed or self._start_failures.holding[role])
                    time.sleep(0.2)
            return self.num_replicas(role)

    def _fill(self, role: str, replaces: str = "", dead_at: float = 0.0) -> None:
        """Start replicas until ``role`` has its desired count (they register when they serve)."""
        with self._lock:
            missing = self._desired[role] - sum(r.role == role for r in self.fleet.replicas.values())
            for _ in range(missing):
                name = f"{role}-{next(self._seq)}"
                self._handles[name] = self._create(role, name)
                self.fleet.add(name, role, time.monotonic(), replaces=replaces, replaces_dead_at=dead_at)
                log.info("%s %s starting%s", role, name, f" (replaces {replaces})" if replaces else "")

    def _create(self, role: str, name: str) -> ray.actor.ActorHandle:
        module, _, cls_name = ROLE_ACTORS[role].partition(":")
        cls = getattr(importlib.import_module(module), cls_name)
        cfg = self.config
        # Detached: a replica outlives the controller (serving goes on while it is away). Ray
        # restarts a dead process; callers retry elsewhere, so Ray must not retry tasks on it.
        # SPREAD: Ray's default policy packs zero-CPU actors onto the first node that has their
        # custom resources, so every replica of every role sat on one worker and losing that
        # machine lost them all; SPREAD deals them out over the nodes that offer the resources.
        actor_options = cls.actor_options(cfg.serve) if hasattr(cls, "actor_options") else {}
        options = {**actor_options, **cfg.role_resources(role).ray_options(), "name": name,
                   "lifetime": "detached", "max_restarts": cfg.max_restarts, "max_task_retries": 0,
                   "scheduling_strategy": "SPREAD"}
        context = discovery.RoleContext(name=name, host=self._bind_host(role), registry=self.registry,
                                        poll_s=cfg.poll_s, heartbeat_s=cfg.heartbeat_s,
                                        refill_grace_s=cfg.refill_grace_s)
        serve = self._router_serve(name) if role == "router" else cfg.serve
        return ray.remote(cls).options(**options).remote(serve, context)

    def _router_serve(self, name: str):
        """The config router ``name`` runs with: the configured gRPC, HTTP and metrics ports go to one
        router at a time (the first, or the one that replaces it); every other router takes free gRPC
        and HTTP ports and serves its metrics on its HTTP front's /metrics only."""
        serve = self.config.serve
        if not serve.router.port and not serve.http.port and not serve.router.metrics_port:
            return serve
        if self._fixed_ports_holder not in self._handles:  # nobody holds them (never, or it died)
            self._fixed_ports_holder = name
            return serve
        http = replace(serve.http, port=0) if serve.http.port is not None else serve.http
        return replace(serve, router=replace(serve.router, port=0, metrics_port=0), http=http)

    def _bind_host(self, role: str) -> str:
        """Loopback on one machine; the node's IP on a cluster (roles on other nodes must reach
        it). The router binds ``--host`` when one was given."""
        router_host = self.config.serve.router.host
        if role == "router" and (self.config.bind == "loopback" or router_host != "127.0.0.1"):
            return router_host
        return rpc.NODE_ADDRESS if self.config.bind == "node" else "127.0.0.1"

    def _remove(self, role: str, names: list[str]) -> None:
        """Drain ``names``: no new work, every consumer has stopped picking them and has no call
        to them on the way, they finish what they hold, then they stop."""
        timeout = self.config.scale_drain_timeout_s
        deadline = time.monotonic() + timeout
        version = max(ray.get([self.registry.drain.remote(name) for name in names]))
        for name in names:
            # The watchers of this role (the Encoder services for encoders, routers for encode and
            # prefill, routers and prefill for decode) must have applied the drain and finished
            # the calls they had picked it for, before "idle" means "done".
            if not discovery.wait_until(lambda: ray.get(self.registry.acked.remote(role, version, name)),
                                        max(0.0, deadline - time.monotonic())):
                log.warning("%s %s: not every consumer acknowledged the drain in %.0fs; removing anyway",
                            role, name, timeout)
            if not discovery.wait_until(lambda: self._held(role, name) == 0, max(0.0, deadline - time.monotonic())):
                log.warning("%s %s still held work after %.0fs; removing it anyway", role, name, timeout)
            if role != "encoder":
                try:
                    ray.get(self._handles[name].stop.remote(), timeout=30)
                except Exception as error:  # noqa: BLE001 - it is going away either way
                    log.warning("%s %s did not stop cleanly: %s", role, name, error)
            self._kill(name, reason="scaled down")
            log.info("%s %s drained and left", role, name)

    def _held(self, role: str, name: str) -> int:
        """Work the replica still holds: images queued for it at the Encoder services, or calls
        (and, for decode, requests) its server is still running."""
        if role == "encoder":
            with self._lock:
                services = [h for n, h in self._handles.items() if n.startswith("encode-")]
            return sum(ray.get([s.outstanding.remote(name) for s in services], timeout=30))
        return ray.get(self._handles[name].in_flight.remote(), timeout=30)

    def _work_in_flight(self) -> dict[str, int]:
        """The requests each replica works on now (an encoder's: images queued for it or running),
        asked of every replica at once; one that does not answer within ``status_wait_s`` is left out."""
        with self._lock:
            handles = dict(self._handles)
        services = [h for n, h in handles.items() if n.startswith("encode-")]
        asked: dict[str, list] = {}
        for name, handle in handles.items():
            asked[name] = ([s.outstanding.remote(name) for s in services] if name.startswith("encoder-")
                           else [handle.requests.remote()])
        refs = [ref for parts in asked.values() for ref in parts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.status_wait_s)
        answered = set(ready)
        found: dict[str, int] = {}
        for name, parts in asked.items():
            if not all(ref in answered for ref in parts):
                continue
            try:
                found[name] = sum(ray.get(parts, timeout=0))
            except Exception:  # noqa: BLE001 - restarting or gone: status says nothing of its work
                pass
        return found

    def _kv_usage(self) -> dict[str, dict]:
        """Each decode replica's K/V pool now (``DecodeServer.kv_usage``), asked of all at once;
        one that does not answer within ``status_wait_s`` is left out."""
        with self._lock:
            refs = {name: handle.kv_usage.remote() for name, handle in self._handles.items()
                    if name.startswith("decode-")}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.config.status_wait_s)
        found = {}
        for name, ref in refs.items():
            if ref in ready:
                try:
                    found[name] = ray.get(ref, timeout=0)
                except Exception:  # noqa: BLE001 - restarting or gone: status says nothing of its memory
                    pass
        return found

    def _kill(self, name: str, reason: str = "") -> None:
        with self._lock:
            handle = self._handles.pop(name, None)
            self.fleet.remove(name, time.monotonic(), reason)
        if handle is not None:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        try:
            ray.get(self.registry.remove.remote(name), timeout=30)
        except Exception as error:  # noqa: BLE001 - the registry forgets it when it restarts anyway
            log.warning("registry did not take the removal of %s: %s", name, error)

    # ------------------------------------------------------------ reconciliation

    def _adopt(self) -> None:
        """After a restart of the controller: take over the replicas that are still there, and
        their count as the desired one (a fresh deployment finds none and starts from the config)."""
        found: dict[str, list[str]] = {role: [] for role in ROLES}
        for name in ray.util.list_named_actors():
            match = REPLICA_NAME.match(name)
            if match:
                found[match.group(1)].append(name)
        seq = 0
        ports = {str(self.config.serve.router.port or ""), str(self.config.serve.http.port or "")} - {""}
        if found["router"] and ports:
            try:
                self._fixed_ports_holder = next((e.name for e in self._endpoints() if e.role == "router" and (
                    e.address.rsplit(":", 1)[-1] in ports or e.http_address.rsplit(":", 1)[-1] in ports)), "")
            except Exception:  # noqa: BLE001 - the registry is restarting too: a later router may double up
                pass
        for role, names in found.items():
            for name in names:
                try:
                    self._handles[name] = ray.get_actor(name)
                except ValueError:
                    continue
                self.fleet.add(name, role, time.monotonic())
                seq = max(seq, _seq_of(name) + 1)
            if names:
                self._desired[role] = len(names)
        self._seq = itertools.count(seq)
        if any(found.values()):
            log.info("adopted %s", {role: len(names) for role, names in found.items()})

    def _reconcile_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._reconcile()
            except Exception:  # noqa: BLE001 - one failed round must not stop the watching
                log.exception("reconcile round failed")
            self._stop.wait(self.config.probe_interval_s)

    def _reconcile(self) -> None:
        view = ray.get(self.registry.snapshot.remote(), timeout=30)
        if view.epoch != self._registry_epoch[0]:
            self._registry_epoch = (view.epoch, time.monotonic())
        refilling = time.monotonic() - self._registry_epoch[1] < self.config.refill_grace_s
        with self._lock:
            known = sum(r.registered for r in self.fleet.replicas.values())
        if (view.warming or refilling) and len(view.endpoints) < known:
            return  # a restarted registry is being refilled by heartbeats: judge nobody by it yet
        endpoints = {e.name: e for e in view.endpoints}
        with self._lock:
            names = list(self._handles.items())
        probes = list(self._probes.map(lambda item: self._probe(item[0], item[1], endpoints.get(item[0])), names))
        for (name, _), probe in zip(names, probes):
            endpoint = endpoints.get(name)
            with self._lock:
                events = self.fleet.observe(name, probe, endpoint.incarnation if endpoint else "", time.monotonic())
            for event in events:
                level = logging.INFO if event.kind in ("joined", "recovered") else logging.WARNING
                log.log(level, "%s %s %s%s", event.role, event.name, event.kind,
                        f" after {event.seconds:.1f}s" if event.seconds else "")
                if event.kind in ("joined", "replaced"):
                    self._start_failures.reset(event.role)
            # The registry's flag says whether the replica itself works: one that answers but says
            # NOT_SERVING (nothing behind it serves) stays in rotation, and its callers learn why.
            reachable = probe in (Probe.SERVING, Probe.NOT_SERVING)
            if endpoint is not None and endpoint.healthy != reachable and probe is not Probe.DEAD:
                self.registry.mark.remote(name, reachable, endpoint.incarnation)
            if probe is Probe.DEAD:
                role, dead_at = name.rsplit("-", 1)[0], time.monotonic()
                reason = self._init_failed.pop(name, "")
                self._kill(name, reason=f"its constructor failed: {reason}" if reason else "")
                if reason:
                    action, why = self._start_failures.failed(role, reason, self.fleet.healthy_count(role))
                    log.error("%s %s failed to start (%d in a row): %s", role, name,
                              self._start_failures.in_a_row[role], reason)
                    if action == "stop":  # none of the role serves: the deployment cannot serve
                        self._give_up(why)
                        return
                    if action == "hold":  # some still serve: keep them, start no more
                        log.error("%s; not starting more %s replicas (`epd scale` tries again)", why, role)
                        continue
                with self._role_locks[role]:
                    self._fill(role, replaces=name, dead_at=dead_at)
        for role in ROLES:
            if role in self._start_failures.holding:
                continue
            if self._role_locks[role].acquire(blocking=False):  # not while a scale of it is running
                try:
                    self._fill(role)
                finally:
                    self._role_locks[role].release()
        self._find_unplaced()
        self.metrics.refresh()

    def _give_up(self, reason: str) -> None:
        """Stop reconciling and replacing: the deployment has stopped itself. `epd serve` sees it
        (``failure``) and stops everything; `epd status` shows it; `epd down` removes what is left."""
        self.failed = reason
        self._stop.set()
        log.error("deployment stopped: %s", reason)

    def _find_unplaced(self) -> None:
        """While replicas are not serving, ask Ray's GCS what it cannot place (a lost machine was
        the only one offering a role's resources, or the remaining ones have them all in use) and
        say so in the log and ``epd status``. Ray keeps such a replica pending and places it when
        a node offers the resources; nothing else would tell the user it waits."""
        with self._lock:
            waiting = {role: [r.name for r in self.fleet.replicas.values() if r.role == role and not r.healthy]
                       for role in ROLES}
        found: list[dict] = []
        if any(waiting.values()):
            try:
                found = unplaced(_pending_demands(), {role: self._shape(role) for role in ROLES}, waiting,
                                 [n["Resources"] for n in ray.nodes() if n["Alive"]])
            except Exception as error:  # noqa: BLE001 - a report only; try again next round
                log.warning("cannot read Ray's pending demands: %s", error)
                return
        if found != self.unplaced:
            for entry in found:
                log.warning("%s: %d replica(s) cannot be placed (of %s, not serving): %s", "/".join(entry["roles"]),
                            entry["count"], ", ".join(entry["replicas"]), entry["reason"])
            if not found:
                log.info("every replica is placed")
            self.unplaced = found

    def _shape(self, role: str) -> dict[str, float]:
        """What one replica of ``role`` asks Ray for, as Ray's pending demands spell it."""
        resources = self.config.role_resources(role)
        return {**({"CPU": resources.num_cpus} if resources.num_cpus else {}),
                **({"GPU": resources.num_gpus} if resources.num_gpus else {}), **resources.resources}

    def _probe(self, name: str, handle, endpoint: discovery.Endpoint | None) -> Probe:
        """The serving path where there is one (gRPC health), else a call through Ray; when that
        fails, Ray tells whether the actor is gone for good."""
        if endpoint is not None and endpoint.address:
            status = self._health_status(name, handle, endpoint.address)
            if status is not None:
                return Probe.SERVING if status == health_pb2.HealthCheckResponse.SERVING else Probe.NOT_SERVING
        try:
            ray.get(handle.ping.remote(), timeout=self.config.probe_timeout_s)
        except ray.exceptions.ActorDiedError as error:
            if getattr(error, "actor_init_failed", False):
                self._init_failed[name] = _last_line(getattr(error, "error_msg", "") or str(error))
            return Probe.DEAD
        except Exception:  # noqa: BLE001 - restarting, still loading, or wedged
            return Probe.UNREACHABLE
        return Probe.SERVING if endpoint is not None and not endpoint.address else Probe.UNREACHABLE

    def _health_status(self, name: str, handle, address: str) -> int | None:
        """grpc.health.v1 of the replica's server. A router with a public TLS certificate is asked
        through Ray instead (its health computed on its serving loop): the controller holds no CA
        for the public certificate."""
        if not name.startswith("router-"):
            return rpc.health_status(address, timeout_s=self.config.probe_timeout_s, transport=self._internal)
        if not self.config.serve.security.tls_cert:
            return rpc.health_status(address, timeout_s=self.config.probe_timeout_s)
        try:
            serving = ray.get(handle.health.remote(), timeout=self.config.probe_timeout_s)
        except Exception:  # noqa: BLE001 - unreachable: the Ray call below tells dead from restarting
            return None
        return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING

    def _endpoints(self) -> list[discovery.Endpoint]:
        return ray.get(self.registry.snapshot.remote(), timeout=30).endpoints

    # ------------------------------------------------------------ autoscaling

    def _autoscale_loop(self) -> None:
        cfg = self.config.autoscale
        policy = AutoscalePolicy(cfg, time.monotonic())
        while not self._stop.wait(cfg.interval_s):
            try:
                with self._lock:
                    services = [h for n, h in self._handles.items() if n.startswith("encode-")]
                queued = sum(q for q, _ in ray.get([s.load.remote() for s in services], timeout=30))
                current = self.num_replicas("encoder")
                decision = policy.decide(current, queued, time.monotonic())
                self.metrics.observe(decision, policy.desired(queued))
                if decision.direction != "hold":
                    self._record(decision)
                    self._scale("encoder", decision.target)
            except Exception:  # noqa: BLE001 - one failed look must not stop autoscaling
                log.exception("autoscaler step failed")

    def _record(self, decision: Decision) -> None:
        entry = {"time": time.time(), "from": decision.current, "to": decision.target,
                 "direction": decision.direction, "queued": decision.queued, "reason": decision.reason}
        self.decisions.append(entry)
        del self.decisions[:-1000]
        log.info("autoscale encoders %d -> %d: %s", decision.current, decision.target, decision.reason)
        self.metrics.decision(decision)

    def _host_for_metrics(self) -> str:
        return ray.util.get_node_ip_address() if self.config.bind == "node" else "127.0.0.1"


def _last_line(text: str) -> str:
    """The exception line of a Ray task error's text (its traceback comes before it)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def _state(replica) -> str:
    if not replica.registered:
        return "starting"
    return "serving" if replica.healthy else replica.last_probe


def _pending_demands() -> list[tuple[dict[str, float], int]]:
    """What Ray's GCS has not placed yet, as it reports it to an autoscaler: (shape, count)."""
    from ray.autoscaler.v2.sdk import get_cluster_resource_state

    state = get_cluster_resource_state(ray._private.worker.global_worker.gcs_client)
    return [(dict(r.request.resources_bundle), r.count) for r in state.pending_resource_requests]


def _seq_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


class _Metrics:
    """The controller's Prometheus endpoint: replicas per role and their health, their deaths,
    restarts and replacements, and every autoscaling decision."""

    def __init__(self, host: str, port: int, controller: Controller) -> None:
        import prometheus_client as prom

        self.controller = controller
        self.registry = prom.CollectorRegistry()
        self._replicas = prom.Gauge("epd_replicas", "Replicas of each role", ["role"], registry=self.registry)
        self._healthy = prom.Gauge("epd_replicas_healthy", "Replicas of each role serving now", ["role"],
                                   registry=self.registry)
        self._events = prom.Gauge("epd_replica_events", "Replica life events since the controller started, by "
                                  "kind (died, restarted, replaced, unhealthy, recovered)", ["role", "kind"],
                                  registry=self.registry)
        self._unplaced = prom.Gauge("epd_replicas_unplaced", "Replicas Ray cannot place now (no alive node has "
                                    "their resources free); a role sharing its resource shape with another "
                                    "counts them too", ["role"], registry=self.registry)
        self._desired = prom.Gauge("epd_encoder_replicas_desired", "Encoder replicas the load asks for",
                                   registry=self.registry)
        self._queued = prom.Gauge("epd_encoder_images_in_flight", "Images queued or running at the encoders",
                                  registry=self.registry)
        self._decisions = prom.Counter("epd_autoscale_decisions", "Encoder autoscaling decisions", ["direction"],
                                       registry=self.registry)
        self._server, _ = prom.start_http_server(port, addr=host, registry=self.registry)
        self.address = f"{host}:{self._server.server_port}"

    def refresh(self) -> None:
        fleet = self.controller.fleet
        for role in ROLES:
            self._replicas.labels(role=role).set(self.controller.num_replicas(role))
            self._healthy.labels(role=role).set(fleet.healthy_count(role))
            for kind in ("died", "restarted", "replaced", "unhealthy", "recovered"):
                self._events.labels(role=role, kind=kind).set(fleet.count(role, kind))
            waiting = sum(e["count"] for e in self.controller.unplaced if role in e["roles"])
            self._unplaced.labels(role=role).set(waiting)

    def observe(self, decision: Decision, desired: int) -> None:
        self._desired.set(desired)
        self._queued.set(decision.queued)

    def decision(self, decision: Decision) -> None:
        self._decisions.labels(direction=decision.direction).inc()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ---------------------------------------------------------------- driver side


def controller_options(namespace: str, detached: bool) -> dict:
    options = {"name": CONTROLLER_NAME, "namespace": namespace, "num_cpus": 0, "max_concurrency": 16,
               "max_restarts": -1, "scheduling_strategy": _here()}
    if detached:
        options["lifetime"] = "detached"
    return options


def _here():
    """The control plane (controller, registry) stays on the node that deployed it: the head,
    where docs/DEPLOY.md runs `epd deploy`. Left to Ray, these zero-resource actors land on any
    node, a worker included (seen in tests/test_node_loss.py), and losing that machine would take
    the controller and the registry along with its replicas. Hard affinity: Ray's soft node
    affinity placed them on other nodes too; the price is that they cannot move if that node is
    lost, which for the head means the cluster (Ray's GCS) is lost anyway."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def create_controller(config: DeployConfig, detached: bool) -> ray.actor.ActorHandle:
    """Create the deployment's controller and wait for every role; returns the controller handle."""
    controller = ray.remote(Controller).options(**controller_options(config.namespace, detached)).remote(config)
    try:
        ray.get(controller.start.remote(), timeout=config.start_timeout_s + 60)
    except BaseException:
        stop_controller(controller)
        raise
    return controller


def stop_controller(controller, drain: bool = False) -> dict:
    """Stop the deployment; with ``drain``, let the routers finish the requests they carry first
    (returns what the drain did)."""
    drained: dict = {}
    if drain:
        try:
            drained = ray.get(controller.drain_routers.remote(), timeout=86400)
        except Exception as error:  # noqa: BLE001 - stop regardless
            log.warning("drain failed: %s", error)
    try:
        ray.get(controller.shutdown.remote(), timeout=120)
    except Exception as error:  # noqa: BLE001 - kill it regardless
        log.warning("controller shutdown failed: %s", error)
    ray.kill(controller, no_restart=True)
    return drained


def connect(address: str, namespace: str) -> ray.actor.ActorHandle:
    """Join a running cluster as a driver and find the deployment's controller."""
    ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, configure_logging=False,
             log_to_driver=False)
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        ray.shutdown()
        raise RuntimeError(f"no epd deployment in namespace {namespace!r} at {address}; run `epd deploy` first") from None


def placements(namespace: str, address: str | None = None) -> list[dict]:
    """Where each of the deployment's actors runs, from Ray's state API: name, state, node IP.

    ``address`` is the cluster's bootstrap address: name it whenever another Ray may run on this
    machine, or the state API cannot tell which cluster is meant."""
    from ray.util.state import list_actors, list_nodes

    nodes = {n.node_id: n for n in list_nodes(address=address, limit=10000)}
    rows = []
    for actor in list_actors(address=address, filters=[("ray_namespace", "=", namespace), ("state", "=", "ALIVE")],
                             limit=10000, detail=True):
        node = nodes.get(actor.node_id)
        rows.append({"name": actor.name, "class": actor.class_name, "node_id": actor.node_id,
                     "node_ip": node.node_ip if node else "",
                     "node_resources": dict(node.resources_total) if node else {}})
    return sorted(rows, key=lambda r: r["name"])
