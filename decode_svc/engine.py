"""Decode: one loop that steps every running request together and hands tokens to their streams.

``DecodeScheduler`` is bookkeeping only (who is running, whose lease ran out, who finished) and
is testable without a model. ``DecodeEngine`` owns the runner, a ``DecodeBatch`` and the loop
thread. Continuous batching: between two steps, finished requests leave the batch and handed-off
ones join it (up to ``max_batch_size``; the rest wait their turn, oldest first); each step then
runs one batched forward for every request in it (``TextModelRunner.decode_step``), samples each
row with the request's own settings and publishes the tokens. The handoff is decoded as soon as
it arrives, so tokens are ready when the router claims the stream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from epd import positions
from epd.lm import HybridState, TextModelRunner
from epd.request import FinishReason, RequestStatus
from epd.sampling import SamplingConfig, TokenLogprobs, sample

log = logging.getLogger(__name__)

@dataclass
class TokenEvent:
    token_id: int
    logprobs: TokenLogprobs | None
    finish_reason: FinishReason | None = None


@dataclass
class DecodeRequest:
    """One request on the decode side: its state, progress and outbox."""

    request_id: str
    prompt_len: int
    rope_delta: int
    sampling: SamplingConfig
    state: HybridState | None
    last_token: int
    lease_deadline: float  # monotonic time by which a stream must claim it
    deadline: float  # monotonic time after which it is abandoned
    num_generated: int = 1  # the first token came from prefill
    status: RequestStatus = RequestStatus.HANDED_OFF
    claimed: bool = False
    finish_reason: FinishReason | None = None
    outbox: queue.Queue[TokenEvent] = field(default_factory=queue.Queue)


class DecodeScheduler:
    """Which requests step next, and which are done. Plain Python: no tensors."""

    def __init__(self) -> None:
        self.requests: dict[str, DecodeRequest] = {}

    def add(self, request: DecodeRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} was already handed off")
        self.requests[request.request_id] = request

    def runnable(self, now: float) -> list[DecodeRequest]:
        """Expire what must end now, then return the requests to step, oldest first."""
        for request in list(self.requests.values()):
            if request.status is RequestStatus.FINISHED:
                continue
            if not request.claimed and now > request.lease_deadline:
                self.finish(request, FinishReason.CANCELLED)
            elif now > request.deadline:
                self.finish(request, FinishReason.DEADLINE)
        return [r for r in self.requests.values() if r.status is not RequestStatus.FINISHED]

    def after_token(self, request: DecodeRequest, token: int, eos_token_ids: frozenset[int]) -> FinishReason | None:
        request.last_token = token
        request.num_generated += 1
        if token in eos_token_ids and not request.sampling.ignore_eos:
            return FinishReason.EOS
        if request.num_generated >= request.sampling.max_tokens:
            return FinishReason.LENGTH
        return None

    def finish(self, request: DecodeRequest, reason: FinishReason) -> None:
        """Free the request's state; its stream (if any) sees the reason and ends."""
        if request.status is RequestStatus.FINISHED:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.state = None
        if reason in (FinishReason.CANCELLED, FinishReason.DEADLINE, FinishReason.ERROR):
            request.outbox.put(TokenEvent(token_id=-1, logprobs=None, finish_reason=reason))

    def reap(self, now: float) -> None:
        """Forget finished requests: claimed ones (their stream holds them), and unclaimed ones
        whose outbox is empty or whose lease has run out (no stream will come)."""
        for request_id, request in list(self.requests.items()):
            if request.status is not RequestStatus.FINISHED:
                continue
            if request.claimed or request.outbox.empty() or now > request.lease_deadline:
                del self.requests[request_id]


