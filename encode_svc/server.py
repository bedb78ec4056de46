"""The Encoder gRPC service: spreads images over the Ray encoder replicas, routing around dead ones.

Each image goes to the replica with the fewest images in flight, so the images of one request
encode in parallel across replicas. Replicas come and go at run time through the registry
(``epd.discovery``): a draining or unhealthy one takes no new image. An image whose replica dies
under it is encoded again on another replica (encoding is content-keyed, so it is idempotent),
never twice on the same dead one, and that replica stays out of rotation while its breaker is
open (Ray restarts it; the controller replaces it when Ray gives up). Concurrent requests for the
same store key share one encode (single flight).
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from encode_svc.engine import EncodeResult
from epd import discovery, errors, rpc
from epd.config import ServeConfig
from epd.discovery import RoleContext
from epd.tensors import freeze_startup_heap
from epd.v1 import epd_pb2, epd_pb2_grpc

log = logging.getLogger(__name__)


class ReplicaPool:
    """Which replica encodes which image, on the service's event loop. Bookkeeping (least busy,
    breakers, draining) is the ``Balancer``'s; this adds the single flight per key and the retry
    on another replica."""

    def __init__(self, max_queued_per_replica: int = 0, wait_s: float = 0.0) -> None:
        self.balancer = discovery.Balancer("encoder")
        self.max_queued_per_replica = max_queued_per_replica
        self.wait_s = wait_s  # how long an image waits for a replica when none is left (a restart)
        self._in_flight: dict[str, _Flight] = {}
        # Ray handles by (actor name, incarnation), looked up here rather than carried in the registry:
        # a handle arriving in a call makes Ray import its actor's class (torch, transformers), which
        # held the registry, and every replica's start waiting on it, for seconds.
        self._handles: dict[tuple[str, str], object] = {}
        self.num_retried = 0
        self.num_cancelled = 0
        self.num_refused = 0

    def update(self, endpoints: list[discovery.Endpoint]) -> None:
        """The registry's view of the encoder replicas (on the watch's thread): their handles, looked
        up once per process incarnation, then the balancer's bookkeeping."""
        handles = {}
        for endpoint in endpoints:
            key = (endpoint.name, endpoint.incarnation)
            handle = self._handles.get(key) or _lookup(endpoint.name)
            if handle is not None:
                handles[key] = handle
        self._handles = handles  # replaced whole: the event loop reads it meanwhile
        self.balancer.update(endpoints)

    async def _handle(self, name: str, incarnation: str):
        """The replica's Ray handle; one the watch has not looked up yet is looked up now (off the loop)."""
        handle = self._handles.get((name, incarnation))
        if handle is None:
            handle = await asyncio.get_running_loop().run_in_executor(None, _lookup, name)
        if handle is None:
            raise ray.exceptions.ActorUnavailableError(f"no actor named {name}", None)
        return handle

    def admit(self, keys: list[str]) -> None:
        """Refuse (RESOURCE_EXHAUSTED) a request whose new images would take the images in flight
        past ``max_queued_per_replica`` for each replica taking work; one already being encoded
        joins its flight and costs nothing, and a request is never refused while nothing is in
        flight (so one with more images than the limit still runs, alone)."""
        if not self.max_queued_per_replica:
            return
        new = len({key for key in keys if key not in self._in_flight})
        limit = self.max_queued_per_replica * max(1, self.balancer.num_available())
        if new and self._in_flight and len(self._in_flight) + new > limit:
            self.num_refused += 1
            raise errors.ResourceExhausted(f"encode: {len(self._in_flight)} images are already queued or encoding "
                                           f"(limit {limit}: encode.max_queued_per_replica for each replica); "
                                           "retry shortly")

    async def encode(self, item: epd_pb2.EncodeItem) -> EncodeResult:
        """Encode one image, or wait for the encode of the same key already in flight. The encode
        runs as a task of its own: when every caller waiting for it has gone, it is dropped."""
        flight = self._in_flight.get(item.store_key)
        if flight is None:
            flight = self._in_flight[item.store_key] = _Flight(asyncio.ensure_future(self._encode_somewhere(item)))
            flight.task.add_done_callback(lambda _: self._forget(item.store_key, flight))
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            if flight.waiters == 1 and not flight.task.done():
                flight.task.cancel()
                self.num_cancelled += 1
            raise
        finally:
            flight.waiters -= 1

    def _forget(self, key: str, flight: _Flight) -> None:
        if self._in_flight.get(key) is flight:
            del self._in_flight[key]
        if not flight.task.cancelled():
            flight.task.exception()  # retrieved: every waiter may have left

    async def _encode_somewhere(self, item: epd_pb2.EncodeItem) -> EncodeResult:
        tried: dict[str, str] = {}  # name -> the incarnation that failed this image
        give_up = time.monotonic() + self.wait_s  # none left: wait for a restarted one (the caller's deadline bounds it)
        while True:
            name, endpoint = await self.balancer.pick_or_wait(tried, give_up)
            ok = None
            handle = None
            try:
                handle = await self._handle(name, endpoint.incarnation)
                if self.balancer.suspect(name) and not await _answers(handle):
                    # A replica Ray is restarting would hold the image until it is back: try elsewhere.
                    raise ray.exceptions.ActorUnavailableError("no answer to a ping", None)
                ref = handle.encode.remote(item.store_key, item.data, item.max_pixels, item.inline, _video_chunk(item))
                result = await asyncio.wrap_future(ref.future())
                ok = True
                return result
            except asyncio.CancelledError:
                if handle is not None:
                    handle.cancel.remote(item.store_key)  # nobody waits: drop it before its forward
                raise
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as error:
                ok = False
                tried[name] = endpoint.incarnation
                self.num_retried += 1
                log.warning("encoder %s failed (%s); encoding %s on another replica", name, type(error).__name__,
                            item.store_key[-12:])
            except ray.exceptions.RayTaskError as error:  # the replica raised: not the image's fault
                raise errors.ServiceError(f"encoder {name}: {error.cause!r}") from None
            finally:
                self.balancer.release(name, ok)

    def outstanding(self, name: str) -> int:
        return self.balancer.outstanding().get(name, 0)

    def load(self) -> tuple[int, int]:
        """(images queued or running over every replica, replicas taking work)."""
        return sum(self.balancer.outstanding().values()), self.balancer.num_available()


