"""Decode: one loop thread that steps every running request together and publishes the tokens.

``DecodeEngine`` owns the runner, the ``DecodeBatch`` (tensors: the paged K/V pool and the
linear-state slots, both allocated once at start) and the loop; ``DecodeScheduler`` (bookkeeping,
with the ``BlockPool``) decides who is admitted, who is preempted, who sits in which slot and who
is done, and returns that as one ``StepPlan`` per step, which ``_apply`` carries out. Continuous
batching: between two steps, finished requests leave the batch and handed-off ones join it while
their K/V blocks fit; each step then runs one batched forward for every request in it
(``TextModelRunner.decode_step``), samples each row with the request's own settings and publishes
the tokens. A handoff is decoded as soon as it arrives, so tokens are ready when the router claims
the stream.

Every change of a request's status happens under the engine's lock, admission included (the
state is copied into its slot while the lock is held), so a cancel can never be overwritten by
an admission running beside it. Only the forward itself runs outside the lock. Blocks are only
ever freed and handed out by the loop thread, between steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from decode_svc.batch import DecodeBatch
from decode_svc.blocks import BlockPool
from decode_svc.scheduler import DecodeRequest, DecodeScheduler, RequestStatus, StepPlan, TokenEvent
from epd import discovery, forward_trace, kernels
from epd.config import DecodeConfig
from epd.core_share import forward_turn
from epd.grammar import GrammarState
from epd.lm import HybridState, TextModelRunner
from epd.metrics import Family, counter, gauge
from epd.mixed import ChunkSource, PlannedChunks
from epd.request import FinishReason
from epd.sampling import SamplingConfig, TokenHistory, sample, stops_on

log = logging.getLogger(__name__)

JOIN_WAIT_S = 0.05
"""With a chunk source: after a step that ended prompts, how long the loop waits for them to join
its queue before it plans the next step. Each is submitted from another thread (the prefill
servicer's local handoff) a few milliseconds after its last chunk ran; without the wait the next
step, often a whole prefill forward, would start without it, and its second token would wait for
the step after. A prompt that leaves another way (a finish at its first token, a handoff to
another replica) costs the loop this much once."""


class DecodeEngine:
    def __init__(self, runner: TextModelRunner, eos_token_ids: frozenset[int], config: DecodeConfig,
                 grammar_tokenizer: Callable[[], object] | None = None, make_batch: Callable | None = None,
                 chunk_source: ChunkSource | None = None) -> None:
        """``grammar_tokenizer``: the checkpoint's llguidance tokenizer (``epd.grammar.tokenizer_for``),
        asked for on the first structured-output request; without one those are refused.
        ``make_batch(runner, max_slots, pool)``: the batch's tensors (default ``DecodeBatch``; a
        tensor-parallel replica passes ``decode_svc.tensor_parallel.TPBatch``'s maker).
        ``chunk_source``: prefill work on the same device that rides the steps (``epd.mixed``):
        each step then runs every decode row and that source's chunks in one forward."""
        self.runner = runner
        self._grammar_tokenizer = grammar_tokenizer
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.pool = BlockPool(kv_pool_blocks(runner, config), config.kv_block_tokens)
        kv_bytes = self.pool.capacity_tokens * runner.kv_bytes_per_token()
        self.scheduler = DecodeScheduler(
            config.max_batch_size, self.pool,
            max_waiting_tokens=config.max_waiting_tokens or max(1, self.pool.capacity_tokens // 2),
            max_waiting_requests=config.max_waiting_requests or config.max_batch_size,
            swap_bytes=0 if config.preemption == "replay" else (config.swap_space_bytes or kv_bytes // 2),
            state_bytes=lambda tokens: tokens * runner.kv_bytes_per_token() + runner.slot_state_bytes())
        # owned by the loop thread, changed under the lock
        self._batch = (make_batch or DecodeBatch)(runner, config.max_batch_size, self.pool)
        log.info("decode K/V pool: %d blocks of %d tokens = %d tokens, %.1f MiB (%.1f KiB a token); "
                 "linear-attention state: %d slots, %.1f MiB", self.pool.num_blocks, self.pool.block_size,
                 self.pool.capacity_tokens, self._batch.kv_bytes() / 2**20, runner.kv_bytes_per_token() / 1024,
                 config.max_batch_size, self._batch.slot_bytes() / 2**20)
        self.steps = 0
        self.batch_sizes_total = 0  # sum of batch sizes over steps: mean batch = this / steps
        self.largest_batch = 0
        self.mixed_steps = 0  # steps whose forward carried decode rows and prefill chunks (a chunk source's)
        self.prefill_rows_total = 0  # prefill tokens this loop's forwards carried (with or without decode rows)
        self.finished: Counter[str] = Counter()  # requests by finish reason
        self._submitted = 0  # handoffs submitted so far (a step that ended prompts waits for theirs)
        self._lock = threading.Condition()
        self._stopped = False
        self._source = chunk_source
        if chunk_source is not None:
            chunk_source.attach(self._wake)
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ called by the server's threads

    def check_handoff(self, request_id: str, prompt_len: int, max_tokens: int, num_generated: int) -> None:
        """Before a handoff's bytes arrive (``Reserve``, or the handoff's header): ValueError if it
        could never fit this worker's K/V pool, ``errors.ResourceExhausted`` if the waiting queue
        is full (``DecodeScheduler.check_handoff``); otherwise its place is held until ``submit``,
        ``release`` or ``decode.reserve_hold_s``."""
        with self._lock:
            self.scheduler.check_handoff(request_id, prompt_len, max_tokens, num_generated, time.monotonic(),
                                         self.config.reserve_hold_s)

    def release(self, request_id: str) -> None:
        with self._lock:
            self.scheduler.release(request_id)

    def capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    def load(self) -> discovery.Load:
        """What this worker reports with its heartbeat (prefill picks decode workers by it)."""
        with self._lock:
            return discovery.Load(free_kv_tokens=self.scheduler.free_tokens(),
                                  num_waiting=self.scheduler.num_waiting() + self.scheduler.num_reserved())

    def kv_usage(self) -> dict[str, float]:
        """The K/V pool now: blocks used and in all, the fraction used, tokens it holds in all."""
        with self._lock:
            return {"blocks_used": self.pool.num_used, "blocks": self.pool.num_blocks, "usage": self.pool.usage(),
                    "capacity_tokens": self.pool.capacity_tokens, "preemptions": self.scheduler.preemptions,
                    "swapped_bytes": self.scheduler.swap_used}

    def submit(self, request_id: str, prompt_len: int, rope_delta: int, first_token: int,
               sampling: SamplingConfig, state: HybridState, deadline_unix: float, num_generated: int = 1,
               history: TokenHistory | None = None, log_id: str = "",
               grammar: GrammarState | None = None) -> None:
        """A handed-off request; ``num_generated`` counts the tokens it already produced (the
        last of them is ``first_token``): more than one when a request resumes elsewhere.
        ``history``: what its penalties read (needed when ``sampling`` has one); ``grammar``: its
        structured output's state after those tokens (``grammar_state``; needed with a grammar)."""
        if sampling.needs_history and (history is None or len(history.generated) != num_generated):
            raise ValueError(f"request {request_id} has a penalty: it needs its {num_generated} generated tokens")
        if bool(sampling.grammar) != (grammar is not None) or (grammar is not None
                                                               and grammar.consumed != num_generated):
            raise ValueError(f"request {request_id}: its grammar state must have consumed its {num_generated} "
                             "generated tokens")
        now = time.monotonic()
        request = DecodeRequest(
            request_id=request_id,
            prompt_len=prompt_len,
            rope_delta=rope_delta,
            sampling=sampling,
            state=state,
            last_token=first_token,
            lease_deadline=now + self.config.handoff_lease_s,
            deadline=now + max(0.0, deadline_unix - time.time()) if deadline_unix else float("inf"),
            num_generated=num_generated,
            resumed=num_generated > 1,
            history=history,
            log_id=log_id,
            grammar=grammar,
        )
        with self._lock:
            self.scheduler.add(request)
            self._submitted += 1
            self._lock.notify()

    def grammar_state(self, grammar: str, generated) -> GrammarState:
        """A structured output's matcher fed the answer so far (ValueError when the grammar does
        not compile or the tokens do not match it)."""
        if self._grammar_tokenizer is None:
            raise ValueError("this decode worker has no tokenizer for structured outputs")
        return GrammarState(self._grammar_tokenizer(), grammar, generated)

    def claim(self, request_id: str, sink: Callable[[TokenEvent], None]) -> DecodeRequest | None:
        """Send the request's events to ``sink`` (called from the loop thread: it must not block)."""
        with self._lock:
            return self.scheduler.claim(request_id, sink)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.scheduler.finish(request, FinishReason.CANCELLED)

    def num_unfinished(self) -> int:
        with self._lock:
            return self.scheduler.num_unfinished()

    def num_held(self) -> int:
        """Requests decode still holds, finished ones whose stream has not come yet included."""
        with self._lock:
            return len(self.scheduler.requests)

    def metrics(self) -> list[Family]:
        with self._lock:
            running = len(self.scheduler.slots)
            waiting = self.scheduler.waiting_by_reason()
            finished = dict(self.scheduler.finished)
            refused = dict(self.scheduler.refused)
            used, total = self.pool.num_used, self.pool.num_blocks
            preempted, swap_used = dict(self.scheduler.preempted), self.scheduler.swap_used
        family = counter("epd_decode_requests_finished_total", "Requests decode finished, by reason", "reason")
        for reason, count in sorted(finished.items()):
            family.add(count, reason)
        waiting_family = gauge("epd_decode_waiting_requests", "Handed-off requests waiting for the batch, by what "
                               "holds them (a free slot, or K/V memory)", "reason")
        for reason, count in sorted(waiting.items()):
            waiting_family.add(count, reason)
        refused_family = counter("epd_decode_handoffs_refused_total", "Handoffs refused before their bytes were read, "
                                 "by reason (queue_full: RESOURCE_EXHAUSTED; never_fits: INVALID_ARGUMENT)", "reason")
        for reason in ("queue_full", "never_fits"):
            refused_family.add(refused.get(reason, 0), reason)
        return [
            gauge("epd_decode_running_requests", "Requests in the decode batch").add(running),
            waiting_family,
            refused_family,
            gauge("epd_decode_kv_blocks_used", "K/V blocks requests hold").add(used),
            gauge("epd_decode_kv_blocks_free", "K/V blocks free").add(total - used),
            gauge("epd_decode_kv_cache_usage_ratio", "Fraction of the K/V pool in use (vllm:kv_cache_usage_perc)")
            .add(used / total),
            gauge("epd_decode_kv_capacity_tokens", "Tokens the K/V pool holds in all").add(self.pool.capacity_tokens),
            counter("epd_decode_preemptions_total", "Requests preempted to free K/V blocks (vllm:num_preemptions), "
                    "by how: swap (state to host memory and back) or replay (the router resumes it)", "mode")
            .add(preempted.get("swap", 0), "swap").add(preempted.get("replay", 0), "replay"),
            gauge("epd_decode_swapped_bytes", "Host memory the swapped-out requests' states take").add(swap_used),
            gauge("epd_decode_swap_space_bytes", "Host memory swapped-out states may take (0: replay only)")
            .add(self.scheduler.swap_bytes),
            counter("epd_decode_steps_total", "Batched decode steps").add(self.steps),
            counter("epd_decode_mixed_steps_total", "Decode steps whose forward also carried prefill chunks "
                    "(prefill and decode in one engine)").add(self.mixed_steps),
            counter("epd_decode_riding_prefill_tokens_total", "Prefill tokens this engine's forwards carried "
                    "(prefill and decode in one engine)").add(self.prefill_rows_total),
            counter("epd_decode_batch_rows_total", "Rows over all decode steps (mean batch = this / steps)")
            .add(self.batch_sizes_total),
            gauge("epd_decode_largest_batch", "The largest batch a step has run").add(self.largest_batch),
            family,
        ]

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------ the loop thread

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify()

    def _loop(self) -> None:
        joining = None  # (handoffs submitted before the last step, prompts that step ended)
        while True:
            with self._lock:
                if joining is not None:  # the prompts the last step ended decode in this one
                    before, ended = joining
                    self._lock.wait_for(lambda: self._stopped or self._submitted - before >= ended, JOIN_WAIT_S)
                    joining = None
                while not self._stopped:
                    ready = self._prepare_step()  # always: it admits and retires between steps
                    if ready or (self._source is not None and self._source.has_chunks()):
                        break
                    self._lock.wait(timeout=min(0.5, self.scheduler.next_wake(time.monotonic()) + 0.01))
                if self._stopped:
                    return
                members = self.scheduler.running
            planned = self._source.take_chunks(len(members)) if self._source is not None else None
            if not members and planned is None:
                continue
            submitted = self._submitted
            try:
                logits, rows = self._forward(members, planned)
            except Exception as error:  # noqa: BLE001 - a failed step ends its requests, never the loop
                log.exception("decode step failed for a batch of %d", len(members))
                if planned is not None:
                    self._source.chunks_ran(planned, None, error)
                with self._lock:
                    for request in members:
                        self.scheduler.finish(request, FinishReason.ERROR)
                continue
            if planned is not None and planned.sample_chunks:
                joining = (submitted, len(planned.sample_chunks))
            if members:
                with self._lock:
                    self._publish(members, logits, rows)

    def _prepare_step(self) -> bool:
        """Under the lock: plan the step and carry the plan out. True when there is a batch to step."""
        self._apply(self.scheduler.schedule(time.monotonic()))
        return bool(self.scheduler.slots)

    def _apply(self, plan: StepPlan) -> None:
        """The one place a scheduling decision reaches the tensors: slot moves, the slots dropped,
        the admitted states copied into their slots and blocks."""
        for swap in plan.swapped:  # before any move or admission can overwrite its slot or blocks
            swap.request.state = self._batch.state_of(swap.slot, swap.blocks, swap.length)
        swapped = {id(swap.request) for swap in plan.swapped}
        for request in plan.preempted:
            log.info("decode preempted %s after %d tokens to free K/V blocks (%d of %d free now); %s",
                     request.log_name, request.num_generated, self.pool.num_free, self.pool.num_blocks,
                     "swapped out" if id(request) in swapped else "it resumes by replay")
        for src, dst in plan.moves:
            self._batch.move(src, dst)
        self._batch.truncate(len(self.scheduler.slots) - len(plan.admitted))
        for request in plan.admitted:
            try:
                self._batch.add(request.state, request.blocks)
            except Exception as error:  # noqa: BLE001 - a malformed state fails its own request only
                log.warning("decode refused the state of %s: %s", request.log_name, error)
                self.scheduler.reject(request)
                continue
            request.state = None  # the batch holds it now

    def _forward(self, members: list[DecodeRequest], planned: PlannedChunks | None = None
                 ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The step's forward: the decode rows' (logits, None), or, when every row takes the plain
        argmax and the runner screens its head (``TextModelRunner.greedy``), (None, (argmax,
        finite)); with ``planned`` (a chunk source's), its chunks ride the same forward and the
        source gets their results before the rows are published."""
        tokens = [r.last_token for r in members]
        positions_ = [r.position for r in members]
        # the screen pays only where no other row of the forward needs the whole head anyway
        screened = (getattr(self.runner, "greedy_screen", None) is not None and bool(members)
                    and all(r.sampling.plain_greedy for r in members)
                    and (planned is None or not planned.sample_chunks))
        logits = rows = None
        forward_trace.note(rows=len(members), prefill_tokens=planned.num_tokens if planned is not None else 0,
                           prompts=len(planned.chunks) if planned is not None else 0)
        with forward_turn():
            if planned is None:
                if screened:
                    rows = self.runner.decode_step_greedy(self._batch, tokens, positions_)
                else:
                    logits = self.runner.decode_step(self._batch, tokens, positions_)
            else:
                out = self.runner.mixed_step(planned.chunks, self._batch if members else None, tokens, positions_,
                                             planned.sample_chunks, planned.every_row, planned.splits,
                                             decode_head=not screened)
                if screened:
                    rows = self.runner.greedy(out.decode_hidden)
                else:
                    logits = out.decode_logits
        if planned is not None:
            self._source.chunks_ran(planned, out, None)
            self.mixed_steps += bool(members)
            self.prefill_rows_total += planned.num_tokens
        if members:
            self.steps += 1
            self.batch_sizes_total += len(members)
            self.largest_batch = max(self.largest_batch, len(members))
        return logits, rows

    def _publish(self, members: list[DecodeRequest], logits: torch.Tensor | None,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Under the lock: sample each row and hand the token to its request. A row whose logits
        are not finite (a numerical blow-up in that request alone) fails only that request.
        ``rows``: (argmax, finite) of a step whose rows all take the plain argmax, without logits."""
        # rows whose choice is the plain argmax (greedy, nothing changes the logits, no logprobs)
        # take the first-maximum index ``sample`` would pick, from one batched pass
        plain = [request.sampling.plain_greedy for request in members]
        # the index and the finite check in one read of the logits (kernels.greedy_rows where built)
        argmax, finite = (t.tolist() for t in (rows if rows is not None else kernels.first_maxima(logits)))
        for row, request in enumerate(members):
            if request.status is RequestStatus.FINISHED:  # cancelled during the step
                continue
            if not finite[row]:
                log.warning("decode: non-finite logits for %s at step %d; failing it", request.log_name,
                            request.num_generated)
                self.scheduler.finish(request, FinishReason.ERROR)
                continue
            try:
                if plain[row]:
                    token, logprobs = argmax[row], None
                else:
                    token, logprobs = sample(logits[row], request.sampling, step=request.num_generated,
                                             history=request.history, eos_token_ids=self.eos_token_ids,
                                             grammar=request.grammar)
            except Exception:  # noqa: BLE001 - a request's own sampling failure fails it alone, never the loop
                log.exception("decode: sampling failed for %s at step %d", request.log_name, request.num_generated)
                self.scheduler.finish(request, FinishReason.ERROR)
                continue
            if request.history is not None:
                request.history.append(token)
            reason = self.scheduler.after_token(request, token, self.eos_token_ids)
            if reason is not FinishReason.EOS and stops_on(request.sampling, token):
                reason = FinishReason.STOP  # one of its stop_token_ids: it ends the request as EOS does
            request.publish(TokenEvent(token_id=token, logprobs=logprobs, finish_reason=reason))
            if reason is not None:
                self.scheduler.finish(request, reason)


def available_memory(device: torch.device) -> int:
    """Bytes a new allocation could take now: the GPU's free memory on CUDA, host RAM otherwise."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def kv_pool_blocks(runner: TextModelRunner, config: DecodeConfig) -> int:
    """How many K/V blocks the pool has: ``kv_cache_bytes``, or a share of the memory available
    now (the weights are loaded), never more than ``max_batch_size`` requests at the model's whole
    window could use. Raises ValueError when the budget holds less than one block."""
    per_token = runner.kv_bytes_per_token()
    budget = config.kv_cache_bytes
    if not budget:
        fraction = config.kv_cache_memory_fraction or (0.8 if runner.device.type == "cuda" else 0.25)
        budget = int(available_memory(runner.device) * fraction)
    window = runner.model.config.max_position_embeddings
    tokens = min(budget // per_token, config.max_batch_size * window)
    blocks = tokens // config.kv_block_tokens
    if blocks < 1:
        raise ValueError(f"decode: a K/V budget of {budget} bytes holds no {config.kv_block_tokens}-token block "
                         f"({per_token} bytes a token); raise decode.kv_cache_bytes")
    return int(blocks)
