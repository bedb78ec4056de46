"""One deployment on a Ray cluster: the controller that places, scales and autoscales the roles.

``Controller`` is a Ray actor (named ``controller`` in the deployment's namespace; detached for
``epd deploy`` so the deployment outlives the command). It owns the deployment's ``Registry`` and
every role actor, so killing it takes the whole deployment down. Each role actor asks Ray for the
resources its role is given in the deploy file (``deploy/roles.toml``): custom resources or GPUs
decide which nodes take which role; nothing in the code names a node.

Scaling up creates actors and registers them once they serve. Scaling down drains: the registry
marks the replica draining, every consumer acknowledges it (so none picks it again), the replica
finishes what it holds (in-flight gRPC calls, decode requests, queued images), and only then is it
stopped and removed. In-flight requests never fail because a replica left.

The driver side (``deploy``, ``scale``, ``status``, ``down``) connects to a running cluster by
address; ``epd serve`` uses the same controller on a fresh local Ray (``control.local``).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import threading
import time

import ray

from control.autoscale import AutoscalePolicy, Decision
from epd import discovery, rpc
from epd.config import ROLES, DeployConfig

ROLE_ACTORS = {
    "encoder": "encode_svc.engine:EncoderEngine",
    "encode": "encode_svc.server:EncodeServer",
    "prefill": "prefill_svc.server:PrefillServer",
    "decode": "decode_svc.server:DecodeServer",
    "router": "router_svc.server:RouterServer",
}
"""The class each role's replicas run as: every one takes ``(ServeConfig, RoleContext)``."""

log = logging.getLogger(__name__)

CONTROLLER_NAME = "controller"


class Controller:
    """Places the roles, keeps the registry, scales on request and autoscales encoders."""

    def __init__(self, config: DeployConfig) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.config = config
        self.registry = ray.remote(discovery.Registry).options(name=discovery.REGISTRY_NAME, num_cpus=0).remote()
        self._replicas: dict[str, dict[str, ray.actor.ActorHandle]] = {role: {} for role in ROLES}
        self._lock = threading.Lock()
        self._role_locks = {role: threading.Lock() for role in ROLES}
        self._seq = itertools.count()
        self._stop = threading.Event()
        self.decisions: list[dict] = []
        self.metrics = _Metrics(self._host_for_metrics(), config.metrics_port)
        self._autoscaler: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> list[str]:
        """Start every role in dependency order; returns the routers' addresses."""
        cfg = self.config
        for role in ("encoder", "encode", "decode", "prefill", "router"):  # each after what it calls
            self._add(role, cfg.replicas(role))
        if cfg.autoscale.enabled:
            self._autoscaler = threading.Thread(target=self._autoscale_loop, name="autoscaler", daemon=True)
            self._autoscaler.start()
        return self.router_addresses()

    def shutdown(self) -> None:
        """Kill every role actor (routers first) and the registry."""
        self._stop.set()
        if self._autoscaler is not None:
            self._autoscaler.join(timeout=30)
        for role in ("router", "prefill", "decode", "encode", "encoder"):
            with self._lock:
                handles = list(self._replicas[role].values())
                self._replicas[role].clear()
            for handle in handles:
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        ray.kill(self.registry, no_restart=True)
        self.metrics.close()

    # ------------------------------------------------------------ queries

    def router_addresses(self) -> list[str]:
        _, endpoints = ray.get(self.registry.snapshot.remote())
        return [e.address for e in endpoints if e.role == "router" and not e.draining]

    def status(self) -> dict:
        """Replicas per role (name, address, node, draining), autoscaling and the metrics address."""
        _, endpoints = ray.get(self.registry.snapshot.remote())
        roles = {role: [] for role in ROLES}
        for e in endpoints:
            roles[e.role].append({"name": e.name, "address": e.address, "node_id": e.node_id, "draining": e.draining})
        return {"namespace": self.config.namespace, "roles": roles, "metrics": self.metrics.address,
                "autoscale": {"enabled": self.config.autoscale.enabled,
                              "min_replicas": self.config.autoscale.min_replicas,
                              "max_replicas": self.config.autoscale.max_replicas},
                "decisions": list(self.decisions[-50:])}

    def num_replicas(self, role: str) -> int:
        with self._lock:
            return len(self._replicas[role])

    # ------------------------------------------------------------ scaling

    def scale(self, role: str, count: int) -> int:
        """Set ``role``'s replica count (``epd scale``); returns the count reached."""
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
                names = list(self._replicas[role])
            if count > len(names):
                self._add(role, count - len(names))
            elif count < len(names):
                self._remove(role, names[count - len(names):])  # the newest go first
            return self.num_replicas(role)

    def _add(self, role: str, count: int) -> None:
        names = [f"{role}-{next(self._seq)}" for _ in range(count)]
        handles = [self._create(role, name) for name in names]
        timeout = self.config.start_timeout_s
        try:
            if role == "encoder":
                ray.get([h.ready.remote() for h in handles], timeout=timeout)
                endpoints = [discovery.Endpoint(name=n, role=role, handle=h) for n, h in zip(names, handles)]
            else:
                addresses = ray.get([h.address.remote() for h in handles], timeout=timeout)
                nodes = ray.get([h.node_id.remote() for h in handles], timeout=timeout)
                endpoints = [discovery.Endpoint(name=n, role=role, address=a, node_id=node)
                             for n, a, node in zip(names, addresses, nodes)]
        except BaseException:
            for handle in handles:
                ray.kill(handle, no_restart=True)
            raise
        for name, handle, endpoint in zip(names, handles, endpoints):
            with self._lock:
                self._replicas[role][name] = handle
            ray.get(self.registry.register.remote(endpoint))
            log.info("%s %s joined %s", role, name, endpoint.address or "")
        self.metrics.replicas(role, self.num_replicas(role))

    def _create(self, role: str, name: str) -> ray.actor.ActorHandle:
        module, _, cls_name = ROLE_ACTORS[role].partition(":")
        cls = getattr(importlib.import_module(module), cls_name)
        cfg = self.config
        options = {**getattr(cls, "ACTOR_OPTIONS", {}), **cfg.role_resources(role).ray_options(), "name": name}
        if role == "encoder":  # Ray restarts a dead replica; its Encoder services retry its images
            options.update(max_restarts=3, max_task_retries=1)
        context = discovery.RoleContext(name=name, host=self._bind_host(role), registry=self.registry,
                                        poll_s=cfg.poll_s)
        return ray.remote(cls).options(**options).remote(cfg.serve, context)

    def _bind_host(self, role: str) -> str:
        """Loopback on one machine; the node's IP on a cluster (roles on other nodes must reach
        it). The router binds ``--host`` when one was given."""
        router_host = self.config.serve.router.host
        if role == "router" and (self.config.bind == "loopback" or router_host != "127.0.0.1"):
            return router_host
        return rpc.NODE_ADDRESS if self.config.bind == "node" else "127.0.0.1"

    def _remove(self, role: str, names: list[str]) -> None:
        """Drain ``names``: no new work, finish what they hold, then stop."""
        with self._lock:
            handles = {name: self._replicas[role][name] for name in names}
        version = max(ray.get([self.registry.drain.remote(name) for name in names]))
        deadline = time.monotonic() + self.config.drain_timeout_s
        # Every watcher of this role (the Encoder services for encoders, routers for prefill,
        # prefill for decode) must have applied the drain before "idle" means "done".
        if not discovery.wait_until(lambda: ray.get(self.registry.acked.remote(role, version)),
                                    self.config.drain_timeout_s):
            log.warning("not every watcher of %s acknowledged the drain of %s; removing anyway", role, names)
        for name in names:
            idle = discovery.wait_until(lambda: self._held(role, name, handles[name]) == 0,
                                        max(0.0, deadline - time.monotonic()))
            if not idle:
                log.warning("%s %s still held work after %.0fs; removing it anyway", role, name,
                            self.config.drain_timeout_s)
            if role != "encoder":
                try:
                    ray.get(handles[name].stop.remote(), timeout=30)
                except Exception as error:  # noqa: BLE001 - it is going away either way
                    log.warning("%s %s did not stop cleanly: %s", role, name, error)
            ray.kill(handles[name], no_restart=True)
            with self._lock:
                del self._replicas[role][name]
            ray.get(self.registry.remove.remote(name))
            log.info("%s %s drained and left", role, name)
        self.metrics.replicas(role, self.num_replicas(role))

    def _held(self, role: str, name: str, handle) -> int:
        """Work the replica still holds: images queued for it at the Encoder services, or calls
        (and, for decode, requests) its server is still running."""
        if role == "encoder":
            with self._lock:
                services = list(self._replicas["encode"].values())
            return sum(ray.get([s.outstanding.remote(name) for s in services], timeout=30))
        return ray.get(handle.in_flight.remote(), timeout=30)

    # ------------------------------------------------------------ autoscaling

    def _autoscale_loop(self) -> None:
        cfg = self.config.autoscale
        policy = AutoscalePolicy(cfg, time.monotonic())
        while not self._stop.wait(cfg.interval_s):
            try:
                with self._lock:
                    services = list(self._replicas["encode"].values())
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


