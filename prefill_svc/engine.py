"""Prefill: pull embeddings, splice them into the prompt, run it in chunks, sample, hand off.

``PrefillEngine`` owns the runner, the store client and the worker's two caches. A request
thread prepares its prompt (prefix-cache lookup, embeddings from the in-process LRU or Redis,
the spliced embeddings of every token still to compute, M-RoPE positions of the whole prompt)
and queues it; one scheduler thread runs the forwards, a chunk of at most ``chunk_tokens`` at a
time, letting the prompt with the fewest tokens left go next (``PrefillScheduler``), so a short
prompt is not stuck behind a long one. Chunk edges need no care around images: the whole
prompt's embeddings are spliced before the first chunk runs. At each snapshot point the state
is copied into the prefix cache; a point inside a chunk does not end it (the runner hands out the
state there, ``mixed_step``'s splits), except on a tensor-parallel replica. Positions are
computed here from the request alone (``epd.positions``), never read from a shared model object.

Prompt logprobs (vLLM's ``prompt_logprobs``, only for a request that asks): the prompt is computed
from its first token (the prefix cache is not looked up: a cached prefix has no logits, and vLLM
recomputes too), and for that prompt's chunks the runner returns every row's hidden state; the LM
head and a log-softmax run over them ``PROMPT_LOGPROB_ROWS`` rows at a time, so the float32
logits held at once stay small. Snapshots of such a prompt are stored as any prompt's (its state
is the same computation). Other prompts in the same forward pay for their last row only.

Where a prompt's state lives while it is computed is the ``PromptStates`` the engine is given:
here, whole (``LocalStates``), or a shard on every rank of a tensor-parallel replica
(``prefill_svc.tensor_parallel``); either way the prefix cache stores and the handoff carries
the whole state, which ``PromptStates.whole`` gives, on the scheduler thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Protocol

import torch

from epd import discovery, errors, forward_trace, limits, positions
from epd.config import PrefillConfig
from epd.core_share import forward_turn
from epd.grammar import GrammarState
from epd.grammar import tokenizer_for as grammar_tokenizer
from epd.lm import HybridState, StepOutput, TextModelRunner
from epd.metrics import Family, counter, gauge
from epd.mixed import PlannedChunks
from epd.modelinfo import ModelInfo
from epd.prefix import request_block_hashes, summary_key
from epd.request import FinishReason
from epd.sampling import (
    PromptLogprob,
    SamplingConfig,
    TokenHistory,
    TokenLogprobs,
    history_for,
    prompt_logprobs,
    sample,
    stops_on,
)
from epd.store import EmbeddingStore, StoreUnavailable, decode_value
from epd.v1 import epd_pb2
from prefill_svc.caches import ByteLRU, PrefixCache, snapshot_points
from prefill_svc.scheduler import PrefillScheduler, PromptProgress

MIB = 1 << 20
PROMPT_LOGPROB_ROWS = 64  # prompt rows per LM-head block: 64 x vocab float32 logits (~64 MB at 248k) at once
log = logging.getLogger(__name__)


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
    cached_tokens: int = 0
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # tokens 1.. of the prompt, when asked
    stored_keys: bytes = b""  # the summary keys of the prefix snapshots this prompt stored


@dataclass(eq=False)
class PrefillJob:
    """One prompt in the prefill: the tensors for tokens ``[cached_tokens, prompt_len)``."""

    progress: PromptProgress
    embeds: torch.Tensor  # [prompt_len - cached_tokens, hidden], images spliced in
    positions: torch.Tensor  # [3, prompt_len - cached_tokens]
    state: HybridState  # a private copy of the cached prefix's state, or empty
    block_hashes: list[bytes]
    rope_delta: int
    deadline_unix: float
    store_read_s: float = 0.0  # the embedding reads (inline, LRU, then Redis)
    logits: torch.Tensor | None = None
    cancelled: bool = False  # its caller went away: it stops at the next chunk edge
    queued_at: float = 0.0
    started_at: float | None = None
    finished_at: float = 0.0
    done: Future = field(default_factory=Future)  # set by the scheduler thread: None or the failure
    grammar: GrammarState | None = None  # a structured output's matcher, at the answer so far
    num_prompt_top: int | None = None  # prompt_logprobs asked: alternatives per prompt token
    token_ids: list[int] = field(default_factory=list)  # the prompt's, when prompt logprobs are asked
    prompt_entries: list[PromptLogprob] = field(default_factory=list)  # computed so far, in prompt order
    stored: list[bytes] = field(default_factory=list)  # summary keys of the snapshots it stored

    @property
    def cached_tokens(self) -> int:
        return self.progress.prompt_len - self.embeds.shape[0]


class PromptStates(Protocol):
    """Where the prompts' states live while they are computed. ``start`` may be called on any
    thread; ``whole`` only on the scheduler thread (it may run collectives); ``end`` on any."""

    # whether a forward hands out a prompt's state inside a chunk (``mixed_step``'s splits), so
    # chunks need not end at snapshot points
    snapshots_inside_chunks: bool = False

    def start(self, cached: HybridState | None) -> HybridState:
        """The state a new prompt computes on: a cached prefix's (a private copy) or an empty one."""

    def whole(self, state: HybridState, release: bool = False) -> HybridState:
        """The whole state (to store as a snapshot, or to hand off); ``release``: the prompt is
        done with ``state`` (only the returned whole one is used from here)."""

    def end(self, state: HybridState) -> None:
        """The prompt ended (done, failed or cancelled): what ``state`` holds elsewhere may go."""


