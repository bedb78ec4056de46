"""The router's request path, on the router's event loop, for every public front (gRPC today).

Per request: validate and tokenize (``PromptBuilder``), ask the store which image keys it already
has (one pipelined round trip), send the misses to an Encoder service, send the prefill job, then
relay the decode stream, applying stop strings, and end with a summary.

What may fail, and what happens (``docs/RELIABILITY.md``):
- an Encoder service, prefill or decode replica that dies under a call: the call goes to another
  replica of that role (``discovery.Targets``); encoding is content-keyed, a prefill whose worker
  died never reached decode under that attempt's id;
- the decode worker of a running stream: the request *resumes*: prefill runs the prompt plus the
  tokens already streamed (the prefix cache keeps this cheap) and samples the next token with the
  same sampling state, another decode worker continues; the client sees no gap and no repeat;
- the store: embeddings travel inline in the Encode reply and the Prefill request instead.
Internal request ids are made here (unique per deployment, per attempt); a client's id is only
echoed in the summary. The public id (``epd.logs.REQUEST_ID``: the client's, ``chatcmpl-...``, or a
fresh one) travels in every call's metadata, the same on every attempt, so each role's log lines
about the request name it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

import grpc

from epd import discovery, errors, grammar, limits, logs, prefix, routing, rpc
from epd.config import RouterConfig
from epd.metrics import Family, counter, gauge
from epd.request import FinishReason
from epd.sampling import MAX_TOKEN_LIST, SamplingConfig, check_vocab
from epd.store import EmbeddingStore, StoreUnavailable
from epd.v1 import epd_pb2
from epd.wire import sampling_to_proto
from router_svc.flights import SingleFlight
from router_svc.prompt import Prompt, PromptBuilder, request_images_proto
from router_svc.request import RouterRequest, RouteStatus
from router_svc.text import TextStream

log = logging.getLogger(__name__)

STAGES = ("tokenize", "encode", "prefill", "decode")
HASH_ON_LOOP_TOKENS = 4096  # a longer prompt's prefix keys are computed in a worker thread, not on the loop
MAX_STOP_STRINGS = 16  # every token is checked against each: a long list would stall the router's loop
MAX_STOP_CHARS = 1000
MAX_CACHE_SALT_CHARS = 1024


class RouterCore:
    def __init__(self, config: RouterConfig, builder: PromptBuilder, store: EmbeddingStore,
                 encoder: discovery.Targets, prefill: discovery.Targets, decode: discovery.Targets,
                 encoder_replicas: discovery.Balancer | None = None, decode_batch_size: int = 32) -> None:
        self.config = config
        self.decode_batch_size = decode_batch_size  # decode.max_batch_size: the derived queue bound's unit
        self.builder = builder
        self.store = store
        self.max_model_len = config.max_model_len or builder.info.max_position_embeddings
        self.encoder, self.prefill, self.decode = encoder, prefill, decode
        self.encoder_replicas = encoder_replicas  # behind the Encoder services: watched for health only
        self._flights: SingleFlight[epd_pb2.EncodedImage] = SingleFlight()
        self._counts = {"store_hits": 0, "store_misses": 0, "encoded": 0, "prefix_tokens": 0, "resumes": 0,
                        "retried_prefills": 0, "inline_images": 0, "refused": 0,
                        "preempted": 0, "routed_cached_tokens": 0, "prompt_logprob_tokens": 0}
        # least-load is the balancer's own order (no route): what every other role's calls use
        self._policy = None if config.prefill_routing == "least-load" else routing.make_policy(config.prefill_routing)
        self._cancelled: dict[str, int] = dict.fromkeys(STAGES, 0)  # requests whose client left, by stage
        self._releases: set[asyncio.Task] = set()  # handed-off requests being dropped (their clients left)
        self.active: set[asyncio.Task] = set()
        self.waiting = 0  # requests accepted and not yet streaming their first token
        self.refusing = False

    # ---------------------------------------------------------------- health

    def serving(self) -> bool:
        """Every role this router needs has a replica that takes work (encoder replicas too, behind
        the Encoder services)."""
        balancers = [t.balancer for t in (self.encoder, self.prefill, self.decode)]
        if self.encoder_replicas is not None:
            balancers.append(self.encoder_replicas)
        return not self.refusing and all(b.num_available() > 0 for b in balancers)

    def queue_limit(self) -> int:
        """Requests allowed to wait for their first token (0: no limit): ``max_queued_requests``,
        or when that is 0, twice the decode batch of every decode replica taking work."""
        limit = self.config.max_queued_requests
        if limit < 0:
            return 0
        if limit == 0:
            return 2 * self.decode_batch_size * max(1, self.decode.balancer.num_available())
        return limit

    # ---------------------------------------------------------------- the request path

    async def generate(self, request: epd_pb2.GenerateRequest, timeout_s: float | None,
                       on_accepted: Callable[[], None] | None = None) -> AsyncIterator[epd_pb2.GenerateResponse]:
        """The request's stream of chunks, then its summary. Refused at once (nothing is queued)
        while the router shuts down, or when ``max_queued_requests`` requests already wait for
        their first token. A client that leaves cancels the work wherever it is. ``on_accepted``
        is called once the request has passed every check (before encode and prefill): the HTTP
        front starts a stream's response then, not at the first token."""
        if self.refusing:
            raise errors.Unavailable("router: shutting down; send the request to another router")
        limit = self.queue_limit()
        if limit and self.waiting >= limit:
            self._count(refused=1)
            raise errors.ResourceExhausted(f"router: {self.waiting} requests are already waiting for their first "
                                           f"token (limit {limit}, router.max_queued_requests); retry in a few "
                                           "seconds or on another router")
        task = asyncio.current_task()
        self.active.add(task)
        self.waiting += 1
        run = RouterRequest(client_id=request.request_id)
        waiting = True
        try:
            async for event in self._generate(request, timeout_s, run, on_accepted):
                if waiting:  # the first chunk: streaming, no longer waiting
                    waiting = False
                    self.waiting -= 1
                yield event
        except (asyncio.CancelledError, GeneratorExit):  # the client left (GeneratorExit: while a chunk was written)
            self._cancelled[run.stage] += 1
            if run.unclaimed_decode:  # handed off, never streamed: free its decode slot now
                # (its own name: ``task`` is this request's, which ``finally`` takes out of active)
                release = asyncio.ensure_future(self._release_decode(run.attempt_id, run.unclaimed_decode))
                self._releases.add(release)
                release.add_done_callback(self._releases.discard)
            raise
        finally:
            run.to(RouteStatus.FINISHED)
            if waiting:
                self.waiting -= 1
            self.active.discard(task)

    async def _generate(self, request: epd_pb2.GenerateRequest, timeout_s: float | None, run: RouterRequest,
                        on_accepted: Callable[[], None] | None = None):
        start = time.perf_counter()
        run.sampling = sampling = self._resolve_sampling(request.sampling)
        if request.sampling.HasField("structured"):  # compiled off the loop (a large schema takes a while)
            compiled = await asyncio.get_running_loop().run_in_executor(None, self._compile_structured,
                                                                        request.sampling.structured)
            if compiled:
                if sampling.ignore_eos:
                    raise ValueError("ignore_eos cannot be combined with a structured output (the grammar ends "
                                     "the answer)")
                run.sampling = sampling = dataclasses.replace(sampling, grammar=compiled)
        if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt may be at most {MAX_CACHE_SALT_CHARS} characters, got {len(request.cache_salt)}")
        run.cache_salt = request.cache_salt
        max_pixels = request.max_pixels if request.HasField("max_pixels") else None
        loop = asyncio.get_running_loop()
        if request.prompt or request.prompt_token_ids:  # a completion: no template, no images
            if request.messages:
                raise ValueError("send messages (a chat) or prompt / prompt_token_ids (a completion), not both")
            if request.tools_json:
                raise ValueError("tools need messages (a chat): a completion has no chat template")
            run.prompt = prompt = await loop.run_in_executor(None, self.builder.build_completion, request.prompt,
                                                             request.prompt_token_ids)
        else:
            run.prompt = prompt = await loop.run_in_executor(None, self.builder.build, request.messages, max_pixels,
                                                             request.enable_thinking, True, request.tools_json)
        self._check_length(len(prompt.token_ids), sampling.max_tokens)
        if request.sampling.HasField("prompt_logprobs"):
            limits.check_prompt_logprobs(request.sampling.prompt_logprobs, len(prompt.token_ids))
            run.prompt_logprobs = request.sampling.prompt_logprobs
        run.deadline = time.time() + min(self.config.request_timeout_s, timeout_s or float("inf"))
        if on_accepted is not None:
            on_accepted()

        run.to(RouteStatus.ENCODING)
        inline = await self._ensure_embeddings(run, force=False)
        run.to(RouteStatus.PREFILLING)
        reply = await self._prefill(run, self._prefill_job(run, inline))
        run.timings.MergeFrom(_stage_timings(reply))
        run.unclaimed_decode = reply.decode_addr
        ttft = time.perf_counter() - start
        run.to(RouteStatus.STREAMING, f"first token from prefill, handed off to {reply.decode_addr or 'nobody'}")

        text = TextStream(self.builder.tokenizer, list(request.sampling.stop), min_tokens=sampling.min_tokens)
        first = _chunk([reply.first_token], text.add([reply.first_token], ends=_stop_token(reply)),
                       [reply.first_logprobs] if sampling.logprobs else [])
        first.chunk.prompt_tokens = len(prompt.token_ids)
        first.chunk.prompt_logprobs.extend(reply.prompt_logprobs)
        self._count(prompt_logprob_tokens=len(reply.prompt_logprobs))
        if request.return_prompt_token_ids:
            first.chunk.prompt_token_ids.extend(prompt.token_ids)
        yield first
        finish = reply.finish_reason if reply.finished else ""
        if text.stopped and not finish:
            finish = FinishReason.STOP.value
            await self._release_decode(run.attempt_id, reply.decode_addr)
        if not finish:
            async for event in self._relay(run, reply.decode_addr, text):
                if isinstance(event, str):
                    finish = event
                else:
                    yield event
        tail = text.flush()
        if tail:
            yield _chunk([], tail, [])
        self._count(encoded=len(run.encoded), prefix_tokens=reply.cached_tokens)
        stop_reason = {}
        if finish == FinishReason.STOP.value and text.stopped:
            stop_reason = {"stop_string": text.matched}
        elif finish == FinishReason.STOP.value and text.stop_token is not None:
            stop_reason = {"stop_token_id": text.stop_token}
        chunk_keys = {image.store_key for image in prompt.images if image.video is not None}
        yield epd_pb2.GenerateResponse(summary=epd_pb2.Summary(
            **stop_reason,
            request_id=request.request_id or logs.REQUEST_ID.get() or run.id,  # the id the logs name
            prompt_tokens=len(prompt.token_ids),
            image_tokens=prompt.num_image_tokens,
            completion_tokens=len(text.token_ids),
            finish_reason=finish,
            ttft_s=ttft,
            e2e_s=time.perf_counter() - start,
            images=prompt.num_pictures,
            images_encoded=len(run.encoded - chunk_keys),
            seed=sampling.seed,
            cached_tokens=reply.cached_tokens,
            # Every distinct image this request did not encode came from a cache: Redis, the
            # prefill worker's LRU, the prefix cache, or another request's encode it waited on.
            images_cached=len({image.store_key for image in prompt.images} - chunk_keys - run.encoded),
            timings=run.timings,
            resumes=run.resumes,
            videos=len(prompt.videos),
            video_tokens=prompt.num_video_tokens,
            video_chunks=len(chunk_keys),
            video_chunks_encoded=len(run.encoded & chunk_keys),
        ))

    # ---------------------------------------------------------------- steps

    def _resolve_sampling(self, params: epd_pb2.SamplingParams) -> SamplingConfig:
        if len(params.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
        if any(len(stop) > MAX_STOP_CHARS for stop in params.stop):
            raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters")
        max_tokens = params.max_tokens if params.HasField("max_tokens") else self.config.default_max_tokens
        if max_tokens > self.config.max_tokens_limit:
            raise ValueError(f"max_tokens must be at most {self.config.max_tokens_limit}, got {max_tokens}")
        temperature = params.temperature if params.HasField("temperature") else 0.0
        limits.check_temperature(temperature)  # the bound every front and epd generate share
        seed = params.seed if params.HasField("seed") else (secrets.randbits(63) if temperature > 0 else 0)
        if len(params.logit_bias) > MAX_TOKEN_LIST or len(params.stop_token_ids) > MAX_TOKEN_LIST:
            # before the lists are copied and sorted
            raise ValueError(f"stop_token_ids and logit_bias may list at most {MAX_TOKEN_LIST} tokens each")
        config = SamplingConfig(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=params.top_p if params.HasField("top_p") else 1.0,
            top_k=params.top_k if params.HasField("top_k") else 0,
            seed=seed,
            ignore_eos=params.ignore_eos,
            logprobs=params.logprobs,
            stop_token_ids=tuple(dict.fromkeys(params.stop_token_ids)),
            min_tokens=params.min_tokens,
            logit_bias=tuple(sorted(params.logit_bias.items())),
            min_p=params.min_p if params.HasField("min_p") else 0.0,
            presence_penalty=params.presence_penalty if params.HasField("presence_penalty") else 0.0,
            frequency_penalty=params.frequency_penalty if params.HasField("frequency_penalty") else 0.0,
            repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
        )
        if self.builder.info.vocab_size:
            check_vocab(config, self.builder.info.vocab_size)
        return config

    def _compile_structured(self, spec: epd_pb2.StructuredOutput) -> str:
        """The request's structured output as one llguidance grammar (ValueError naming what is
        wrong with it); checked against the checkpoint's tokenizer."""
        return grammar.compile_structured(spec, grammar.tokenizer_for(self.builder.info))

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
        capacity = self.decode.balancer.capacity_tokens()
        need = prompt_len + max_tokens - 1  # the last token sampled is never fed back
        if capacity and need > capacity:
            room = capacity - prompt_len + 1
            hint = f"lower max_tokens to at most {room}" if room >= 1 else "shorten the prompt"
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) needs K/V memory for {need} tokens; a "
                f"decode worker's K/V pool holds {capacity} (decode.kv_cache_bytes); {hint}"
            )

    async def _ensure_embeddings(self, run: RouterRequest, force: bool) -> dict[str, bytes]:
        """Make sure prefill can get every image of the prompt: in the store, or (when the store
        is out of reach, or ``force``) encoded again with the embedding returned inline. Returns
        the inline embeddings by store key. Keys another request is already encoding are waited
        on, not sent again (single flight)."""
        keys = list(dict.fromkeys(image.store_key for image in run.prompt.images))
        if not keys:
            return {}
        want_inline = force
        if force:
            missing = keys
        else:
            try:
                present = await asyncio.get_running_loop().run_in_executor(None, self.store.exists_many, keys)
                missing = [key for key, ok in zip(keys, present) if not ok]
                self._count(store_hits=len(keys) - len(missing), store_misses=len(missing))
            except StoreUnavailable:
                missing, want_inline = keys, True  # the store is down: every image travels inline
        if not missing:
            return {}
        results = await self._encode(run, missing, want_inline)
        inline = {key: result.embedding for key, result in results.items() if result.embedding}
        self._count(inline_images=len(inline))
        return inline

    async def _encode(self, run: RouterRequest, keys: list[str], inline: bool) -> dict[str, epd_pb2.EncodedImage]:
        first = {}
        for index, image in enumerate(run.prompt.images):
            first.setdefault(image.store_key, index)
        # A forced (inline) encode never joins an ordinary one: it needs the bytes back.
        led, joined = (keys, {}) if inline else self._flights.claim(keys)
        results: dict[str, epd_pb2.EncodedImage] = {}
        if led:
            results.update(await self._encode_led(run, first, led, inline, single_flight=not inline))
        for key, future in joined.items():
            try:
                results[key] = await asyncio.shield(future)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the leader's call failed (its deadline, its client left): try ourselves
                results.update(await self._encode_led(run, first, [key], inline, single_flight=False))
        for key in keys:
            self._check_encoded(run.prompt, first[key], results[key])
        return results

    async def _encode_led(self, run: RouterRequest, first: dict[str, int], led: list[str], inline: bool,
                          single_flight: bool) -> dict[str, epd_pb2.EncodedImage]:
        """One Encode call for the keys this request leads; every waiter gets the outcome, and every
        led key is resolved whatever happens (a waiter must never wait for ever)."""
        images = run.prompt.images
        items = [epd_pb2.EncodeItem(store_key=key, data=images[first[key]].data, max_pixels=images[first[key]].max_pixels,
                                    inline=inline, video=images[first[key]].video) for key in led]
        results: dict[str, epd_pb2.EncodedImage] = {}
        failure: BaseException | None = None
        try:
            reply, _ = await self.encoder.call("Encode", epd_pb2.EncodeRequest(items=items), run.remaining())
            results = {image.store_key: image for image in reply.images}
            missing = [key for key in led if key not in results]
            if missing:
                raise errors.ServiceError(f"encoder: the reply lacks {len(missing)} of {len(led)} images")
        except BaseException as error:
            failure = error
            raise
        finally:
            if single_flight:
                for key in led:
                    if key in results:
                        self._flights.resolve(key, result=results[key])
                    else:
                        self._flights.resolve(key, error=failure or errors.ServiceError("encoder: no result"))
        for key in led:
            run.encoded.add(key)
            run.timings.encode_s += results[key].encode_s
            run.timings.store_write_s += results[key].store_write_s
        return results

    @staticmethod
    def _check_encoded(prompt: Prompt, index: int, result: epd_pb2.EncodedImage) -> None:
        what = "video" if prompt.images[index].video is not None else f"image {index}"
        if result.error:
            raise ValueError(f"{what}: {result.error}")
        if result.num_tokens != prompt.images[index].info.num_tokens:
            raise errors.ServiceError(f"{what}: encoder made {result.num_tokens} tokens, the header "
                                      f"promised {prompt.images[index].info.num_tokens}")

    def _prefill_job(self, run: RouterRequest, inline: dict[str, bytes], generated: list[int] = ()) -> epd_pb2.PrefillRequest:
        images = request_images_proto(run.prompt)
        for image in images:
            image.embedding = inline.get(image.store_key, b"")
        job = epd_pb2.PrefillRequest(
            request_id=run.attempt_id,
            token_ids=[*run.prompt.token_ids, *generated],
            images=images,
            sampling=sampling_to_proto(run.sampling),
            deadline_unix=run.deadline,
            num_generated=len(generated),
            cache_salt=run.cache_salt,
        )
        if run.prompt_logprobs is not None and not generated:  # a resume already streamed them
            job.prompt_logprobs = run.prompt_logprobs
        return job

    def _route(self, job: epd_pb2.PrefillRequest) -> routing.PrefillRoute | None:
        """How this prefill job picks its replica (``router.prefill_routing``); None: least load,
        the balancer's own order. The prefix keys are prefill's own (``epd.prefix``)."""
        if self._policy is None:
            return None
        info = self.builder.info

        def hashes_for(block_size: int) -> list[bytes]:
            return prefix.request_block_hashes(job.token_ids, job.num_generated, job.images, info.image_token_id,
                                               info.video_token_id, block_size, info.fingerprint, job.cache_salt)[1]

        return routing.PrefillRoute(self._policy, len(job.token_ids), hashes_for)

    async def _call_prefill(self, run: RouterRequest, job: epd_pb2.PrefillRequest) -> epd_pb2.PrefillResponse:
        route = self._route(job)
        if route is not None and len(job.token_ids) > HASH_ON_LOOP_TOKENS:  # one sha256 a block: off the loop
            await asyncio.get_running_loop().run_in_executor(None, route.prepare, self.prefill.balancer.block_sizes())
        reply, address = await self.prefill.call("Prefill", self._attempts(run, job), run.remaining(), busy_next=True,
                                                 route=route)
        self.prefill.balancer.note_stored(address, reply.stored_prefix_keys)  # the next turn may follow at once
        if route is not None and route.chosen is not None:
            log.debug("request %s: prefill at %s (expected %d cached tokens, %d queued there; prefill had %d)",
                      run.attempt_id, address, route.chosen.cached_tokens, route.chosen.replica.queued_tokens,
                      reply.cached_tokens)
        self._count(routed_cached_tokens=route.chosen.cached_tokens if route is not None and route.chosen else 0)
        return reply

    async def _prefill(self, run: RouterRequest, job: epd_pb2.PrefillRequest) -> epd_pb2.PrefillResponse:
        try:
            return await self._call_prefill(run, job)
        except rpc.RpcFailure as failure:
            if failure.code is not grpc.StatusCode.FAILED_PRECONDITION:
                raise
        # An embedding went missing between our check and prefill's read (evicted, or the store
        # became unreachable): encode again with the embeddings inline, and retry once.
        self._count(retried_prefills=1)
        run.to(RouteStatus.ENCODING, "an embedding went missing before prefill read it")
        inline = await self._ensure_embeddings(run, force=True)
        generated = list(job.token_ids[len(run.prompt.token_ids):])
        run.to(RouteStatus.PREFILLING, "with the embeddings inline")
        return await self._call_prefill(run, self._prefill_job(run, inline, generated))

    @staticmethod
    def _attempts(run: RouterRequest, job: epd_pb2.PrefillRequest):
        """The Prefill request for each attempt: a retry (the prefill worker died under the call,
        perhaps after it had handed the state to decode) gets a fresh internal id, so decode never
        sees one id handed off twice; the stream then claims the last attempt's id."""
        attempts = 0

        def make() -> epd_pb2.PrefillRequest:
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                job.request_id = run.new_attempt("prefill retried on another replica")
            return job

        return make

    async def _relay(self, run: RouterRequest, decode_addr: str, text: TextStream):
        """Relay decode's token batches as chunks; yields the finish reason (a str) last. When the
        decode worker dies, or preempts the request to free K/V memory, resume elsewhere (or on
        the same worker, once it has room) and go on exactly where the stream stopped."""
        while True:
            call = self.decode.stubs.get(decode_addr).Stream(epd_pb2.StreamRequest(request_id=run.attempt_id),
                                                             timeout=run.remaining(),
                                                             metadata=self.decode.metadata)
            try:
                preempted = False
                async for batch in call:
                    run.unclaimed_decode = ""  # the stream has claimed it: cancelling the call frees the slot
                    delta = text.add(batch.token_ids, ends=batch.finish_reason == FinishReason.STOP.value)
                    kept = text.consumed  # all of the batch, or up to the token that completed a stop string
                    yield _chunk(batch.token_ids[:kept], delta, batch.logprobs[:kept] if run.sampling.logprobs else [])
                    if text.stopped:
                        yield FinishReason.STOP.value
                        return
                    if batch.finish_reason == FinishReason.PREEMPTED.value:
                        preempted = True
                        break
                    if batch.finish_reason == FinishReason.ERROR.value:
                        raise errors.ServiceError("decode failed this request (see the decode log)")
                    if batch.finish_reason == FinishReason.DEADLINE.value:
                        raise errors.DeadlineExceeded("request passed its deadline in decode")
                    if batch.finish_reason:
                        yield batch.finish_reason
                        return
                if not preempted:
                    raise errors.ServiceError("decode stream ended without a finish reason")
                reply = await self._resume(run, text.token_ids, decode_addr, "preempted to free K/V memory",
                                           preempted=True)
            except grpc.aio.AioRpcError as error:
                if not (rpc.peer_failed(error) or error.code() is grpc.StatusCode.NOT_FOUND):
                    raise rpc.RpcFailure.from_rpc_error(error, "decode") from None
                reply = await self._resume(run, text.token_ids, decode_addr, error.code().name)
            finally:
                call.cancel()  # a stop string or a departed client frees the decode slot now
            # The resumed step sampled the next token in prefill; decode goes on from there.
            yield _chunk([reply.first_token], text.add([reply.first_token], ends=_stop_token(reply)),
                         [reply.first_logprobs] if run.sampling.logprobs else [])
            if reply.finished:
                yield reply.finish_reason
                return
            if text.stopped:
                await self._release_decode(run.attempt_id, reply.decode_addr)
                yield FinishReason.STOP.value
                return
            decode_addr = run.unclaimed_decode = reply.decode_addr

    async def _resume(self, run: RouterRequest, generated: list[int], lost_addr: str, why: str,
                      preempted: bool = False) -> epd_pb2.PrefillResponse:
        """The decode worker at ``lost_addr`` lost the request (it died, restarted without it, or
        preempted it): prefill the prompt plus the ``generated`` tokens (sampling the next one
        exactly as decode would have) and hand off to a decode worker again. A death counts
        against ``router.max_resumes``; a preemption only against the request's deadline."""
        if preempted:
            self._count(preempted=1)
            log.info("decode at %s preempted request %s after %d tokens; resuming by replay", lost_addr,
                     run.attempt_id, len(generated))
        else:
            if run.resumes - run.preemptions >= self.config.max_resumes:
                raise errors.Unavailable(f"decode: the request lost its decode worker {self.config.max_resumes + 1} times; "
                                         "giving up")
            self._count(resumes=1)
            log.warning("decode at %s lost request %s after %d tokens (%s); resuming on another worker", lost_addr,
                        run.attempt_id, len(generated), why)
        run.resume(preempted)  # a new attempt id: the old one may linger on a restarted worker
        run.to(RouteStatus.PREFILLING, f"prompt plus {len(generated)} answer tokens")
        reply = await self._prefill(run, self._prefill_job(run, {}, list(generated)))
        run.to(RouteStatus.STREAMING, f"resumed, handed off to {reply.decode_addr or 'nobody'}")
        return reply

    async def _release_decode(self, request_id: str, decode_addr: str) -> None:
        """Claim and drop a handed-off request the router no longer needs (a stop string in the
        first token, a client that left), freeing its decode slot now instead of when its lease
        runs out."""
        await discovery.drop_handoff(self.decode, decode_addr, request_id)

    # ---------------------------------------------------------------- metrics

    def _count(self, **deltas: int) -> None:
        for name, delta in deltas.items():
            self._counts[name] += delta

    def metrics(self) -> list[Family]:
        counts = dict(self._counts)
        families = [
            counter("epd_embedding_cache_lookups_total", "Router's store checks of request images", "tier", "result")
            .add(counts["store_hits"], "redis", "hit").add(counts["store_misses"], "redis", "miss"),
            counter("epd_images_encoded_total", "Images this router had encoded").add(counts["encoded"]),
            counter("epd_images_inline_total", "Embeddings carried inline because the store was out of reach")
            .add(counts["inline_images"]),
            counter("epd_encode_single_flight_joins_total", "Image encodes waited on instead of sent again")
            .add(self._flights.num_joined),
            counter("epd_prefix_cache_hit_tokens_total", "Prompt tokens prefill took from its prefix cache")
            .add(counts["prefix_tokens"]),
            counter("epd_prompt_logprob_tokens_total", "Prompt tokens whose logprobs prefill computed for this "
                    "router's requests (prompt_logprobs; once for the n choices of a request)")
            .add(counts["prompt_logprob_tokens"]),
            counter("epd_prefill_routed_cached_tokens_total", "Prompt tokens the router expected the chosen prefill "
                    "replica's prefix cache to hold (compare epd_prefix_cache_hit_tokens_total)")
            .add(counts["routed_cached_tokens"]),
            counter("epd_requests_resumed_total", "Times a request moved to another decode worker after its "
                    "worker died").add(counts["resumes"]),
            counter("epd_requests_preempted_total", "Times decode preempted a request to free K/V memory (it "
                    "resumed by replay)").add(counts["preempted"]),
            counter("epd_prefill_retries_total", "Prefills repeated after an embedding went missing")
            .add(counts["retried_prefills"]),
            gauge("epd_store_reachable", "1 while the embedding store answers").add(int(self.store.reachable)),
            gauge("epd_router_waiting_requests", "Requests accepted and not yet streaming their first token")
            .add(self.waiting),
            gauge("epd_router_queue_limit", "Requests allowed to wait for their first token (0: no limit)")
            .add(self.queue_limit()),
            gauge("epd_router_running_requests", "Requests this router carries").add(len(self.active)),
            counter("epd_requests_refused_total", "Requests refused by admission control (RESOURCE_EXHAUSTED)")
            .add(counts["refused"]),
            self._cancelled_family(),
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


    def _cancelled_family(self) -> Family:
        family = counter("epd_requests_cancelled_total", "Requests whose client left, by the stage they were in",
                         "stage")
        for stage, count in self._cancelled.items():
            family.add(count, stage)
        return family


def _stage_timings(reply: epd_pb2.PrefillResponse) -> epd_pb2.StageTimings:
    return epd_pb2.StageTimings(store_read_s=reply.store_read_s, prefill_s=reply.prefill_s,
                                handoff_s=reply.handoff_s, handoff_bytes=reply.handoff_bytes, queue_s=reply.queue_s)


def _stop_token(reply: epd_pb2.PrefillResponse) -> bool:
    """Prefill's token ended the request as one of its ``stop_token_ids`` (prefill and decode say
    "stop" for nothing else: stop strings are the router's)."""
    return reply.finished and reply.finish_reason == FinishReason.STOP.value


def _chunk(token_ids, text: str, logprobs) -> epd_pb2.GenerateResponse:
    return epd_pb2.GenerateResponse(chunk=epd_pb2.TokenChunk(token_ids=list(token_ids), text=text, logprobs=list(logprobs)))