class _Metrics:
    """The controller's Prometheus endpoint: replicas per role and every autoscaling decision."""

    def __init__(self, host: str, port: int) -> None:
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry()
        self._replicas = prom.Gauge("epd_replicas", "Replicas of each role", ["role"], registry=self.registry)
        self._desired = prom.Gauge("epd_encoder_replicas_desired", "Encoder replicas the load asks for",
                                   registry=self.registry)
        self._queued = prom.Gauge("epd_encoder_images_in_flight", "Images queued or running at the encoders",
                                  registry=self.registry)
        self._decisions = prom.Counter("epd_autoscale_decisions", "Encoder autoscaling decisions", ["direction"],
                                       registry=self.registry)
        self._server, _ = prom.start_http_server(port, addr=host, registry=self.registry)
        self.address = f"{host}:{self._server.server_port}"

    def replicas(self, role: str, count: int) -> None:
        self._replicas.labels(role=role).set(count)

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
    options = {"name": CONTROLLER_NAME, "namespace": namespace, "num_cpus": 0, "max_concurrency": 16}
    if detached:
        options["lifetime"] = "detached"
    return options


def create_controller(config: DeployConfig, detached: bool) -> ray.actor.ActorHandle:
    """Create the deployment's controller and start every role; returns the controller handle."""
    controller = ray.remote(Controller).options(**controller_options(config.namespace, detached)).remote(config)
    try:
        ray.get(controller.start.remote(), timeout=config.start_timeout_s)
    except BaseException:
        stop_controller(controller)
        raise
    return controller


def stop_controller(controller) -> None:
    try:
        ray.get(controller.shutdown.remote(), timeout=120)
    except Exception as error:  # noqa: BLE001 - kill it regardless
        log.warning("controller shutdown failed: %s", error)
    ray.kill(controller, no_restart=True)


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
