"""The Router gRPC service: the single entry point a gateway calls.

Per request: validate and tokenize (``PromptBuilder``), ask the store which image keys it already
has (one pipelined round trip), send the misses to the encoder pool, send the prefill job, then
relay the decode stream, applying stop strings, and end with a summary.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Iterator

import grpc

from epd import rpc
from epd.config import RouterConfig
from epd.discovery import EncoderTargets, PrefillTargets
from epd.modelinfo import ModelInfo
from epd.request import FinishReason
from epd.sampling import SamplingConfig
from epd.store import EmbeddingStore
from epd.v1 import epd_pb2, epd_pb2_grpc
from router_svc.prompt import Prompt, PromptBuilder, request_images_proto
from router_svc.text import TextStream


class RouterServicer(epd_pb2_grpc.RouterServicer):
    def __init__(self, config: RouterConfig, builder: PromptBuilder, store: EmbeddingStore,
                 encoder: EncoderTargets, prefill: PrefillTargets) -> None:
        self.config = config
        self.builder = builder
        self.store = store
        self.max_model_len = config.max_model_len or builder.info.max_position_embeddings
        self._encoder = encoder  # Encode() goes to the least busy Encoder service (epd.discovery)
        self._prefill = prefill  # Prefill() goes to the least busy prefill replica
        self._decode_stubs: dict[str, epd_pb2_grpc.DecodeStub] = {}

    @rpc.stream_errors
    def Generate(self, request: epd_pb2.GenerateRequest, context) -> Iterator[epd_pb2.GenerateResponse]:
        start = time.perf_counter()
        request_id = request.request_id or uuid.uuid4().hex
        sampling = self._resolve_sampling(request.sampling)
        max_pixels = request.max_pixels if request.HasField("max_pixels") else None
        prompt = self.builder.build(request.messages, max_pixels, request.enable_thinking)
        self._check_length(len(prompt.token_ids), sampling.max_tokens)
        deadline = time.time() + min(self.config.request_timeout_s, context.time_remaining() or float("inf"))

        timings = epd_pb2.StageTimings()
        num_encoded = self._ensure_embeddings(prompt, deadline, force=False, timings=timings)
        reply, retried = self._prefill_with_retry(request_id, prompt, sampling, deadline, timings)
        num_encoded += retried
        timings.MergeFrom(epd_pb2.StageTimings(
            store_read_s=reply.store_read_s, prefill_s=reply.prefill_s, handoff_s=reply.handoff_s,
            handoff_bytes=reply.handoff_bytes, queue_s=reply.queue_s))
        ttft = time.perf_counter() - start

        text = TextStream(self.builder.tokenizer, list(request.sampling.stop))
        yield _chunk([reply.first_token], text.add([reply.first_token]),
                     [reply.first_logprobs] if sampling.logprobs else [])
        finish = reply.finish_reason if reply.finished else ""
        if text.stopped and not finish:
            finish = FinishReason.STOP.value
            self._release_decode(request_id, reply.decode_addr)
        if not finish:
            finish = yield from self._relay_decode(request_id, reply.decode_addr, text, sampling, deadline)
        tail = text.flush()
        if tail:
            yield _chunk([], tail, [])
        yield epd_pb2.GenerateResponse(summary=epd_pb2.Summary(
            request_id=request_id,
            prompt_tokens=len(prompt.token_ids),
            image_tokens=prompt.num_image_tokens,
            completion_tokens=len(text.token_ids),
            finish_reason=finish,
            ttft_s=ttft,
            e2e_s=time.perf_counter() - start,
            images=len(prompt.images),
            images_encoded=num_encoded,
            seed=sampling.seed,
            cached_tokens=reply.cached_tokens,
            images_cached=max(0, len({image.store_key for image in prompt.images}) - num_encoded),
            timings=timings,
        ))

    # ---------------------------------------------------------------- steps

    def _resolve_sampling(self, params: epd_pb2.SamplingParams) -> SamplingConfig:
        max_tokens = params.max_tokens if params.HasField("max_tokens") else self.config.default_max_tokens
        if max_tokens > self.config.max_tokens_limit:
            raise ValueError(f"max_tokens must be at most {self.config.max_tokens_limit}, got {max_tokens}")
        temperature = params.temperature if params.HasField("temperature") else 0.0
        seed = params.seed if params.HasField("seed") else (secrets.randbits(63) if temperature > 0 else 0)
        return SamplingConfig(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=params.top_p if params.HasField("top_p") else 1.0,
            top_k=params.top_k if params.HasField("top_k") else 0,
            seed=seed,
            ignore_eos=params.ignore_eos,
            logprobs=params.logprobs,
        )

    def _check_length(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"prompt is {prompt_len} tokens, longer than the context window of {self.max_model_len} tokens"
            )
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the context window of "
                f"{self.max_model_len} tokens; lower max_tokens to at most {self.max_model_len - prompt_len}"
            )

    def _ensure_embeddings(self, prompt: Prompt, deadline: float, force: bool,
                           timings: epd_pb2.StageTimings) -> int:
        """Encode the images the store lacks (all of them when ``force``); returns how many ran,
        adding their encode and store-write times to ``timings``."""
        first_index: dict[str, int] = {}
        for index, image in enumerate(prompt.images):
            first_index.setdefault(image.store_key, index)
        keys = list(first_index)
        present = [False] * len(keys) if force else self.store.exists_many(keys)
        missing = [key for key, ok in zip(keys, present) if not ok]
        if not missing:
            return 0
        items = [
            epd_pb2.EncodeItem(store_key=key, data=prompt.images[first_index[key]].data,
                               max_pixels=prompt.images[first_index[key]].max_pixels)
            for key in missing
        ]
        reply = self._call(self._encoder.Encode, epd_pb2.EncodeRequest(items=items), deadline, "encoder")
        for key, encoded in zip(missing, reply.images):
            index = first_index[key]
            if encoded.error:
                raise ValueError(f"image {index}: {encoded.error}")
            if encoded.num_tokens != prompt.images[index].info.num_tokens:
                raise rpc.RpcFailure(grpc.StatusCode.INTERNAL, f"image {index}: encoder made {encoded.num_tokens} "
                                     f"tokens, the header promised {prompt.images[index].info.num_tokens}")
            timings.encode_s += encoded.encode_s
            timings.store_write_s += encoded.store_write_s
        return len(missing)

    def _prefill_with_retry(self, request_id: str, prompt: Prompt, sampling: SamplingConfig,
                            deadline: float, timings: epd_pb2.StageTimings) -> tuple[epd_pb2.PrefillResponse, int]:
        job = epd_pb2.PrefillRequest(
            request_id=request_id,
            token_ids=prompt.token_ids,
            images=request_images_proto(prompt),
            sampling=epd_pb2.ResolvedSampling(
                max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, seed=sampling.seed, ignore_eos=sampling.ignore_eos, logprobs=sampling.logprobs,
            ),
            deadline_unix=deadline,
        )
        try:
            return self._call(self._prefill.Prefill, job, deadline, "prefill"), 0
        except rpc.RpcFailure as failure:
            if failure.code is not grpc.StatusCode.FAILED_PRECONDITION:
                raise
        # An embedding was evicted between our check and prefill's read: encode again, once.
        encoded = self._ensure_embeddings(prompt, deadline, force=True, timings=timings)
        return self._call(self._prefill.Prefill, job, deadline, "prefill"), encoded

    def _relay_decode(self, request_id: str, decode_addr: str, text: TextStream, sampling: SamplingConfig,
                      deadline: float) -> Iterator[epd_pb2.GenerateResponse]:
        stream = self._decode_stub(decode_addr).Stream(
            epd_pb2.StreamRequest(request_id=request_id), timeout=max(0.1, deadline - time.time())
        )
        try:
            for batch in stream:
                delta = text.add(batch.token_ids)
                yield _chunk(batch.token_ids, delta, batch.logprobs if sampling.logprobs else [])
                if text.stopped:
                    return FinishReason.STOP.value
                if batch.finish_reason == FinishReason.ERROR.value:
                    raise rpc.RpcFailure(grpc.StatusCode.INTERNAL, "decode failed this request (see the decode log)")
                if batch.finish_reason == FinishReason.DEADLINE.value:
                    raise rpc.RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "request passed its deadline in decode")
                if batch.finish_reason:
                    return batch.finish_reason
        except grpc.RpcError as error:
            raise rpc.RpcFailure.from_rpc_error(error, "decode") from None
        finally:
            stream.cancel()  # a stop string or a departed client frees the decode slot now
        raise rpc.RpcFailure(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")

    def _release_decode(self, request_id: str, decode_addr: str) -> None:
        """Claim and drop a handed-off request the router no longer needs (a stop string in the
        first token), freeing its decode slot now instead of when its lease runs out."""
        stream = self._decode_stub(decode_addr).Stream(epd_pb2.StreamRequest(request_id=request_id), timeout=10)
        try:
            next(stream, None)  # the claim has reached decode once anything comes back
        except grpc.RpcError:
            pass  # already gone: nothing to free
        finally:
            stream.cancel()

    def _decode_stub(self, decode_addr: str) -> epd_pb2_grpc.DecodeStub:
        stub = self._decode_stubs.get(decode_addr)
        if stub is None:
            stub = self._decode_stubs.setdefault(decode_addr, epd_pb2_grpc.DecodeStub(rpc.channel(decode_addr)))
        return stub

    @staticmethod
    def _call(method, message, deadline: float, hop: str):
        try:
            return method(message, timeout=max(0.1, deadline - time.time()))
        except grpc.RpcError as error:
            raise rpc.RpcFailure.from_rpc_error(error, hop) from None


def _chunk(token_ids, text: str, logprobs) -> epd_pb2.GenerateResponse:
    return epd_pb2.GenerateResponse(chunk=epd_pb2.TokenChunk(token_ids=list(token_ids), text=text, logprobs=list(logprobs)))


class RouterServer(rpc.RoleServer):
    """Hosts the Router service in its own process (a Ray actor made by the launcher)."""

    def __init__(self, model_dir: str, redis_url: str, encoder_addr: str, prefill_addr: str,
                 config: RouterConfig, max_decoded_pixels: int, *, registry=None, name: str = "router",
                 poll_s: float = 0.25) -> None:
        """Calls the fixed ``encoder_addr`` and ``prefill_addr``, or, given a registry, the Encoder
        services and prefill replicas it lists from moment to moment."""
        info = ModelInfo.load(model_dir)
        builder = PromptBuilder.load(model_dir, info, max_decoded_pixels)
        self._targets = [EncoderTargets(registry, encoder_addr, watcher=name, poll_s=poll_s),
                         PrefillTargets(registry, prefill_addr, watcher=name, poll_s=poll_s)]
        servicer = RouterServicer(config, builder, EmbeddingStore(redis_url), *self._targets)
        self._serve(epd_pb2_grpc.add_RouterServicer_to_server, servicer, "epd.v1.Router", config.host, config.port)

    def stop(self) -> None:
        for targets in self._targets:
            targets.close()
        super().stop()