class LocalStates:
    """Every prompt's state whole, in this process."""

    snapshots_inside_chunks = True

    def __init__(self, runner: TextModelRunner) -> None:
        self.runner = runner

    def start(self, cached: HybridState | None) -> HybridState:
        return cached if cached is not None else self.runner.new_state()

    def whole(self, state: HybridState, release: bool = False) -> HybridState:
        return state

    def end(self, state: HybridState) -> None:
        pass


class HeldBytes:
    """The prefill worker's budget for the prompts it holds (queued, running, or waiting to hand
    off), by the bytes each one's state and embeddings come to. ``take`` refuses with
    RESOURCE_EXHAUSTED past the budget; a prompt bigger than the whole budget is taken only when
    nothing else is held, so no prompt is refused here for ever (decode's pool bounds its size)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0
        self.refused = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> None:
        with self._lock:
            if self.held and self.held + size > self.budget:
                self.refused += 1
                raise errors.ResourceExhausted(
                    f"prefill: the prompts this worker holds take {self.held / MIB:.0f} MiB of its "
                    f"{self.budget / MIB:.0f} MiB (prefill.max_held_mb); retry shortly or on another prefill worker")
            self.held += size

    def give_back(self, size: int) -> None:
        with self._lock:
            self.held -= size


class PrefillEngine:
    def __init__(self, runner: TextModelRunner, info: ModelInfo, store: EmbeddingStore, config: PrefillConfig,
                 states: PromptStates | None = None, own_loop: bool = True) -> None:
        """``states``: where prompts' states live while computed (default: here, ``LocalStates``;
        a tensor-parallel replica passes its runner, which keeps a shard on every rank).
        ``own_loop``: run the forwards on a scheduler thread of its own; without it the engine is
        an ``epd.mixed.ChunkSource`` whose chunks ride another loop's steps (a decode engine on the
        same device: ``take_chunks``, ``chunks_ran``)."""
        self.runner = runner
        self.states = states or LocalStates(runner)
        self.info = info
        self.store = store
        self.config = config
        self.embeddings: ByteLRU[torch.Tensor] = ByteLRU(self.config.embedding_cache_mb * MIB)
        self.prefix = PrefixCache(self.config.prefix_cache_mb * MIB, self.config.prefix_block_size,
                                  self.config.snapshot_every_blocks)
        # riding another loop's steps, a forward's budget is the step's (decode rows included)
        self._budget = self.config.batch_tokens if own_loop else self.config.step_tokens
        # a chunk ends at a snapshot point only where the forward cannot hand out the state there
        self._scheduler = PrefillScheduler(self.config.chunk_tokens, self._budget, self.config.max_wait_s,
                                           cut_at_stops=not getattr(self.states, "snapshots_inside_chunks", False))
        self.held = HeldBytes(self.config.max_held_mb * MIB or _default_budget(runner))
        self._jobs: dict[PromptProgress, PrefillJob] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._store_hits = self._store_misses = 0
        self.num_cancelled = {"queued": 0, "running": 0, "handoff": 0}
        self.on_stored: Callable[[], None] | None = None  # called when a prefix snapshot is stored (the server reports it)
        self.busy_s = 0.0  # time in forwards (and the snapshots stored after them) since start
        self.computed_tokens = 0  # prompt tokens those forwards computed (cached prefixes excluded)
        self._wakers: list[Callable[[], None]] = []  # another loop's wake-up (a ChunkSource's attach)
        self._thread: threading.Thread | None = None
        if own_loop:
            self._thread = threading.Thread(target=self._loop, name="prefill-scheduler", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ callers (request threads or coroutines)

    def run(self, request: epd_pb2.PrefillRequest, sampling: SamplingConfig) -> PrefillResult:
        """Prefill one prompt and sample its next token, blocking until it is done."""
        job = self.submit(self.prepare(request))
        job.done.result()
        return self._result(job, request, sampling)

    async def run_async(self, request: epd_pb2.PrefillRequest, sampling: SamplingConfig) -> PrefillResult:
        """``run`` for a coroutine: preparing runs in the loop's executor, the forwards on the
        scheduler thread; if the caller is cancelled (its client went away), the prompt leaves
        the queue, or stops at its next chunk edge if it is running."""
        loop = asyncio.get_running_loop()
        job = self.submit(await loop.run_in_executor(None, self.prepare, request))
        try:
            await asyncio.wrap_future(job.done)
        except asyncio.CancelledError:
            self.cancel(job)
            raise
        return self._result(job, request, sampling)

    def prompt_bytes(self, num_tokens: int) -> int:
        """What one prompt of ``num_tokens`` tokens holds here at most: its state (K/V and the
        linear-attention state) and its spliced embeddings."""
        runner = self.runner
        return (num_tokens * (runner.kv_bytes_per_token() + self.info.hidden_size * runner.dtype.itemsize)
                + runner.slot_state_bytes())

    def submit(self, job: PrefillJob) -> PrefillJob:
        with self._wake:
            if self._stopping:
                raise errors.Unavailable("prefill is shutting down")
            job.queued_at = time.perf_counter()
            self._jobs[job.progress] = job
            self._scheduler.add(job.progress, time.monotonic())
            self._wake.notify()
        for wake in self._wakers:  # outside the lock: the other loop takes its own lock, then ours
            wake()
        return job

    def cancel(self, job: PrefillJob) -> None:
        """Drop a prompt: it leaves the queue now; if a chunk of it is running, nothing more of it
        runs after that chunk."""
        with self._wake:
            if job.progress not in self._jobs:
                return  # already done
            job.cancelled = True
            self.num_cancelled["running" if job.started_at is not None else "queued"] += 1
        self._finish(job, errors.Cancelled("prefill: the request was cancelled"))

    def _result(self, job: PrefillJob, request: epd_pb2.PrefillRequest, sampling: SamplingConfig) -> PrefillResult:
        """Sample the next token; for a resumed request it is token number ``num_generated``."""
        step = request.num_generated
        token, logprobs = sample(job.logits, sampling, step=step, history=request_history(request, sampling),
                                 eos_token_ids=self.info.eos_token_ids, grammar=job.grammar)
        return PrefillResult(
            first_token=token,
            logprobs=logprobs,
            state=job.state,
            rope_delta=job.rope_delta,
            finish_reason=self._finish_reason(token, sampling, num_generated=step),
            prefill_s=job.finished_at - job.started_at,
            store_read_s=job.store_read_s,
            queue_s=job.started_at - job.queued_at,
            cached_tokens=job.cached_tokens,
            prompt_logprobs=job.prompt_entries,
            stored_keys=b"".join(job.stored),
        )

    def prepare(self, request: epd_pb2.PrefillRequest) -> PrefillJob:
        """Validate; find the cached prefix; build the embeddings and positions of the rest."""
        token_ids = list(request.token_ids)
        if not token_ids:
            raise ValueError("prompt is empty")
        if not 0 <= request.num_generated < len(token_ids):
            raise ValueError(f"num_generated is {request.num_generated} for {len(token_ids)} tokens")
        # A structured output's matcher, fed the answer so far: a bad grammar or an answer that
        # does not match it is refused here, before any forward.
        grammar = GrammarState(grammar_tokenizer(self.info), request.sampling.grammar,
                               token_ids[len(token_ids) - request.num_generated:]) if request.sampling.grammar else None
        # Only the prompt holds images: answer tokens a resumed request replays are text whatever
        # their id (a model may well sample <|image_pad|>), as they were when decode fed them.
        pieces, hashes = request_block_hashes(token_ids, request.num_generated, request.images,
                                              self.info.image_token_id, self.info.video_token_id,
                                              self.prefix.block_size, self.info.fingerprint, request.cache_salt)
        spans = [piece.span for piece in pieces]
        num_top = request.prompt_logprobs if request.HasField("prompt_logprobs") else None
        if num_top is not None:
            if request.num_generated:
                raise ValueError("prompt_logprobs is for a new request: a resumed one has had them")
            limits.check_prompt_logprobs(num_top, len(token_ids))
        # A cached prefix has no logits: a prompt whose logprobs are asked is computed whole.
        use_cache = self.config.prefix_cache_mb and num_top is None
        cached, state = self.prefix.lookup(hashes, len(token_ids)) if use_cache else (0, None)
        needed = sorted({piece.ref for piece in pieces if piece.span.end > cached})
        read_start = time.perf_counter()
        image_embeds = self._fetch_embeddings(request.images, needed)
        read_s = time.perf_counter() - read_start
        embeds = self.runner.embed(torch.tensor(token_ids[cached:], dtype=torch.long)).clone()
        for piece in pieces:
            span = piece.span
            if span.end <= cached:
                continue
            start = max(span.start, cached)
            rows = image_embeds[piece.ref][piece.row + start - span.start : piece.row + span.num_tokens]
            embeds[start - cached : span.end - cached] = rows.to(embeds.device, embeds.dtype)
        pos, rope_delta = positions.mrope_positions(len(token_ids), spans)
        stops = snapshot_points(len(token_ids), self.prefix.block_size, self.prefix.every_blocks,
                                _last_index(token_ids, self.info.im_start_token_id))
        return PrefillJob(
            progress=PromptProgress(prompt_len=len(token_ids), cursor=cached, stops=stops),
            embeds=embeds,
            positions=pos[:, cached:],
            state=self.states.start(state),
            block_hashes=hashes,
            rope_delta=rope_delta,
            deadline_unix=request.deadline_unix,
            store_read_s=read_s,
            grammar=grammar,
            num_prompt_top=num_top,
            token_ids=token_ids if num_top is not None else [],
        )

    def _fetch_embeddings(self, images, needed: list[int]) -> dict[int, torch.Tensor]:
        """Embeddings of the images at ``needed``: sent inline, else the in-process LRU, else one
        Redis MGET. A value of the wrong shape counts as missing and is never cached."""
        expected = {images[i].store_key: (max(1, images[i].temporal_patches) * images[i].merged_height
                                          * images[i].merged_width, self.info.hidden_size) for i in needed}
        found: dict[str, torch.Tensor] = {}
        for index in needed:
            ref = images[index]
            if ref.store_key in found:
                continue
            tensor = self._inline(ref, expected[ref.store_key]) if ref.embedding else None
            if tensor is None:
                tensor = self.embeddings.get(ref.store_key)
            if tensor is not None and tuple(tensor.shape) == expected[ref.store_key]:
                found[ref.store_key] = tensor
        missing = [key for key in expected if key not in found]
        try:
            stored = self.store.get_many(missing)
        except StoreUnavailable as error:
            # The router encodes again with the embeddings inline: slower, still correct.
            raise errors.FailedPrecondition(f"embeddings of {len(missing)} image(s) are out of reach: {error}") from None
        for key, embedding in zip(missing, stored):
            if embedding is not None and tuple(embedding.tensor.shape) == expected[key]:
                found[key] = embedding.tensor
                self.embeddings.put(key, embedding.tensor, embedding.tensor.numel() * embedding.tensor.element_size())
        with self._wake:
            self._store_hits += sum(key in found for key in missing)
            self._store_misses += sum(key not in found for key in missing)
        out = {}
        for index in needed:
            ref = images[index]
            if ref.store_key not in found:
                # The router re-encodes on this status: an eviction between its check and this
                # read (or a value that failed its checks) costs a retry, never a failed request.
                raise errors.FailedPrecondition(f"embedding of image {index} is not in the store: {ref.store_key}")
            out[index] = found[ref.store_key]
        return out

    def _inline(self, ref: epd_pb2.ImageRef, shape: tuple[int, int]) -> torch.Tensor | None:
        """An embedding sent with the request; one that fails its checks or has the wrong shape is
        a miss (the LRU, then the store, then a re-encode), and is never cached."""
        try:
            tensor = decode_value(ref.store_key, ref.embedding).tensor
        except ValueError as error:
            log.warning("prefill: ignoring the inline embedding for %s: %s", ref.store_key[-16:], error)
            return None
        if tuple(tensor.shape) != shape:
            log.warning("prefill: ignoring the inline embedding for %s: shape %s, expected %s",
                        ref.store_key[-16:], list(tensor.shape), list(shape))
            return None
        self.embeddings.put(ref.store_key, tensor, tensor.numel() * tensor.element_size())
        return tensor

    def _finish_reason(self, token: int, sampling: SamplingConfig, num_generated: int = 0) -> FinishReason | None:
        """Why the request ends with ``token`` (the answer's token number ``num_generated``), if it does."""
        if token in self.info.eos_token_ids and not sampling.ignore_eos:
            return FinishReason.EOS
        if stops_on(sampling, token):
            return FinishReason.STOP
        if num_generated + 1 >= sampling.max_tokens:
            return FinishReason.LENGTH
        return None

    # ------------------------------------------------------------ the scheduler thread

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._scheduler and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
            planned = self.take_chunks(0)
            if planned is None:
                continue
            forward_trace.note(prefill_tokens=planned.num_tokens, prompts=len(planned.chunks))
            with forward_turn():
                try:
                    if planned.splits:  # snapshot points inside chunks (only where the states are local)
                        out = self.runner.mixed_step(planned.chunks, None, [], [], every_row=planned.every_row,
                                                     splits=planned.splits)
                    else:  # forward_rows: a tensor-parallel runner has its own
                        hidden, rows = self.runner.forward_rows(planned.chunks, planned.every_row)
                        out = StepOutput(hidden, rows, {}, hidden.new_empty(0))
                except Exception as error:  # noqa: BLE001 - a failed forward fails its prompts, never the loop
                    self.chunks_ran(planned, None, error)
                    continue
                self.chunks_ran(planned, out, None)

    # ------------------------------------------------------------ as a ChunkSource (epd.mixed)

    def attach(self, wake: Callable[[], None]) -> None:
        self._wakers.append(wake)

    def has_chunks(self) -> bool:
        with self._wake:
            return bool(self._scheduler) and not self._stopping

    def take_chunks(self, num_decode_rows: int) -> PlannedChunks | None:
        """The next forward's chunks (``prefill.step_tokens`` in all, less ``num_decode_rows``
        when decode rows share the forward), their prompts marked started; expired ones fail here."""
        with self._wake:
            if self._stopping or not self._scheduler:
                return None
            budget = self._budget - num_decode_rows if num_decode_rows else None
            batch = [(self._jobs[progress], end)
                     for progress, end in self._scheduler.next_batch(time.monotonic(), budget)]
            for job, _ in batch:
                if job.started_at is None:
                    job.started_at = time.perf_counter()  # from here a cancel waits for a chunk edge
        batch = self._drop_expired(batch)
        if not batch:
            return None
        chunks = []
        for job, end in batch:
            base = job.cached_tokens
            lo, hi = job.progress.cursor - base, end - base
            chunks.append((job.embeds[lo:hi], job.positions[:, lo:hi], job.state))
        every_row = frozenset(row for row, (job, _) in enumerate(batch) if job.num_prompt_top is not None)
        ending = frozenset(row for row, (job, end) in enumerate(batch) if end == job.progress.prompt_len)
        # snapshot points inside a chunk, as offsets into it (none where the scheduler cut at them)
        splits = {row: [stop - job.progress.cursor for stop in job.progress.stops if job.progress.cursor < stop < end]
                  for row, (job, end) in enumerate(batch)}
        return PlannedChunks(chunks, ending, every_row, ticket=(batch, time.perf_counter()),
                             splits={row: cuts for row, cuts in splits.items() if cuts})

    def chunks_ran(self, planned: PlannedChunks, out: StepOutput | None, error: BaseException | None) -> None:
        """After the forward over ``planned``: prompt logprobs, prefix snapshots, the first token's
        logits of each prompt that ended; then the prompts move on (or fail with ``error``)."""
        batch, start = planned.ticket
        if error is None:
            try:
                self._after_forward(batch, planned, out)
            except Exception as failure:  # noqa: BLE001 - fails its prompts, never the loop
                error = failure
        if error is not None:
            for job, _ in batch:
                self._finish(job, error)
            return
        self.computed_tokens += planned.num_tokens
        self.busy_s += time.perf_counter() - start
        done = []
        with self._wake:
            for job, end in batch:
                if not job.cancelled:  # a cancelled one already left the queue
                    self._scheduler.advance(job.progress, end)
                    if job.progress.done:
                        done.append(job)
        for job in done:
            self._finish(job, None)

    def _drop_expired(self, batch: list[tuple[PrefillJob, int]]) -> list[tuple[PrefillJob, int]]:
        keep = []
        for job, end in batch:
            if job.deadline_unix and time.time() > job.deadline_unix:
                self._finish(job, errors.DeadlineExceeded("prefill: request passed its deadline while queued"))
            else:
                keep.append((job, end))
        return keep

    def _after_forward(self, batch: list[tuple[PrefillJob, int]], planned: PlannedChunks, out: StepOutput) -> None:
        for row in planned.every_row:
            job, end = batch[row]
            self._prompt_logprobs(job, out.rows[row], job.progress.cursor, end)
        for row, (job, end) in enumerate(batch):
            if job.cancelled:  # it left (its state may be gone elsewhere): nothing more of it runs
                continue
            for inside in out.snapshots.get(row, ()):  # snapshot points the chunk ran through
                self._store_prefix(job, job.block_hashes[: inside.num_tokens // self.prefix.block_size], inside)
            last = end == job.progress.prompt_len
            hashes = job.block_hashes[: end // self.prefix.block_size]
            snapshot = bool(end in job.progress.stops and self.config.prefix_cache_mb
                            and self.prefix.wants(hashes[-1]))
            # the whole state at most once a chunk: a snapshot and the handoff share it
            whole = self.states.whole(job.state, release=last) if snapshot or last else None
            if snapshot:
                self._store_prefix(job, hashes, whole)
            if last:
                job.state = whole
                logits = out.chunk_logits.get(row)
                job.logits = logits if logits is not None else self.runner.logits(out.last_hidden[row])

    def _store_prefix(self, job: PrefillJob, hashes: list[bytes], state: HybridState) -> None:
        """Keep ``state`` (the prompt's first ``len(hashes)`` blocks) in the prefix cache, unless
        the cache is off or holds it already."""
        if not (self.config.prefix_cache_mb and self.prefix.wants(hashes[-1])):
            return
        if self.prefix.insert(hashes, state):
            job.stored.append(summary_key(hashes[-1]))
            if self.on_stored:
                self.on_stored()

    def work(self) -> dict[str, float]:
        """What this replica has computed since it started: seconds in forwards, prompt tokens."""
        return {"busy_s": self.busy_s, "computed_tokens": self.computed_tokens}

    def _prompt_logprobs(self, job: PrefillJob, hidden: torch.Tensor, start: int, end: int) -> None:
        """The logprobs of prompt tokens ``start + 1 .. end`` from the hidden states ``[end - start,
        hidden]`` of rows ``start .. end - 1`` (row p predicts token p + 1; the prompt's last row
        predicts the answer's first token, which ``job.logits`` samples)."""
        stop = min(end, job.progress.prompt_len - 1)  # rows with a prompt token after them
        targets = torch.tensor(job.token_ids[start + 1 : stop + 1], dtype=torch.long, device=hidden.device)
        for lo in range(0, stop - start, PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, stop - start)
            logits = self.runner.logits(hidden[lo:hi])
            job.prompt_entries.extend(prompt_logprobs(logits, targets[lo:hi], job.num_prompt_top))

    def _finish(self, job: PrefillJob, error: BaseException | None) -> None:
        with self._wake:
            self._scheduler.remove(job.progress)
            if self._jobs.pop(job.progress, None) is None:
                return  # already finished (cancelled while the scheduler was picking it)
        self.states.end(job.state)
        job.finished_at = time.perf_counter()
        if job.started_at is None:
            job.started_at = job.finished_at
        if job.done.done():  # its caller went away: asyncio cancelled the future it awaited
            return
        try:
            if error is None:
                job.done.set_result(None)
            else:
                job.done.set_exception(error)
        except InvalidStateError:
            pass  # cancelled by the caller's loop at this very moment: nobody reads it

    def stop(self) -> None:
        """Stop the scheduler thread; prompts still waiting fail with UNAVAILABLE (their callers
        retry on another prefill replica) instead of waiting for ever."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
            waiting = list(self._jobs.values())
        if self._thread is not None:
            self._thread.join(timeout=10)
        for job in waiting:
            self._finish(job, errors.Unavailable("prefill is shutting down"))

    def queued_tokens(self) -> int:
        """Prefill work queued here: prompt tokens not yet computed (cached prefixes excluded)."""
        with self._wake:
            return self._scheduler.remaining_tokens()

    def load(self) -> discovery.Load:
        """What this replica reports with its heartbeat: queued work and the prefixes it holds."""
        return discovery.Load(queued_tokens=self.queued_tokens(), prefix_summary=self.prefix.summary(),
                              prefix_block_size=self.prefix.block_size if self.config.prefix_cache_mb else 0)

    def num_waiting(self) -> int:
        """Prompts queued or part-way through their prefill."""
        with self._wake:
            return len(self._scheduler)

    # ------------------------------------------------------------ metrics

    def metrics(self) -> list[Family]:
        emb, pre = self.embeddings.stats(), self.prefix.stats()
        looked_up, hit = self.prefix.token_counts()
        with self._wake:
            waiting, store_hits, store_misses = len(self._scheduler), self._store_hits, self._store_misses
        return [
            counter("epd_embedding_cache_lookups_total", "Embedding lookups by tier and outcome", "tier", "result")
            .add(emb.hits, "process", "hit").add(emb.misses, "process", "miss")
            .add(store_hits, "redis", "hit").add(store_misses, "redis", "miss"),
            gauge("epd_embedding_cache_bytes", "Bytes held by the in-process embedding LRU").add(emb.num_bytes),
            gauge("epd_embedding_cache_capacity_bytes", "Byte cap of the in-process embedding LRU").add(emb.capacity_bytes),
            gauge("epd_embedding_cache_entries", "Embeddings held by the in-process LRU").add(emb.num_entries),
            counter("epd_embedding_cache_evictions_total", "Embeddings evicted from the in-process LRU").add(emb.evictions),
            counter("epd_prefix_cache_lookups_total", "Prefix-cache lookups by outcome", "result")
            .add(pre.hits, "hit").add(pre.misses, "miss"),
            counter("epd_prefix_cache_tokens_total", "Prompt tokens looked up, and those served from the cache", "kind")
            .add(looked_up, "looked_up").add(hit, "hit"),
            gauge("epd_prefix_cache_bytes", "Bytes held by prefix snapshots").add(pre.num_bytes),
            gauge("epd_prefix_cache_capacity_bytes", "Byte cap of the prefix cache").add(pre.capacity_bytes),
            gauge("epd_prefix_cache_entries", "Prefix snapshots held").add(pre.num_entries),
            counter("epd_prefix_cache_evictions_total", "Prefix snapshots evicted").add(pre.evictions),
            gauge("epd_prefix_cache_blocks", "K/V blocks the prefix snapshots hold (each shared by every snapshot "
                  "that covers it)").add(self.prefix.num_blocks()),
            gauge("epd_prefill_waiting_prompts", "Prompts queued or part-way through their prefill").add(waiting),
            gauge("epd_prefill_held_bytes", "Bytes the prompts this worker holds take (state and embeddings)")
            .add(self.held.held),
            gauge("epd_prefill_held_capacity_bytes", "The budget for them (prefill.max_held_mb)").add(self.held.budget),
            counter("epd_prefill_refused_total", "Prompts refused with RESOURCE_EXHAUSTED: the budget was full")
            .add(self.held.refused),
            counter("epd_prefill_busy_seconds_total", "Seconds in prefill forwards (and the prefix snapshots "
                    "stored after them)").add(self.busy_s),
            counter("epd_prefill_computed_tokens_total", "Prompt tokens computed (cached prefixes excluded)")
            .add(self.computed_tokens),
            counter("epd_prefill_cancelled_total", "Prompts dropped because their caller left, by where they were",
                    "where").add(self.num_cancelled["queued"], "queued").add(self.num_cancelled["running"], "running")
            .add(self.num_cancelled["handoff"], "handoff"),
        ]


def request_history(request: epd_pb2.PrefillRequest, sampling: SamplingConfig) -> TokenHistory | None:
    """What the penalties read for the token prefill samples: the prompt, and the answer so far
    (the last ``num_generated`` token ids of a resumed request)."""
    prompt_len = len(request.token_ids) - request.num_generated
    return history_for(sampling, request.token_ids[:prompt_len], request.token_ids[prompt_len:])


def _default_budget(runner: TextModelRunner) -> int:
    """A quarter of the memory available once the weights are loaded (the GPU's, or host RAM)."""
    if runner.device.type == "cuda":
        return int(torch.cuda.mem_get_info(runner.device)[0]) // 4
    import psutil

    return int(psutil.virtual_memory().available) // 4


def _last_index(token_ids: list[int], token: int | None) -> int | None:
    if token is None or token not in token_ids:
        return None
    return len(token_ids) - 1 - token_ids[::-1].index(token)
