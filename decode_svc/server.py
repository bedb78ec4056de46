"""The Decode gRPC service: receives handoffs, streams tokens to whoever claims them.

Each stream is a coroutine on the server's event loop fed by the engine's loop thread through an
``asyncio.Queue``, so the number of streams is bounded by ``decode.max_batch_size`` and memory,
never by a thread pool. A stream whose client goes away cancels its request at once.

A handoff is checked against the K/V pool from its header, before its bytes are read: one that
could never fit is INVALID_ARGUMENT, one the waiting queue has no room for RESOURCE_EXHAUSTED
(prefill then tries another decode worker, or waits). The event loop never builds tensors nor
waits on the engine's lock: rebuilding the state and every call into the engine run on the
executor's threads, so streams and health probes are answered while the compute thread copies.
"""

from __future__ import annotations

import asyncio

from decode_svc.engine import DecodeEngine
from decode_svc.scheduler import TokenEvent
from epd import errors, handoff, logs, memory_plan, rpc
from epd.config import ServeConfig
from epd.discovery import Membership, RoleContext
from epd.grammar import tokenizer_for as grammar_tokenizer_for
from epd.lm import TextModelRunner
from epd.metrics import serve_metrics
from epd.modelinfo import ModelInfo
from epd.request import FinishReason
from epd.sampling import history_for
from epd.tensors import configure_threads, default_device, freeze_startup_heap, release_thread_team
from epd.v1 import epd_pb2, epd_pb2_grpc
from epd.wire import logprobs_to_proto, sampling_from_proto


class DecodeServicer(epd_pb2_grpc.DecodeServicer):
    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine

    @rpc.unary_errors
    async def Reserve(self, header: epd_pb2.HandoffHeader, context) -> epd_pb2.HandoffAck:
        """Hold a place for a handoff before its bytes are sent: a refusal here costs the sender
        nothing (a refusal in the middle of a client stream races the sender's writes)."""
        max_len = self.engine.runner.model.config.max_position_embeddings
        if not header.request_id or not 1 <= header.prompt_len <= max_len:
            raise ValueError(f"reserve: a request id and a prompt_len in [1, {max_len}] are needed, got "
                             f"{header.request_id[:64]!r} and {header.prompt_len}")
        await asyncio.get_running_loop().run_in_executor(
            None, self.engine.check_handoff, header.request_id, header.prompt_len, header.sampling.max_tokens,
            max(1, header.num_generated))
        return epd_pb2.HandoffAck(request_id=header.request_id)

    @rpc.unary_errors
    async def Handoff(self, request_iterator, context) -> epd_pb2.HandoffAck:
        engine, loop = self.engine, asyncio.get_running_loop()
        runner = engine.runner
        receiver = handoff.Receiver(runner.num_layers, runner.device, runner)  # checks the header first
        held = ""
        try:
            async for part in request_iterator:
                receiver.add(part)
                if not held and receiver.header is not None:
                    header = receiver.header
                    await loop.run_in_executor(None, engine.check_handoff, header.request_id, header.prompt_len,
                                               header.sampling.max_tokens, max(1, header.num_generated))
                    held = header.request_id
            received = await loop.run_in_executor(None, receiver.finish)
            request_id = received.header.request_id
            # a sender that leaves as the request joins has nobody to claim it: it is dropped then
            await rpc.run_or_undo(lambda _: loop.run_in_executor(None, engine.cancel, request_id),
                                  submit_handoff, engine, received.header, received.state, logs.REQUEST_ID.get())
            held = ""
        finally:
            if held:  # the stream broke or was malformed after its place was held
                await loop.run_in_executor(None, engine.release, held)
        return epd_pb2.HandoffAck(request_id=header.request_id)

    @rpc.stream_errors
    async def Stream(self, request: epd_pb2.StreamRequest, context):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:  # called on the engine's thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        # a claim whose caller leaves as it is made is dropped (a claimed request has no lease)
        def drop(claimed) -> None:
            if claimed is not None:
                loop.run_in_executor(None, self.engine.cancel, request.request_id)

        if await rpc.run_or_undo(drop, self.engine.claim, request.request_id, sink) is None:
            raise errors.NotFound(f"no handed-off request {request.request_id!r} to stream")
        finished = False
        try:
            while not finished:
                batch = [await events.get()]
                if batch[-1].finish_reason is None:  # group what follows within a moment
                    await asyncio.sleep(self.engine.config.stream_group_s)
                    while not events.empty() and batch[-1].finish_reason is None:
                        batch.append(events.get_nowait())
                finished = batch[-1].finish_reason is not None
                yield _token_batch(batch)
        finally:
            if not finished:  # the client left (or the server is stopping): free the slot now
                loop.run_in_executor(None, self.engine.cancel, request.request_id)


