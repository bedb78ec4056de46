"""How the controller asks a replica whether it serves (``control.fleet`` says what each answer
means): the serving path where there is one (gRPC health), else a call through Ray; when that
fails, Ray tells whether the actor is gone for good, and why when its constructor raised."""

from __future__ import annotations

import ray
from grpc_health.v1 import health_pb2

from control.fleet import Probe
from epd import discovery, rpc
from epd.config import DeployConfig


class Prober:
    """One probe per call (the controller runs them in parallel); ``init_failed`` collects the
    replicas whose constructor raised (Ray does not restart those): name -> the error's last line."""

    def __init__(self, config: DeployConfig) -> None:
        self.config = config
        self._internal = rpc.internal_transport(config.serve.security)  # how the probes reach internal servers
        self.init_failed: dict[str, str] = {}

    def probe(self, name: str, handle, endpoint: discovery.Endpoint | None) -> Probe:
        if endpoint is not None and endpoint.address:
            status = self._health_status(name, handle, endpoint.address)
            if status is not None:
                return Probe.SERVING if status == health_pb2.HealthCheckResponse.SERVING else Probe.NOT_SERVING
        try:
            ray.get(handle.ping.remote(), timeout=self.config.probe_timeout_s)
        except ray.exceptions.ActorDiedError as error:
            if getattr(error, "actor_init_failed", False):
                self.init_failed[name] = last_line(getattr(error, "error_msg", "") or str(error))
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


def last_line(text: str) -> str:
    """The exception line of a Ray task error's text (its traceback comes before it)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
