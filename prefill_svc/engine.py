"""Prefill: pull embeddings, splice them into the prompt, run it, sample, hand off to decode.

``PrefillEngine`` owns the runner and the store client; one prompt runs at a time (a forward
already uses every core it is given). M-RoPE positions are computed here from the request alone
(``epd.positions``), never read from a shared model object.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc
import torch

from epd import handoff, positions, rpc
from epd.discovery import DecodeTargets
from epd.lm import HybridState, TextModelRunner
from epd.modelinfo import ModelInfo
from epd.request import FinishReason
from epd.sampling import SamplingConfig, TokenLogprobs, logprobs_to_proto, sample, sampling_from_proto
from epd.store import EmbeddingStore
from epd.v1 import epd_pb2, epd_pb2_grpc


@dataclass
class PrefillResult:
    first_token: int
    logprobs: TokenLogprobs | None
    state: HybridState
    rope_delta: int
    finish_reason: FinishReason | None
    prefill_s: float
    store_read_s: float = 0.0
    queue_s: float = 0.0


class PrefillEngine:
    def __init__(self, runner: TextModelRunner, info: ModelInfo, store: EmbeddingStore) -> None:
        self.runner = runner
        self.info = info
        self.store = store
        self._lock = threading.Lock()

    def run(self, request: epd_pb2.PrefillRequest, sampling: SamplingConfig) -> PrefillResult:
        token_ids = list(request.token_ids)
        if not token_ids:
            raise ValueError("prompt is empty")
        grids = [(ref.merged_height, ref.merged_width) for ref in request.images]
        spans = positions.find_image_spans(token_ids, self.info.image_token_id, grids)
        read_start = time.perf_counter()
        image_embeds = self._fetch_embeddings(request.images)
        queued = time.perf_counter()
        with self._lock:
            start = time.perf_counter()
            embeds = self.runner.embed(torch.tensor(token_ids, dtype=torch.long)).clone()
            for span, tensor in zip(spans, image_embeds):
                embeds[span.start : span.end] = tensor.to(embeds.device, embeds.dtype)
            pos, rope_delta = positions.mrope_positions(len(token_ids), spans)
            state = self.runner.new_state()
            hidden = self.runner.forward(embeds, pos, state)
            logits = self.runner.logits(hidden)
        token, logprobs = sample(logits, sampling, step=0)
        return PrefillResult(
            first_token=token,
            logprobs=logprobs,
            state=state,
            rope_delta=rope_delta,
            finish_reason=self._finish_reason(token, sampling),
            prefill_s=time.perf_counter() - start,
            store_read_s=queued - read_start,
            queue_s=start - queued,
        )

    def _fetch_embeddings(self, images) -> list[torch.Tensor]:
        keys = [ref.store_key for ref in images]
        unique = list(dict.fromkeys(keys))
        found = dict(zip(unique, self.store.get_many(unique)))
        out = []
        for index, ref in enumerate(images):
            embedding = found[ref.store_key]
            if embedding is None:
                # The router re-encodes on this status: an eviction between its check and this
                # read must cost a retry, never a failed request.
                raise rpc.RpcFailure(
                    grpc.StatusCode.FAILED_PRECONDITION, f"embedding of image {index} is not in the store: {ref.store_key}"
                )
            expected = (ref.merged_height * ref.merged_width, self.info.hidden_size)
            if tuple(embedding.tensor.shape) != expected:
                raise rpc.RpcFailure(
                    grpc.StatusCode.INTERNAL,
                    f"embedding of image {index} has shape {tuple(embedding.tensor.shape)}, expected {expected}",
                )
            out.append(embedding.tensor)
        return out

    def _finish_reason(self, token: int, sampling: SamplingConfig) -> FinishReason | None:
        if token in self.info.eos_token_ids and not sampling.ignore_eos:
            return FinishReason.EOS
        if sampling.max_tokens <= 1:
            return FinishReason.LENGTH
        return None


class PrefillServicer(epd_pb2_grpc.PrefillServicer):
    def __init__(self, engine: PrefillEngine, decode: DecodeTargets) -> None:
        self.engine = engine
        self._decode = decode  # the decode replicas; each handoff goes to the least busy one

    @rpc.unary_errors
    def Prefill(self, request: epd_pb2.PrefillRequest, context) -> epd_pb2.PrefillResponse:
        sampling = sampling_from_proto(request.sampling)
        result = self.engine.run(request, sampling)
        reply = epd_pb2.PrefillResponse(
            first_token=result.first_token,
            first_logprobs=logprobs_to_proto(result.logprobs),
            prefill_s=result.prefill_s,
            store_read_s=result.store_read_s,
            queue_s=result.queue_s,
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
        )
        try:
            decode_addr = self._decode.handoff(handoff.chunks(header, result.state), timeout=context.time_remaining())
        except grpc.RpcError as error:
            raise rpc.RpcFailure.from_rpc_error(error, "decode handoff") from None
        reply.handoff_s = time.perf_counter() - start
        reply.handoff_bytes = result.state.nbytes()
        reply.decode_addr = decode_addr
        return reply


class PrefillServer(rpc.RoleServer):
    """Hosts the Prefill service in its own process (a Ray actor made by the launcher)."""

    def __init__(self, model_dir: str, redis_url: str, decode_addr: str = "", dtype: str = "float32",
                 num_threads: int = 0, host: str = "127.0.0.1", *, registry=None, name: str = "prefill",
                 poll_s: float = 0.25) -> None:
        """Hands off to ``decode_addr``, or, given a registry, to the decode replicas it lists."""
        if num_threads:
            torch.set_num_threads(num_threads)
        info = ModelInfo.load(model_dir)
        runner = TextModelRunner.load(model_dir, dtype=dtype)
        self._decode = DecodeTargets(registry, decode_addr, watcher=name, poll_s=poll_s)
        servicer = PrefillServicer(PrefillEngine(runner, info, EmbeddingStore(redis_url)), self._decode)
        self._serve(epd_pb2_grpc.add_PrefillServicer_to_server, servicer, "epd.v1.Prefill", host)

    def stop(self) -> None:
        self._decode.close()
        super().stop()
