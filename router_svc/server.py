"""The Router gRPC service (the public entry point a gateway calls) and the actor that hosts it.

The request path is ``RouterCore``'s; this module maps it onto gRPC and runs the replica: health
(SERVING only while every role it calls has a replica that takes work), graceful drain on
shutdown, metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from epd import discovery, logs, rpc
from epd.config import ServeConfig
from epd.discovery import Membership, RoleContext
from epd.metrics import serve_metrics
from epd.modelinfo import ModelInfo
from epd.store import EmbeddingStore
from epd.tensors import freeze_startup_heap
from epd.v1 import epd_pb2, epd_pb2_grpc
from router_svc.core import RouterCore
from router_svc.prompt import PromptBuilder
from router_svc.stats import RequestStats

log = logging.getLogger(__name__)


class RouterServicer(epd_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore, stats: RequestStats | None = None) -> None:
        self.core = core
        self.stats = stats or RequestStats()
        self.num_cut = 0  # streams still running when a shutdown's drain ran out of time

    async def Generate(self, request: epd_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        # Every line logged for it, on every role, names it (the client's id, escaped to printable ASCII).
        logs.REQUEST_ID.set(logs.safe_id(request.request_id) or uuid.uuid4().hex)
        try:
            async for event in self.stats.track("grpc", self.core.generate(request, context.time_remaining())):
                yield event
        except asyncio.CancelledError:
            if self.core.refusing:  # cut by the drain timeout, not by the client: say so, retryably
                self.num_cut += 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "router: shut down before the answer finished")
            raise
        except (grpc.aio.AbortError, GeneratorExit):
            raise
        except Exception as error:  # noqa: BLE001 - every error leaves as a status
            await rpc.abort(context, error, "Generate")


def _add_reflection(servicer, server) -> None:
    """gRPC server reflection (``grpcurl list``), naming the public service only."""
    from grpc_reflection.v1alpha import reflection

    reflection.enable_server_reflection(["epd.v1.Router", reflection.SERVICE_NAME], server)


# Served beside the Router (before the server starts); its name is registered with health too, harmlessly.
_REFLECTION = (_add_reflection, None, "grpc.reflection.v1alpha.ServerReflection")


class RouterServer(rpc.RoleServer):
    """Hosts the Router service in its own process (a Ray actor the controller makes); it calls
    whatever Encoder services, prefill and decode replicas the registry lists from moment to moment."""

    def __init__(self, serve: ServeConfig, context: RoleContext) -> None:
        rpc.configure(serve.rpc)
        config = serve.router
        info = ModelInfo.load(serve.model_dir)
        builder = PromptBuilder.load(serve.model_dir, info, serve.encode.max_decoded_pixels,
                                     max_model_len=config.max_model_len, max_images=config.max_images_per_request,
                                     allow_special_tokens=config.allow_special_tokens,
                                     video_chunk_patches=config.video_chunk_patches)
        internal = rpc.internal_transport(serve.security)
        wait = serve.replica_wait_s
        self._targets = [discovery.encoder_targets(context, internal, wait),
                         discovery.prefill_targets(context, internal, wait),
                         discovery.decode_targets(context, internal, wait)]
        store = EmbeddingStore.from_config(serve.store)
        encoders = discovery.Balancer("encoder")  # for health: can any image be encoded at all?
        self._watches = [discovery.RegistryWatch(context.registry, "encoder", context.name, encoders.update,
                                                 context.poll_s, refill_grace_s=context.refill_grace_s)]
        self.core = RouterCore(config, builder, store, *self._targets, encoder_replicas=encoders,
                               decode_batch_size=serve.decode.max_batch_size)
        self.stats = RequestStats()
        self.servicer = RouterServicer(self.core, self.stats)
        self._serve([(epd_pb2_grpc.add_RouterServicer_to_server, self.servicer, "epd.v1.Router"), _REFLECTION],
                    context.host, rpc.public_transport(serve.security), config.port, healthy=self.core.serving,
                    what="an API key (authorization: Bearer KEY)", max_receive_bytes=config.max_request_mb << 20,
                    max_concurrent_rpcs=config.max_concurrent_rpcs)
        self.http = None
        if serve.http.port is not None:
            from router_svc.http import HttpFront, default_model_name

            self.http = HttpFront(self.core, serve.http, serve.http.served_model_name or default_model_name(
                serve.model_dir), serve.security.api_key, self.serving, self.stats, self._read_metrics,
                serve.security.tls_cert, serve.security.tls_key, config.max_request_mb,
                max_images=config.max_images_per_request, max_tokens_limit=config.max_tokens_limit,
                max_open_requests=serve.http.open_requests_limit(config.max_queued_requests))
            self.events.run(self.http.start(self.host, serve.http.port))
        self._metrics = serve_metrics(self._read_metrics, self.host, config.metrics_port)
        freeze_startup_heap()  # before it takes work: see epd/tensors.py
        self.membership = Membership(context, address=self.address(), http_address=self.http_address())

    def in_flight(self) -> int:
        """gRPC calls and HTTP requests still running: a router being drained exits at zero."""
        return super().in_flight() + self.stats.running("http")

    def _read_metrics(self) -> list:
        return [*self.core.metrics(), *self.stats.families()]

    def http_address(self) -> str:
        """``host:port`` of the OpenAI-compatible HTTP front; empty when it has none."""
        return f"{self.host}:{self.http.port}" if self.http is not None else ""

    def drain(self, timeout_s: float) -> dict[str, int]:
        """Shut down gracefully: NOT_SERVING, new requests refused with UNAVAILABLE, the requests in
        flight finish within ``timeout_s``; any still running then end with UNAVAILABLE."""
        self.core.refusing = True
        self.start_shutdown()
        running = len(self.core.active)
        deadline = time.monotonic() + timeout_s
        while self.core.active and time.monotonic() < deadline:
            time.sleep(0.1)

        async def cut() -> int:
            tasks = list(self.core.active)
            for task in tasks:
                task.cancel()
            await asyncio.sleep(0.2)  # let them send their status
            return len(tasks)

        cut_count = self.events.run(cut()) if self.core.active else 0
        if cut_count:
            log.warning("router: %d stream(s) still running after the %.0f s drain; ended with UNAVAILABLE",
                        cut_count, timeout_s)
        return {"in_flight": running, "finished": running - cut_count, "cut": cut_count}

    def stop(self, grace_s: float = 1.0) -> None:
        self.membership.close()
        for watched in (*self._targets, *self._watches):
            watched.close()
        if self.http is not None:
            self.events.run(self.http.stop(), timeout=grace_s + 15)
        super().stop(grace_s)
        if self._metrics is not None:
            self._metrics.shutdown()