def submit_handoff(engine: DecodeEngine, header: epd_pb2.HandoffHeader, state, log_id: str = "") -> None:
    """A handoff whose state has arrived (or, on an aggregated replica, whose prefill ran in this
    process: the state is the prefill's own, never serialized) joins the engine's queue; its place
    was held by ``check_handoff``. Blocking (its grammar is compiled here): an executor's thread."""
    sampling = sampling_from_proto(header.sampling)
    if sampling.needs_answer and len(header.generated_token_ids) != max(1, header.num_generated):
        raise ValueError("handoff: the request has a penalty or a grammar but its header lacks "
                         "generated_token_ids")
    grammar = None
    if sampling.grammar:  # its matcher fed the answer so far (a resumed request's too)
        grammar = engine.grammar_state(sampling.grammar, list(header.generated_token_ids))
    engine.submit(
        request_id=header.request_id,
        prompt_len=header.prompt_len,
        rope_delta=header.rope_delta,
        first_token=header.first_token,
        sampling=sampling,
        state=state,
        deadline_unix=header.deadline_unix,
        num_generated=max(1, header.num_generated),
        history=history_for(sampling, header.prompt_token_set, header.generated_token_ids),
        log_id=log_id,
        grammar=grammar,
    )


def _token_batch(events: list[TokenEvent]) -> epd_pb2.TokenBatch:
    tokens = [e for e in events if e.token_id >= 0]
    reason = events[-1].finish_reason
    return epd_pb2.TokenBatch(
        token_ids=[e.token_id for e in tokens],
        logprobs=[logprobs_to_proto(e.logprobs) for e in tokens if e.logprobs is not None],
        finish_reason=reason.value if isinstance(reason, FinishReason) else "",
    )


class DecodeServer(rpc.RoleServer):
    """Hosts the Decode service in its own process (a Ray actor the controller makes)."""

    def __init__(self, serve: ServeConfig, context: RoleContext) -> None:
        rpc.configure(serve.rpc)
        config = serve.decode
        configure_threads(config.num_threads, config.cpus)
        # before a weight is read: a model, pool or batch that cannot fit is refused in one line
        memory_plan.check_role(serve.model_dir, "decode", serve, *memory_plan.device_available(default_device()))
        info = ModelInfo.load(serve.model_dir)
        self._tp = None
        make_batch = None
        if config.tensor_parallel > 1:  # this process is rank 0; it starts and leads the others
            from decode_svc.tensor_parallel import TensorParallelGroup

            self._tp = TensorParallelGroup(serve.model_dir, config.tensor_parallel, config.dtype, config.prepack,
                                           config.num_threads, config.cpus)
            runner, make_batch = self._tp.runner, self._tp.make_batch
        else:
            runner = TextModelRunner.load(serve.model_dir, dtype=config.dtype, prepack=config.prepack, decode=True)
        runner.prepare_decode_kernels()  # a first build happens here, before this replica registers
        self.engine = DecodeEngine(runner, info.eos_token_ids, config,
                                   grammar_tokenizer=lambda: grammar_tokenizer_for(info), make_batch=make_batch)
        self._serve([(epd_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(self.engine), "epd.v1.Decode")],
                    context.host, rpc.internal_transport(serve.security))
        self._metrics = serve_metrics(self.engine.metrics, self.host, config.metrics_port)
        freeze_startup_heap()  # before it takes work: see epd/tensors.py
        self.membership = Membership(context, address=self.address(),
                                     capacity_tokens=self.engine.capacity_tokens(), load=self.engine.load)
        release_thread_team()  # the decode loop's thread runs the forwards (epd/tensors.py)

    def kv_usage(self) -> dict[str, float]:
        """The K/V pool now (``epd status``)."""
        return self.engine.kv_usage()

    def in_flight(self) -> int:
        """Calls running plus requests handed off and not yet finished: a drained decode holds
        no request a router could still come to stream."""
        return super().in_flight() + self.engine.num_held()

    def requests(self) -> int:
        """Requests handed off here and not yet streamed to the end (one per request, whether its
        stream call has come or not)."""
        return self.engine.num_held()

    def stop(self, grace_s: float = 1.0) -> None:
        self.membership.close()
        super().stop(grace_s)
        self.engine.stop()
        if self._tp is not None:
            self._tp.stop()
        if self._metrics is not None:
            self._metrics.shutdown()
