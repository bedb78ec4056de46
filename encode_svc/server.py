"""The Encoder gRPC service: spreads images over the Ray encoder replicas.

Each image goes to the replica with the fewest images in flight, so the images of one request
encode in parallel across replicas. Concurrent requests for the same store key share one
encode (single flight): the second waits on the first's result instead of encoding again.
Replicas are Ray actors with restarts; a call that dies with its replica is retried by Ray.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import grpc
import ray

from encode_svc.worker import EncodeResult
from epd import rpc
from epd.v1 import epd_pb2, epd_pb2_grpc


class ReplicaPool:
    """Bookkeeping only: which replica gets the next image, and which keys are in flight."""

    def __init__(self, replicas: Sequence[ray.actor.ActorHandle]) -> None:
        if not replicas:
            raise ValueError("an encoder pool needs at least one replica")
        self._replicas = list(replicas)
        self._outstanding = [0] * len(replicas)
        self._in_flight: dict[str, ray.ObjectRef] = {}
        self._lock = threading.Lock()

    def submit(self, store_key: str, data: bytes, max_pixels: int) -> tuple[ray.ObjectRef, int | None]:
        """Start (or join) the encode of one key; returns its ref and the replica index, or None
        when it joined an encode already in flight."""
        with self._lock:
            ref = self._in_flight.get(store_key)
            if ref is not None:
                return ref, None
            index = min(range(len(self._replicas)), key=self._outstanding.__getitem__)
            self._outstanding[index] += 1
            ref = self._replicas[index].encode.remote(store_key, data, max_pixels)
            self._in_flight[store_key] = ref
            return ref, index

    def done(self, store_key: str, index: int | None) -> None:
        with self._lock:
            self._in_flight.pop(store_key, None)
            if index is not None:
                self._outstanding[index] -= 1

    @property
    def replicas(self) -> list[ray.actor.ActorHandle]:
        return list(self._replicas)


class EncoderServicer(epd_pb2_grpc.EncoderServicer):
    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool

    @rpc.unary_errors
    def Encode(self, request: epd_pb2.EncodeRequest, context) -> epd_pb2.EncodeResponse:
        submitted = [self.pool.submit(item.store_key, item.data, item.max_pixels) for item in request.items]
        results: list[EncodeResult] = []
        try:
            for ref, _ in submitted:
                results.append(ray.get(ref, timeout=context.time_remaining()))
        except ray.exceptions.GetTimeoutError:
            raise rpc.RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "encoder: deadline passed") from None
        except ray.exceptions.RayError as error:
            raise rpc.RpcFailure(grpc.StatusCode.UNAVAILABLE, f"encoder replica failed: {error}") from None
        finally:
            for item, (_, index) in zip(request.items, submitted):
                self.pool.done(item.store_key, index)
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
    """Hosts the Encoder service in its own process (a Ray actor made by the launcher)."""

    def __init__(self, replicas: Sequence[ray.actor.ActorHandle], host: str = "127.0.0.1") -> None:
        ray.get([replica.ready.remote() for replica in replicas])
        servicer = EncoderServicer(ReplicaPool(replicas))
        self._serve(epd_pb2_grpc.add_EncoderServicer_to_server, servicer, "epd.v1.Encoder", host)
