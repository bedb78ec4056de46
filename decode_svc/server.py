"""The Decode gRPC service: receives handoffs, streams tokens to whoever claims them."""

from __future__ import annotations

import queue

import grpc

from decode_svc.engine import DecodeEngine, TokenEvent
from epd import handoff, rpc
from epd.lm import TextModelRunner
from epd.modelinfo import ModelInfo
from epd.request import FinishReason
from epd.sampling import logprobs_to_proto, sampling_from_proto
from epd.tensors import configure_threads
from epd.v1 import epd_pb2, epd_pb2_grpc

_MAX_BATCH_WAIT_S = 0.02  # how long a stream waits to group more tokens into one message


class DecodeServicer(epd_pb2_grpc.DecodeServicer):
    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine

    @rpc.unary_errors
    def Handoff(self, request_iterator, context) -> epd_pb2.HandoffAck:
        received = handoff.receive(request_iterator, self.engine.runner.num_layers, self.engine.runner.device)
        header = received.header
        self.engine.submit(
            request_id=header.request_id,
            prompt_len=header.prompt_len,
            rope_delta=header.rope_delta,
            first_token=header.first_token,
            sampling=sampling_from_proto(header.sampling),
            state=received.state,
            deadline_unix=header.deadline_unix,
        )
        return epd_pb2.HandoffAck(request_id=header.request_id)

    @rpc.stream_errors
    def Stream(self, request: epd_pb2.StreamRequest, context):
        claimed = self.engine.claim(request.request_id)
        if claimed is None:
            raise rpc.RpcFailure(grpc.StatusCode.NOT_FOUND, f"no handed-off request {request.request_id!r} to stream")
        context.add_callback(lambda: self.engine.cancel(request.request_id))
        while True:
            events = [claimed.outbox.get()]
            while events[-1].finish_reason is None:  # group whatever is already waiting
                try:
                    events.append(claimed.outbox.get(timeout=_MAX_BATCH_WAIT_S if len(events) < 2 else 0))
                except queue.Empty:
                    break
            yield _batch(events)
            if events[-1].finish_reason is not None:
                return


def _batch(events: list[TokenEvent]) -> epd_pb2.TokenBatch:
    tokens = [e for e in events if e.token_id >= 0]
    reason = events[-1].finish_reason
    return epd_pb2.TokenBatch(
        token_ids=[e.token_id for e in tokens],
        logprobs=[logprobs_to_proto(e.logprobs) for e in tokens if e.logprobs is not None],
        finish_reason=reason.value if isinstance(reason, FinishReason) else "",
    )


class DecodeServer(rpc.RoleServer):
    """Hosts the Decode service in its own process (a Ray actor made by the launcher)."""

    def __init__(self, model_dir: str, dtype: str = "float32", lease_s: float = 30.0,
                 num_threads: int = 0, host: str = "127.0.0.1", max_batch_size: int = 32) -> None:
        configure_threads(num_threads)
        info = ModelInfo.load(model_dir)
        runner = TextModelRunner.load(model_dir, dtype=dtype)
        self.engine = DecodeEngine(runner, info.eos_token_ids, lease_s, max_batch_size)
        servicer = DecodeServicer(self.engine)
        self._serve(epd_pb2_grpc.add_DecodeServicer_to_server, servicer, "epd.v1.Decode", host)

    def in_flight(self) -> int:
        """Calls running plus requests handed off and not yet finished: a drained decode holds
        no request a router could still come to stream."""
        return super().in_flight() + len(self.engine.scheduler.requests)

    def stop(self) -> None:
        super().stop()
        self.engine.stop()