def _lookup(name: str):
    """The Ray handle of the actor ``name`` in this deployment's namespace; None when there is none
    (it died and was not restarted)."""
    try:
        return ray.get_actor(name, namespace=ray.get_runtime_context().namespace)
    except Exception:  # noqa: BLE001 - not found (ValueError), or the GCS briefly away: a call looks again
        return None


async def _answers(handle, timeout_s: float = 1.0) -> bool:
    try:
        await asyncio.wait_for(asyncio.wrap_future(handle.ping.remote().future()), timeout_s)
        return True
    except (asyncio.TimeoutError, ray.exceptions.RayError):
        return False


class _Flight:
    """One encode in flight and how many callers wait for it."""

    def __init__(self, task: asyncio.Task) -> None:
        self.task = task
        self.waiters = 0


class EncoderServicer(epd_pb2_grpc.EncoderServicer):
    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool

    @rpc.unary_errors
    async def Encode(self, request: epd_pb2.EncodeRequest, context) -> epd_pb2.EncodeResponse:
        self.pool.admit([item.store_key for item in request.items])
        # Every image is submitted before any is awaited: they encode in parallel.
        results = await asyncio.gather(*(self.pool.encode(item) for item in request.items))
        return epd_pb2.EncodeResponse(images=[_to_proto(r) for r in results])


def _video_chunk(item: epd_pb2.EncodeItem) -> tuple | None:
    """A clip chunk's settings and range as plain values for the replica; None for an image."""
    if not item.HasField("video"):
        return None
    v = item.video
    return (float(v.fps), int(v.max_frames), int(v.max_pixels), int(v.first_patch), int(v.num_patches))


def _to_proto(result: EncodeResult) -> epd_pb2.EncodedImage:
    return epd_pb2.EncodedImage(
        store_key=result.store_key,
        num_tokens=result.num_tokens,
        grid_thw=list(result.grid_thw),
        encode_s=result.encode_s,
        error=result.error,
        store_write_s=result.store_write_s,
        embedding=result.embedding,
    )


class EncodeServer(rpc.RoleServer):
    """Hosts the Encoder service in its own process (a Ray actor the controller makes); its
    replicas are whatever encoder replicas the registry lists from moment to moment. It reports
    SERVING while at least one replica takes work."""

    def __init__(self, serve: ServeConfig, context: RoleContext) -> None:
        rpc.configure(serve.rpc)
        self.pool = ReplicaPool(serve.encode.max_queued_per_replica, serve.replica_wait_s)
        self._watch = discovery.RegistryWatch(context.registry, "encoder", context.name, self.pool.update,
                                              context.poll_s, self.pool.balancer.outstanding, context.refill_grace_s)
        self._serve([(epd_pb2_grpc.add_EncoderServicer_to_server, EncoderServicer(self.pool), "epd.v1.Encoder")],
                    context.host, rpc.internal_transport(serve.security),
                    healthy=lambda: self.pool.balancer.num_available() > 0)
        freeze_startup_heap()  # before it takes work: see epd/tensors.py
        self.membership = discovery.Membership(context, address=self.address())

    def outstanding(self, name: str) -> int:
        """Images the replica ``name`` still holds for this service."""
        return self.pool.outstanding(name)

    def load(self) -> tuple[int, int]:
        return self.pool.load()

    def stop(self, grace_s: float = 1.0) -> None:
        self.membership.close()
        self._watch.close()
        super().stop(grace_s)
