"""Start every role on a local Ray instance: ``epd serve``.

Order: the store (embedded redis-server unless a URL is given), Ray, the encoder replicas and
the Encoder service, Decode, Prefill (it needs decode's address), then the Router. Every role is
a Ray actor, so each runs in its own worker process with only its own weights; Ray restarts a
dead encoder replica. ``stop`` kills the actors, shuts Ray down and stops the embedded Redis,
leaving no process behind.
"""

from __future__ import annotations

import logging
import os
import time

from epd import rpc
from epd.config import ServeConfig
from epd.redis_server import EmbeddedRedis
from epd.store import EmbeddingStore

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 600.0  # loading the 0.8b weights into four processes takes a while on 2 cores


class LocalStack:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.store.redis_url or ""
        self.actors: list = []
        self.addresses: dict[str, str] = {}
        self._ray_started = False

    def start(self) -> str:
        """Bring everything up; returns the router's address once every role is SERVING."""
        try:
            self._start_store()
            self._start_ray()
            self._start_roles()
            for role, address in self.addresses.items():
                rpc.wait_serving(address, timeout_s=60)
                log.info("%s serving at %s", role, address)
            return self.addresses["router"]
        except BaseException:
            self.stop()
            raise

    def _start_store(self) -> None:
        if not self.redis_url:
            self.redis = EmbeddedRedis(self.config.store.max_memory_mb)
            self.redis_url = self.redis.url
        store = EmbeddingStore(self.redis_url)
        try:
            store.ping()
        except Exception as error:
            raise RuntimeError(f"cannot reach Redis at {self.redis_url}: {error}") from None
        finally:
            store.close()

    def _start_ray(self) -> None:
        import ray

        # A local Ray binds the machine's interface address unless this is 0: keep it on loopback.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Roles share this machine's cores: idle OpenMP threads must sleep, not spin on a core
        # another role is computing on (spinning made co-located prefill ~10x slower). Workers
        # inherit it from the raylet this starts.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        ray.init(include_dashboard=False, logging_level=logging.WARNING, namespace="epd",
                 configure_logging=False)
        self._ray_started = True

    def _start_roles(self) -> None:
        import ray

        from decode_svc.server import DecodeServer
        from encode_svc.server import EncodeServer
        from encode_svc.worker import EncoderWorker
        from prefill_svc.engine import PrefillServer
        from router_svc.server import RouterServer

        cfg, model = self.config, self.config.model_dir
        # num_cpus=0: roles share this machine's cores instead of reserving them (a 2-core box
        # could not otherwise place five actors); cluster placement is by custom resources.
        role = {"num_cpus": 0}
        replicas = [
            ray.remote(EncoderWorker).options(**role, **EncoderWorker.ACTOR_OPTIONS, max_restarts=3, max_task_retries=1,
                                              name=f"encoder-{i}")
            .remote(model, self.redis_url, cfg.store.ttl_s, cfg.encode.max_decoded_pixels, cfg.encode.num_threads,
                    max_batch_patches=cfg.encode.max_batch_patches, dtype=cfg.encode.dtype)
            for i in range(cfg.encode.num_replicas)
        ]
        encode = ray.remote(EncodeServer).options(**role, name="encode").remote(replicas)
        decode = ray.remote(DecodeServer).options(**role, name="decode").remote(
            model, cfg.decode.dtype, cfg.decode.handoff_lease_s, cfg.decode.num_threads,
            max_batch_size=cfg.decode.max_batch_size)
        self.actors += [*replicas, encode, decode]
        self.addresses["encode"], self.addresses["decode"] = ray.get([encode.address.remote(), decode.address.remote()],
                                                                     timeout=_READY_TIMEOUT_S)
        prefill = ray.remote(PrefillServer).options(**role, name="prefill").remote(
            model, self.redis_url, self.addresses["decode"], cfg.prefill)
        self.actors.append(prefill)
        self.addresses["prefill"] = ray.get(prefill.address.remote(), timeout=_READY_TIMEOUT_S)
        router = ray.remote(RouterServer).options(**role, name="router").remote(
            model, self.redis_url, self.addresses["encode"], self.addresses["prefill"], cfg.router,
            cfg.encode.max_decoded_pixels)
        self.actors.append(router)
        self.addresses["router"] = ray.get(router.address.remote(), timeout=_READY_TIMEOUT_S)

    def stop(self) -> None:
        if self._ray_started:
            import ray

            for actor in reversed(self.actors):
                try:
                    ray.kill(actor)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            self.actors.clear()
            ray.shutdown()
            self._ray_started = False
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def wait_forever() -> None:
    while True:
        time.sleep(3600)
