"""The controller's Prometheus endpoint: replicas per role and their health, their deaths,
restarts and replacements, and every autoscaling decision."""

from __future__ import annotations

from control.autoscale import Decision
from control.status import EVENT_KINDS
from epd.config import ROLES


class ControllerMetrics:
    def __init__(self, host: str, port: int, controller) -> None:
        import prometheus_client as prom

        self.controller = controller
        self.registry = prom.CollectorRegistry()
        self._replicas = prom.Gauge("epd_replicas", "Replicas of each role", ["role"], registry=self.registry)
        self._healthy = prom.Gauge("epd_replicas_healthy", "Replicas of each role serving now", ["role"],
                                   registry=self.registry)
        self._events = prom.Gauge("epd_replica_events", "Replica life events since the deployment started (kept across controller restarts), by "
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
            for kind in EVENT_KINDS:
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