class DecodeEngine:
    def __init__(self, runner: TextModelRunner, eos_token_ids: frozenset[int], lease_s: float,
                 max_batch_size: int = 32) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.lease_s = lease_s
        self.max_batch_size = max_batch_size
        self.scheduler = DecodeScheduler()
        # Owned by the loop thread: the batch, and which request holds each of its slots.
        self._batch = runner.new_batch()
        self._members: list[DecodeRequest] = []
        self.steps = 0
        self.batch_sizes_total = 0  # sum of batch sizes over steps: mean batch = this / steps
        self._lock = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_len: int, rope_delta: int, first_token: int,
               sampling: SamplingConfig, state: HybridState, deadline_unix: float) -> None:
        now = time.monotonic()
        request = DecodeRequest(
            request_id=request_id,
            prompt_len=prompt_len,
            rope_delta=rope_delta,
            sampling=sampling,
            state=state,
            last_token=first_token,
            lease_deadline=now + self.lease_s,
            deadline=now + max(0.0, deadline_unix - time.time()) if deadline_unix else float("inf"),
        )
        with self._lock:
            self.scheduler.add(request)
            self._lock.notify()

    def claim(self, request_id: str) -> DecodeRequest | None:
        with self._lock:
            request = self.scheduler.requests.get(request_id)
            if request is None or request.claimed:
                return None
            request.claimed = True
            return request

    def cancel(self, request_id: str) -> None:
        with self._lock:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.scheduler.finish(request, FinishReason.CANCELLED)

    def num_active(self) -> int:
        with self._lock:
            return sum(r.status is not RequestStatus.FINISHED for r in self.scheduler.requests.values())

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            with self._lock:
                self.scheduler.reap(time.monotonic())
                running = self.scheduler.runnable(time.monotonic())
                while not running and not self._stopped:
                    # Wake at least every lease check interval so unclaimed handoffs expire.
                    self._lock.wait(timeout=0.5)
                    self.scheduler.reap(time.monotonic())
                    running = self.scheduler.runnable(time.monotonic())
                if self._stopped:
                    return
                self._leave_finished()
                joining = [r for r in running if r.status is RequestStatus.HANDED_OFF]
            self._join(joining)
            if not self._members:
                continue
            try:
                self._step()
            except Exception:  # noqa: BLE001 - a failed step ends its requests, never the loop
                log.exception("decode step failed for a batch of %d", len(self._members))
                with self._lock:
                    for request in self._members:
                        self.scheduler.finish(request, FinishReason.ERROR)
                    self._leave_finished()

    def _leave_finished(self) -> None:
        """Drop finished requests from the batch (swap-remove keeps slots dense)."""
        slot = 0
        while slot < len(self._members):
            if self._members[slot].status is RequestStatus.FINISHED:
                moved = self._batch.remove(slot)
                last = self._members.pop()
                if moved is not None:
                    self._members[slot] = last
                continue
            slot += 1

    def _join(self, waiting: list[DecodeRequest]) -> None:
        """Copy handed-off states into free slots, oldest first, up to max_batch_size."""
        for request in waiting:
            if len(self._members) >= self.max_batch_size:
                return
            state = request.state
            if state is None or request.status is not RequestStatus.HANDED_OFF:
                continue  # cancelled since the scheduler listed it
            try:
                self._batch.add(state)
            except Exception:  # noqa: BLE001 - a malformed state fails its own request only
                log.exception("decode could not admit %s", request.request_id)
                with self._lock:
                    self.scheduler.finish(request, FinishReason.ERROR)
                continue
            request.state = None  # the batch holds it now
            request.status = RequestStatus.DECODING
            self._members.append(request)

    def _step(self) -> None:
        members = list(self._members)
        tokens = [r.last_token for r in members]
        positions_ = [positions.decode_position(r.prompt_len, r.num_generated - 1, r.rope_delta) for r in members]
        logits = self.runner.decode_step(self._batch, tokens, positions_)
        sampled = [sample(logits[row], r.sampling, step=r.num_generated) for row, r in enumerate(members)]
        self.steps += 1
        self.batch_sizes_total += len(members)
        with self._lock:
            for request, (token, logprobs) in zip(members, sampled):
                if request.status is RequestStatus.FINISHED:  # cancelled during the step
                    continue
                reason = self.scheduler.after_token(request, token, self.eos_token_ids)
                request.outbox.put(TokenEvent(token_id=token, logprobs=logprobs, finish_reason=reason))
                if reason is not None:
                    self.scheduler.finish(request, reason)
            self._leave_finished()
