"""One deployment on a Ray cluster: the controller that places, watches, replaces, scales and
autoscales the roles.

``Controller`` is a Ray actor (named ``controller`` in the deployment's namespace; detached for
``epd deploy``; Ray restarts it if its process dies). Every role replica and the ``Registry`` are
detached actors with restarts of their own, so serving goes on while the controller is away:
replicas keep serving and callers keep their last view of the registry. A restarted controller
adopts the replicas it finds (by name) and carries on.

Each replica registers itself in the registry once it serves. The controller's jobs, one module
each: where and how a replica starts (``control.placement``), asking a replica whether it serves
(``control.probing``; ``control.fleet`` says what the answers mean), what `epd status` reads
(``control.status``), the Prometheus endpoint (``control.metrics``), the encoder autoscaler's loop
(``control.autoscaler``, its policy in ``control.autoscale``). This module keeps the deployment's
lifecycle, the reconcile loop and scaling with drains, and the driver side (create, stop, connect).

The reconcile loop (every ``probe_interval_s``) probes every replica (``control.fleet`` says
what each probe means): a replica that stops answering is marked unhealthy in the registry (its
callers' breakers have usually routed around it already), Ray restarts its process (it registers
its new address), and one that Ray reports dead for good is removed and replaced, so each role
keeps its declared count. Scaling down drains: the registry marks the replica draining, every
consumer acknowledges it and has no call to it on the way, the replica finishes what it holds,
and only then is it stopped. Shutting down drains the routers first (``drain_routers``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray

from control import history, placement, status
from control.autoscaler import Autoscaler
from control.fleet import DeploymentFailed, Fleet, Probe, StartFailures  # noqa: F401 - DeploymentFailed for callers
from control.metrics import ControllerMetrics
from control.placement import REPLICA_NAME, ROLE_ACTORS, here, seq_of  # noqa: F401 - ROLE_ACTORS for callers
from control.probing import Prober
from epd import discovery
from epd.config import ROLES, DeployConfig

log = logging.getLogger(__name__)

CONTROLLER_NAME = "controller"
SERVING_LINE = "deployment ready"
"""Starts the controller's log line once every role has its replicas serving (after their "joined" lines)."""
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
            max_task_retries=-1, num_cpus=0, scheduling_strategy=here()).remote(config.heartbeat_s)
        self.fleet = Fleet()
        self._registry_epoch = ("", 0.0)  # the registry's epoch, and when this controller first saw it
        self._handles: dict[str, ray.actor.ActorHandle] = {}
        self._desired = {role: config.replicas(role) for role in ROLES}
        self._lock = threading.RLock()
        self._role_locks = {role: threading.Lock() for role in ROLES}
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._probes = ThreadPoolExecutor(8, thread_name_prefix="probe")
        self.prober = Prober(config)
        self.unplaced: list[dict] = []  # replicas Ray cannot place now, by role, with why (control.fleet.unplaced)
        self._fixed_ports_holder = ""  # the router given the configured --port / --http-port
        # A role whose new replicas' constructors raise (``Prober.init_failed``) ``max_start_failures``
        # times in a row will not get better by trying again: with none of it serving the deployment
        # stops with why, else no more of it are started (``control.fleet.StartFailures``).
        self._start_failures = StartFailures(config.max_start_failures)
        self.failed = ""  # why the deployment stopped itself ("" while it runs)
        self._all_serving = threading.Event()  # set once the round that saw every role serving has logged it
        self._adopt()
        # A restarted controller (it found the deployment's replicas) carries on the deployment's
        # history and serves its metrics on the same port; a fresh deployment starts both anew.
        saved = history.load(config.namespace) if self._handles else None
        self.since, self.controller_starts = time.time(), 1
        if saved:
            self.fleet.restore(saved)
            self.since, self.controller_starts = saved.get("since", self.since), saved.get("controller_starts", 0) + 1
            self.fleet.note("controller", CONTROLLER_NAME, "restarted", "adopted the running replicas")
            self._all_serving.set()  # it served before; `start` is for a new deployment
        self.metrics = self._serve_metrics(config.metrics_port or (saved or {}).get("metrics_port", 0))
        self._saved = None
        self._save_history()
        self.autoscaler = Autoscaler(config.autoscale, lambda: self._handles_of("encode"),
                                     lambda: self.num_replicas("encoder"), lambda n: self._scale("encoder", n),
                                     self.metrics, self._stop)
        self._threads = [threading.Thread(target=self._reconcile_loop, name="reconcile", daemon=True)]
        if config.autoscale.enabled:
            self._threads.append(threading.Thread(target=self.autoscaler.run, name="autoscaler", daemon=True))
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> list[str]:
        """Wait until every role has its replicas serving; returns the routers' addresses."""
        deadline = time.monotonic() + self.config.start_timeout_s
        while not self._all_serving.is_set():
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
        history.forget(self.config.namespace)

    # ------------------------------------------------------------ queries

    def router_addresses(self) -> list[str]:
        """The serving routers' gRPC addresses, oldest first (the first holds the configured ports)."""
        return [e.address for e in self._routers()]

    def http_addresses(self) -> list[str]:
        """The routers' OpenAI-compatible HTTP fronts (none unless the deployment has ``--http-port``)."""
        return [e.http_address for e in self._routers() if e.http_address]

    def _routers(self) -> list[discovery.Endpoint]:
        return sorted((e for e in self._endpoints() if e.role == "router" and e.takes_work), key=lambda e: seq_of(e.name))

    def status(self) -> dict:
        """Replicas per role (name, address, node, health), their life events, autoscaling (``control.status``)."""
        registered = {e.name: e for e in self._endpoints()}
        with self._lock:
            replicas = list(self.fleet.replicas.values())
            handles = dict(self._handles)
        wait_s = self.config.status_wait_s
        in_flight = status.work_in_flight(handles, wait_s)
        kv = status.kv_usage(handles, wait_s, self.config.aggregate)
        report = status.report(self.config, self.fleet, replicas, registered, self._desired, self.unplaced,
                               in_flight, kv, self.metrics.address, self.failed, self._start_failures.holding,
                               self.autoscaler.decisions)
        return {**report, "since": self.since, "controller_starts": self.controller_starts}

    def _handles_of(self, role: str) -> list:
        with self._lock:
            return [h for n, h in self._handles.items() if n.startswith(role + "-")]

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
        if role == "decode" and self.config.aggregate:
            raise ValueError("this deployment is aggregated: its prefill replicas decode too; scale prefill")
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
                names = sorted((n for n, r in self.fleet.replicas.items() if r.role == role), key=seq_of)
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
        serve = self.config.serve
        if role == "router":
            serve, self._fixed_ports_holder = placement.router_serve(serve, name, self._fixed_ports_holder,
                                                                     self._handles)
        return placement.create(self.config, role, name, self.registry, serve)

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
            services = self._handles_of("encode")
            return sum(ray.get([s.outstanding.remote(name) for s in services], timeout=30))
        return ray.get(self._handles[name].in_flight.remote(), timeout=30)

    def _kill(self, name: str, reason: str = "") -> None:
        with self._lock:
            handle = self._handles.pop(name, None)
            self.fleet.remove(name, time.monotonic(), reason)
        if handle is not None:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        role = name.rsplit("-", 1)[0]
        if placement.tensor_parallel(self.config, role) > 1:  # its ranks' reservation goes with it
            placement.release_ranks(name)
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
                seq = max(seq, seq_of(name) + 1)
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
        probes = list(self._probes.map(lambda item: self.prober.probe(item[0], item[1], endpoints.get(item[0])), names))
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
                reason = self.prober.init_failed.pop(name, "")
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
        self._save_history()
        if not self._all_serving.is_set() and all(self.fleet.healthy_count(r) >= self._desired[r] for r in ROLES):
            # Logged by this thread after the round's "joined" lines, so an operator's log (and
            # `epd serve`, which prints "epd ready" once Ray has forwarded this line) has them first.
            log.info("%s: every role serving (%s)", SERVING_LINE,
                     ", ".join(f"{role} {self.fleet.healthy_count(role)}" for role in ROLES))
            self._all_serving.set()

    def _save_history(self) -> None:
        """Keep the history and the metrics port in Ray's GCS (``control.history``) when they changed."""
        state = {"since": self.since, "controller_starts": self.controller_starts,
                 "metrics_port": int(self.metrics.address.rsplit(":", 1)[1]), **self.fleet.history()}
        if state != self._saved:
            history.save(self.config.namespace, state)
            self._saved = state

    def _serve_metrics(self, port: int) -> ControllerMetrics:
        """The Prometheus endpoint on ``port`` (0: a free one). The port a previous controller of the
        deployment had may be taken by now: then a free one, said in the log."""
        host = self._host_for_metrics()
        try:
            return ControllerMetrics(host, port, self)
        except OSError as error:
            if port == self.config.metrics_port:
                raise
            log.warning("controller metrics: cannot listen on %s:%d again (%s); on a new port", host, port,
                        error.strerror or error)
            return ControllerMetrics(host, 0, self)

    def _give_up(self, reason: str) -> None:
        """Stop reconciling and replacing: the deployment has stopped itself. `epd serve` sees it
        (``failure``) and stops everything; `epd status` shows it; `epd down` removes what is left."""
        self.failed = reason
        self._stop.set()
        log.error("deployment stopped: %s", reason)

    def _find_unplaced(self) -> None:
        """While replicas are not serving, what Ray cannot place, for the log and ``epd status``
        (``control.placement.find_unplaced``)."""
        with self._lock:
            waiting = {role: [r.name for r in self.fleet.replicas.values() if r.role == role and not r.healthy]
                       for role in ROLES}
        self.unplaced = placement.find_unplaced(self.config, waiting, self.unplaced)

    def _endpoints(self) -> list[discovery.Endpoint]:
        return ray.get(self.registry.snapshot.remote(), timeout=30).endpoints

    def _host_for_metrics(self) -> str:
        return ray.util.get_node_ip_address() if self.config.bind == "node" else "127.0.0.1"


# ---------------------------------------------------------------- driver side


def controller_options(namespace: str, detached: bool) -> dict:
    options = {"name": CONTROLLER_NAME, "namespace": namespace, "num_cpus": 0, "max_concurrency": 16,
               "max_restarts": -1, "scheduling_strategy": here()}
    if detached:
        options["lifetime"] = "detached"
    return options


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
