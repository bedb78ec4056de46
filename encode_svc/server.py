"""The Encoder gRPC service: spreads images over the Ray encoder replicas.

Each image goes to the replica with the fewest images in flight, so the images of one request
encode in parallel across replicas. Replicas come and go at run time through the registry
(``epd.discovery``): a draining one takes no new image and is removed once its images are done. Concurrent requests for the same store key share one
encode (single flight): the second waits on the first's result instead of encoding again.
Replicas are Ray actors with restarts; a call that dies with its replica is retried by Ray.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import grpc
import ray

from encode_svc.engine import EncodeResult
from epd import discovery, rpc
from epd.config import ServeConfig
from epd.discovery import RoleContext
from epd.v1 import epd_pb2, epd_pb2_grpc


class ReplicaPool:
    """Bookkeeping only: which replica gets the next image, and which keys are in flight.

    Replicas join and leave at run time (``update``): a replica that left, or is draining, gets
    no new image but keeps its in-flight count until its images are done, so a drain can wait
    for zero.
    """

    def __init__(self, replicas: Mapping[str, ray.actor.ActorHandle] | None = None) -> None:
        self._replicas: dict[str, ray.actor.ActorHandle] = dict(replicas or {})
        self._outstanding: dict[str, int] = dict.fromkeys(self._replicas, 0)
        self._in_flight: dict[str, ray.ObjectRef] = {}
        self._lock = threading.Lock()

    def update(self, replicas: Mapping[str, ray.actor.ActorHandle]) -> None:
        """The replicas that take new images from now on."""
        with self._lock:
            self._replicas = dict(replicas)
            for name in self._replicas:
                self._outstanding.setdefault(name, 0)
            for name in [n for n, count in self._outstanding.items() if count == 0 and n not in self._replicas]:
                del self._outstanding[name]

    def submit(self, store_key: str, data: bytes, max_pixels: int) -> tuple[ray.ObjectRef, str | None]:
        """Start (or join) the encode of one key; returns its ref and the replica's name, or None
        when it joined an encode already in flight."""
        with self._lock:
            ref = self._in_flight.get(store_key)
            if ref is not None:
                return ref, None
            if not self._replicas:
                raise rpc.RpcFailure(grpc.StatusCode.UNAVAILABLE, "encoder: no encoder replica is registered")
            name = min(self._replicas, key=self._outstanding.__getitem__)
            self._outstanding[name] += 1
            ref = self._replicas[name].encode.remote(store_key, data, max_pixels)
            self._in_flight[store_key] = ref
            return ref, name

    def done(self, store_key: str, name: str | None) -> None:
        with self._lock:
            self._in_flight.pop(store_key, None)
            if name is not None:
                self._outstanding[name] -= 1
                if self._outstanding[name] == 0 and name not in self._replicas:
                    del self._outstanding[name]

    def outstanding(self, name: str) -> int:
        with self._lock:
            return self._outstanding.get(name, 0)

    def load(self) -> tuple[int, int]:
        """(images queued or running over every replica, replicas taking work)."""
        with self._lock:
            return sum(self._outstanding.values()), len(self._replicas)

    @property
    def replicas(self) -> list[ray.actor.ActorHandle]:
        with self._lock:
            return list(self._replicas.values())


class EncoderServicer(epd_pb2_grpc.EncoderServicer):
    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool

    @rpc.unary_errors
    def Encode(self, request: epd_pb2.EncodeRequest, context) -> epd_pb2.EncodeResponse:
        submitted: list[tuple[ray.ObjectRef, str | None]] = []
        results: list[EncodeResult] = []
        try:
            for item in request.items:  # every image is queued before any is awaited: they run in parallel
                submitted.append(self.pool.submit(item.store_key, item.data, item.max_pixels))
            for ref, _ in submitted:
                results.append(ray.get(ref, timeout=context.time_remaining()))
        except ray.exceptions.GetTimeoutError:
            raise rpc.RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "encoder: deadline passed") from None
        except ray.exceptions.RayError as error:
            raise rpc.RpcFailure(grpc.StatusCode.UNAVAILABLE, f"encoder replica failed: {error}") from None
        finally:
            for item, (_, name) in zip(request.items, submitted):
                self.pool.done(item.store_key, name)
        return epd_pb2.EncodeResponse(images=[_to_proto(r) for r in results])


def _to_proto(result: EncodeResult) -> epd_pb2.EncodedImage:
    return epd_pb2.EncodedImage(
        store_key=result.store_key,
        num_tokens=result.num_tokens,
        grid_thw=list(result.grid_thw),
        encode_s=result.encode_s,
        error=result.error,
        store_write_s=result.store_write_s,
    )


class EncodeServer(rpc.RoleServer):
    """Hosts the Encoder service in its own process (a Ray actor the controller makes); its
    replicas are whatever encoder replicas the registry lists from moment to moment."""

    def __init__(self, serve: ServeConfig, context: RoleContext) -> None:
        self.pool = ReplicaPool()
        self._watch = discovery.RegistryWatch(context.registry, "encoder", context.name, self._on_replicas,
                                              context.poll_s)
        ray.get([replica.ready.remote() for replica in self.pool.replicas])
        servicer = EncoderServicer(self.pool)
        self._serve(epd_pb2_grpc.add_EncoderServicer_to_server, servicer, "epd.v1.Encoder", context.host)

    def _on_replicas(self, endpoints: list[discovery.Endpoint]) -> None:
        self.pool.update({e.name: e.handle for e in endpoints if not e.draining})

    def outstanding(self, name: str) -> int:
        """Images the replica ``name`` still holds for this service."""
        return self.pool.outstanding(name)

    def load(self) -> tuple[int, int]:
        return self.pool.load()

    def stop(self) -> None:
        self._watch.close()
        super().stop()
