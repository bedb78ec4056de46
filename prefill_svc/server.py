"""The Prefill gRPC service: run the prompt through ``PrefillEngine``, hand the state to a decode
replica (one with free K/V memory for it and the fewest handoffs waiting, ``routing.DecodeRoute``;
another one if it dies during the handoff) and tell the router where
the tokens stream from.

A call is a coroutine on the server's event loop: waiting for the scheduler holds no thread, and
a router that goes away (its client left) cancels the call, which drops the prompt from the queue
or stops it at its next chunk edge.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable

import grpc

from epd import discovery, errors, handoff, logs, memory_plan, routing, rpc
from epd.config import ServeConfig
from epd.discovery import Membership, RoleContext
from epd.lm import HybridState, TextModelRunner
from epd.metrics import Family, counter, serve_metrics
from epd.modelinfo import ModelInfo
from epd.sampling import check_vocab
from epd.store import EmbeddingStore
from epd.tensors import configure_threads, default_device, freeze_startup_heap, release_thread_team
from epd.v1 import epd_pb2, epd_pb2_grpc
from epd.wire import logprobs_to_proto, prompt_logprob_to_proto, sampling_from_proto
from prefill_svc.engine import PrefillEngine

log = logging.getLogger(__name__)


class PrefillServicer(epd_pb2_grpc.PrefillServicer):
    def __init__(self, engine: PrefillEngine, decode: discovery.Targets,
                 local_handoff: Callable[[epd_pb2.HandoffHeader, HybridState, str], str] | None = None,
                 host: str = "127.0.0.1", shared_memory: bool = True) -> None:
        """``local_handoff(header, state, log_id)``: a decode engine in this process (an aggregated
        replica) takes the state as it is and returns the address its tokens stream from, or raises
        ``errors.ResourceExhausted`` when it is full; a handoff goes there first. ``host``: the
        address this server binds; a decode worker on it (or on loopback) is sent its handoffs
        through this host's shared memory, unless ``shared_memory`` is off."""
        self.engine = engine
        self._decode = decode  # the decode replicas; each handoff goes to the least busy one
        self._local_handoff = local_handoff
        self.waits = 0  # pauses because every decode worker's queue was full
        # handoffs by how the state went: "local" to the decode engine of this process (no bytes
        # move), "shared_memory" through a file of this host's shared memory, "stream" over gRPC
        self.handoffs = {"local": 0, "shared_memory": 0, "stream": 0}
        self._host = host
        self._shared = shared_memory and bool(handoff.shared_dir())
        if self._shared:  # the files a killed predecessor left behind
            handoff.remove_stale_shared()
        self._streams_only: set[str] = set()  # decode addresses that cannot read this host's shared memory
        self._drops: set[asyncio.Task] = set()  # handoffs being dropped (their callers left)

    @rpc.unary_errors
    async def Prefill(self, request: epd_pb2.PrefillRequest, context) -> epd_pb2.PrefillResponse:
        sampling = sampling_from_proto(request.sampling)
        check_vocab(sampling, self.engine.runner.vocab_size)
        size = self.engine.prompt_bytes(len(request.token_ids))
        self.engine.held.take(size)  # RESOURCE_EXHAUSTED past prefill.max_held_mb, before any work
        try:
            return await self._prefill(request, sampling, context)
        finally:
            self.engine.held.give_back(size)

    async def _prefill(self, request: epd_pb2.PrefillRequest, sampling, context) -> epd_pb2.PrefillResponse:
        result = await self.engine.run_async(request, sampling)
        reply = epd_pb2.PrefillResponse(
            first_token=result.first_token,
            first_logprobs=logprobs_to_proto(result.logprobs),
            prefill_s=result.prefill_s,
            store_read_s=result.store_read_s,
            queue_s=result.queue_s,
            cached_tokens=result.cached_tokens,
            prompt_logprobs=[prompt_logprob_to_proto(entry) for entry in result.prompt_logprobs],
            stored_prefix_keys=result.stored_keys,
        )
        if result.finish_reason is not None:
            reply.finished = True
            reply.finish_reason = result.finish_reason.value
            return reply
        start = time.perf_counter()
        header = epd_pb2.HandoffHeader(
            request_id=request.request_id,
            prompt_len=len(request.token_ids),
            rope_delta=result.rope_delta,
            first_token=result.first_token,
            sampling=request.sampling,
            deadline_unix=request.deadline_unix,
            num_generated=request.num_generated + 1,
        )
        if sampling.needs_answer:  # what decode's penalties or grammar read: the answer so far, the prompt's tokens
            prompt_len = len(request.token_ids) - request.num_generated
            header.generated_token_ids.extend([*request.token_ids[prompt_len:], result.first_token])
            if sampling.needs_prompt:
                header.prompt_token_set.extend(sorted(set(request.token_ids[:prompt_len])))
        try:
            reply.decode_addr = await self._hand_off(header, result.state, context)
        except asyncio.CancelledError:  # computed, and the caller left while it was handed off
            self.engine.num_cancelled["handoff"] += 1
            raise
        # Decode holds it now; were the caller to leave before this reply reaches it, no stream
        # would ever claim it: drop it then, rather than decode it until its lease runs out.
        loop = asyncio.get_running_loop()
        context.add_done_callback(lambda ctx: ctx.cancelled() and loop.call_soon_threadsafe(
            self._orphaned, reply.decode_addr, header.request_id))
        reply.handoff_s = time.perf_counter() - start
        reply.handoff_bytes = result.state.nbytes()
        return reply


    async def _hand_off(self, header: epd_pb2.HandoffHeader, state, context) -> str:
        """Hand the state to the least busy decode worker with room: a place is reserved first
        (``Reserve``: a decode worker whose waiting queue is full says RESOURCE_EXHAUSTED and the
        next is tried), then the bytes go to that worker. While every one is full the state waits
        here, retried with a growing pause, until the request's deadline: back-pressure reaches
        this worker's own budget (``prefill.max_held_mb``) instead of decode's memory."""
        pause = 0.02
        while True:
            if self._local_handoff is not None:
                try:  # this process decodes it: no bytes move, its state joins the batch as it is
                    address = await rpc.run_or_undo(lambda address: self._orphaned(address, header.request_id),
                                                    self._local_handoff, header, state, logs.REQUEST_ID.get())
                    self.handoffs["local"] += 1
                    return address
                except errors.ResourceExhausted:
                    pass  # full here: another decode endpoint (another aggregated replica) may take it
            path = None  # the shared-memory file of this try, if the state went that way
            try:
                need = header.prompt_len + header.sampling.max_tokens - header.num_generated
                _, address = await self._decode.call("Reserve", header, timeout=context.time_remaining(),
                                                     busy_next=True, route=routing.DecodeRoute(need))
                if self._shared and address not in self._streams_only and _same_host(address, self._host):
                    path = await _write_shared(header, state)
                try:
                    parts = handoff.shared_parts(header) if path else handoff.chunks_async(header, state)
                    await self._decode.call_at(address, "Handoff", parts, timeout=context.time_remaining())
                except asyncio.CancelledError:  # the caller left: decode may hold it already (its ack
                    self._orphaned(address, header.request_id)  # was on its way back), and nobody claims it
                    raise
                finally:
                    if path:
                        handoff.remove_shared(path)  # decode removed it as it mapped it, unless it failed
                self.handoffs["shared_memory" if path else "stream"] += 1
                return address
            except grpc.aio.AioRpcError as error:  # the reserved worker failed under the handoff
                if path and error.code() is grpc.StatusCode.FAILED_PRECONDITION:
                    # it cannot see this host's shared memory: stream to it from now on, at once
                    log.info("decode at %s cannot read this host's shared memory (%s); streaming handoffs to it",
                             address, error.details())
                    self._streams_only.add(address)
                    continue
                if not rpc.peer_failed(error) and error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise rpc.RpcFailure.from_rpc_error(error, "decode") from None
                log.warning("decode at %s failed the handoff of %s (%s); trying again", address,
                            header.request_id, error.code().name)
            except rpc.RpcFailure as failure:
                if failure.code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
            remaining = context.time_remaining()
            if remaining is not None and remaining < pause + 0.1:
                raise errors.ResourceExhausted("prefill: every decode worker stayed full until the request's "
                                               "deadline")
            self.waits += 1
            await asyncio.sleep(pause)
            pause = min(0.5, pause * 2)

    def metrics(self) -> list[Family]:
        family = counter("epd_prefill_handoffs_total", "Prompt states handed to decode, by how they went: local "
                         "(this process decodes it), shared_memory (a file of this host's shared memory), stream "
                         "(bytes over gRPC)", "path")
        for path, count in self.handoffs.items():
            family.add(count, path)
        return [family]

    def _orphaned(self, address: str, request_id: str) -> None:
        """Request ``request_id``, handed off to ``address``, lost its caller before the caller
        learnt where it went: drop it there in the background (on this server's loop)."""
        log.info("request %s: its caller left as it was handed off to %s; dropping it there", request_id, address)
        task = asyncio.ensure_future(discovery.drop_handoff(self._decode, address, request_id))
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)


