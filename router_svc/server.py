"""The Router gRPC service: the single entry point a gateway calls.

Per request: validate and tokenize (``PromptBuilder``), ask the store which image keys it already
has (one pipelined round trip), send the misses to the encoder pool, send the prefill job, then
relay the decode stream, applying stop strings, and end with a summary.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from epd import rpc
from epd.config import RouterConfig, ServeConfig
from epd.discovery import EncoderTargets, PrefillTargets, RoleContext
from epd.metrics import Family, counter, gauge, serve_metrics
from epd.modelinfo import ModelInfo
from epd.request import FinishReason
from epd.sampling import SamplingConfig
from epd.store import EmbeddingStore
from epd.v1 import epd_pb2, epd_pb2_grpc
from epd.wire import sampling_to_proto
from router_svc.flights import SingleFlight
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
        self._decode = rpc.StubCache(epd_pb2_grpc.DecodeStub)
        self._flights: SingleFlight[epd_pb2.EncodedImage] = SingleFlight()
        self._counts = {"store_hits": 0, "store_misses": 0, "encoded": 0, "prefix_tokens": 0}
        self._counts_lock = threading.Lock()

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
        encoded: set[str] = set()  # store keys this request's encodes produced
        self._ensure_embeddings(prompt, deadline, force=False, timings=timings, encoded=encoded)
        reply = self._prefill_with_retry(request_id, prompt, sampling, deadline, timings, encoded)
        self._count(encoded=len(encoded), prefix_tokens=reply.cached_tokens)
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
            images_encoded=len(encoded),
            seed=sampling.seed,
            cached_tokens=reply.cached_tokens,
            # Every distinct image this request did not encode came from a cache: Redis, the
            # prefill worker's LRU, the prefix cache, or another request's encode it waited on.
            images_cached=len({image.store_key for image in prompt.images} - encoded),
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

    def _ensure_embeddings(self, prompt: Prompt, deadline: float, force: bool, timings: epd_pb2.StageTimings,
                           encoded: set[str]) -> None:
        """Make sure the store has every image of the prompt (encode all of them when ``force``).

        Keys another request is already encoding are waited on, not sent again (single flight).
        Adds the keys this request encoded to ``encoded`` and their costs to ``timings``.
        """
        first_index: dict[str, int] = {}
        for index, image in enumerate(prompt.images):
            first_index.setdefault(image.store_key, index)
        keys = list(first_index)
        present = [False] * len(keys) if force else self.store.exists_many(keys)
        missing = [key for key, ok in zip(keys, present) if not ok]
        if not force:
            self._count(store_hits=len(keys) - len(missing), store_misses=len(missing))
        if not missing:
            return
        led, joined = self._flights.claim(missing)
        results = self._encode_led(prompt, first_index, led, deadline)
        for attempt in range(2):
            retry: list[str] = []
            for key, future in joined.items():
                try:
                    results[key] = future.result(timeout=max(0.0, deadline - time.time()))
                except FutureTimeout:
                    raise rpc.RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         "encoder: deadline passed waiting for another request's encode") from None
                except Exception:  # noqa: BLE001 - the leader's call failed (its deadline, a dead replica)
                    if attempt:
                        raise
                    retry.append(key)
            if not retry:
                break
            own, joined = self._flights.claim(retry)  # try ourselves, or wait on whoever leads it now
            results.update(self._encode_led(prompt, first_index, own, deadline))
            led += own
        for key in missing:
            self._check_encoded(prompt, first_index[key], results[key])
        for key in led:
            encoded.add(key)
            timings.encode_s += results[key].encode_s
            timings.store_write_s += results[key].store_write_s

    def _encode_led(self, prompt: Prompt, first_index: dict[str, int], led: list[str],
                    deadline: float) -> dict[str, epd_pb2.EncodedImage]:
        """One Encode call for the keys this request leads; every waiter gets the outcome."""
        if not led:
            return {}
        items = [
            epd_pb2.EncodeItem(store_key=key, data=prompt.images[first_index[key]].data,
                               max_pixels=prompt.images[first_index[key]].max_pixels)
            for key in led
        ]
        try:
            reply = self._call(self._encoder.Encode, epd_pb2.EncodeRequest(items=items), deadline, "encoder")
        except BaseException as error:
            for key in led:
                self._flights.resolve(key, error=error)
            raise
        results = dict(zip(led, reply.images))
        for key in led:
            self._flights.resolve(key, result=results[key])
        return results

    @staticmethod
    def _check_encoded(prompt: Prompt, index: int, result: epd_pb2.EncodedImage) -> None:
        if result.error:
            raise ValueError(f"image {index}: {result.error}")
        if result.num_tokens != prompt.images[index].info.num_tokens:
            raise rpc.RpcFailure(grpc.StatusCode.INTERNAL, f"image {index}: encoder made {result.num_tokens} "
                                 f"tokens, the header promised {prompt.images[index].info.num_tokens}")

    def _prefill_with_retry(self, request_id: str, prompt: Prompt, sampling: SamplingConfig, deadline: float,
                            timings: epd_pb2.StageTimings, encoded: set[str]) -> epd_pb2.PrefillResponse:
        job = epd_pb2.PrefillRequest(
            request_id=request_id,
            token_ids=prompt.token_ids,
            images=request_images_proto(prompt),
            sampling=sampling_to_proto(sampling),
            deadline_unix=deadline,
        )
        try:
            return self._call(self._prefill.Prefill, job, deadline, "prefill")
        except rpc.RpcFailure as failure:
            if failure.code is not grpc.StatusCode.FAILED_PRECONDITION:
                raise
        # An embedding was evicted between our check and prefill's read: encode again, once.
        self._ensure_embeddings(prompt, deadline, force=True, timings=timings, encoded=encoded)
        return self._call(self._prefill.Prefill, job, deadline, "prefill")

    # ---------------------------------------------------------------- metrics

    def _count(self, **deltas: int) -> None:
        with self._counts_lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def metrics(self) -> list[Family]:
        with self._counts_lock:
            counts = dict(self._counts)
        families = [
            counter("epd_embedding_cache_lookups_total", "Router's store checks of request images", "tier", "result")
            .add(counts["store_hits"], "redis", "hit").add(counts["store_misses"], "redis", "miss"),
            counter("epd_images_encoded_total", "Images this router had encoded").add(counts["encoded"]),
            counter("epd_encode_single_flight_joins_total", "Image encodes waited on instead of sent again")
            .add(self._flights.num_joined),
            counter("epd_prefix_cache_hit_tokens_total", "Prompt tokens prefill took from its prefix cache")
            .add(counts["prefix_tokens"]),
        ]
        try:
            memory = self.store.memory_stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because Redis is briefly away
            return families
        return families + [
            gauge("epd_redis_used_memory_bytes", "Redis used_memory").add(memory["used_memory"]),
            gauge("epd_redis_max_memory_bytes", "Redis maxmemory (0: no cap)").add(memory["maxmemory"]),
            gauge("epd_redis_keys", "Keys in the embedding store's Redis database").add(memory["keys"]),
            counter("epd_redis_evicted_keys_total", "Keys Redis evicted under its memory cap").add(memory["evicted_keys"]),
        ]

    def _relay_decode(self, request_id: str, decode_addr: str, text: TextStream, sampling: SamplingConfig,
                      deadline: float) -> Iterator[epd_pb2.GenerateResponse]:
        stream = self._decode.get(decode_addr).Stream(
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
        stream = self._decode.get(decode_addr).Stream(epd_pb2.StreamRequest(request_id=request_id), timeout=10)
        try:
            next(stream, None)  # the claim has reached decode once anything comes back
        except grpc.RpcError:
            pass  # already gone: nothing to free
        finally:
            stream.cancel()

    @staticmethod
    def _call(method, message, deadline: float, hop: str):
        try:
            return method(message, timeout=max(0.1, deadline - time.time()))
        except grpc.RpcError as error:
            raise rpc.RpcFailure.from_rpc_error(error, hop) from None


def _chunk(token_ids, text: str, logprobs) -> epd_pb2.GenerateResponse:
    return epd_pb2.GenerateResponse(chunk=epd_pb2.TokenChunk(token_ids=list(token_ids), text=text, logprobs=list(logprobs)))


class RouterServer(rpc.RoleServer):
    """Hosts the Router service in its own process (a Ray actor the controller makes); it calls
    whatever Encoder services and prefill replicas the registry lists from moment to moment."""

    def __init__(self, serve: ServeConfig, context: RoleContext) -> None:
        config = serve.router
        info = ModelInfo.load(serve.model_dir)
        builder = PromptBuilder.load(serve.model_dir, info, serve.encode.max_decoded_pixels)
        self._targets = [EncoderTargets(context), PrefillTargets(context)]
        servicer = RouterServicer(config, builder, EmbeddingStore(serve.store.redis_url, serve.store.ttl_s),
                                  *self._targets)
        self._serve(epd_pb2_grpc.add_RouterServicer_to_server, servicer, "epd.v1.Router", context.host, config.port)
        self._metrics = serve_metrics(servicer.metrics, self.host, config.metrics_port)

    def stop(self) -> None:
        for targets in self._targets:
            targets.close()
        super().stop()
        if self._metrics is not None:
            self._metrics.shutdown()