def _same_host(address: str, host: str) -> bool:
    """Whether the worker at ``address`` (``HOST:PORT``) shares this host: it is on loopback or
    on the address this server binds. A guess that only chooses the first try: a worker that
    cannot read the shared file says so, and gets streams."""
    name = address.rsplit(":", 1)[0].strip("[]")
    if name == host or name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


async def _write_shared(header: epd_pb2.HandoffHeader, state: HybridState) -> str | None:
    """``handoff.write_shared`` on an executor thread; a caller that leaves during the write
    leaves no file behind (it is removed once written)."""
    write = asyncio.get_running_loop().run_in_executor(None, handoff.write_shared, header, state)
    try:
        return await asyncio.shield(write)
    except asyncio.CancelledError:
        write.add_done_callback(lambda done: done.exception() is None and done.result()
                                and handoff.remove_shared(done.result()))
        raise


class PrefillServer(rpc.RoleServer):
    """Hosts the Prefill service in its own process (a Ray actor the controller makes). It reports
    SERVING while a decode replica takes handoffs."""

    def __init__(self, serve: ServeConfig, context: RoleContext) -> None:
        rpc.configure(serve.rpc)
        config = serve.prefill
        configure_threads(config.num_threads, config.cpus)
        # before a weight is read: a model or budget that cannot fit is refused in one line
        memory_plan.check_role(serve.model_dir, "prefill", serve, *memory_plan.device_available(default_device()))
        info = ModelInfo.load(serve.model_dir)
        self._tp = None
        states = None
        if config.tensor_parallel > 1:  # this process is rank 0; it starts and leads the others
            from prefill_svc.tensor_parallel import TensorParallelGroup

            self._tp = TensorParallelGroup(serve.model_dir, config.tensor_parallel, config.dtype, config.prepack,
                                           config.num_threads, config.cpus)
            runner = states = self._tp.runner  # the runner keeps the prompts' states, a shard on every rank
        else:
            runner = TextModelRunner.load(serve.model_dir, dtype=config.dtype, prepack=config.prepack)
        self.engine = PrefillEngine(runner, info, EmbeddingStore.from_config(serve.store), config, states=states)
        internal = rpc.internal_transport(serve.security)
        self._decode = discovery.decode_targets(context, internal, serve.replica_wait_s)
        servicer = PrefillServicer(self.engine, self._decode, host=context.host,
                                   shared_memory=config.shared_memory_handoff)
        self._serve([(epd_pb2_grpc.add_PrefillServicer_to_server, servicer, "epd.v1.Prefill")], context.host, internal,
                    healthy=lambda: self._decode.balancer.num_available() > 0)
        self._metrics = serve_metrics(lambda: [*self.engine.metrics(), *servicer.metrics()], self.host,
                                      config.metrics_port)
        freeze_startup_heap()  # before it takes work: see epd/tensors.py
        self.membership = Membership(context, address=self.address(), load=self.engine.load)
        self.engine.on_stored = self.membership.report_soon  # the router routes on it: tell it soon
        release_thread_team()  # the engine's thread runs the forwards (epd/tensors.py)

    def work(self) -> dict[str, float]:
        """Its prefill work since it started (``PrefillEngine.work``): the bench compares replicas by it."""
        return self.engine.work()

    def stop(self, grace_s: float = 1.0) -> None:
        self.membership.close()
        self._decode.close()
        super().stop(grace_s)
        self.engine.stop()
        if self._tp is not None:
            self._tp.stop()
        if self._metrics is not None:
            self._metrics.shutdown()
