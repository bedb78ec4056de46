"""Decode: one loop that steps every running request and hands tokens to their streams.

``DecodeScheduler`` is bookkeeping only (who is running, whose lease ran out, who finished) and
is testable without a model. ``DecodeEngine`` owns the runner and the loop thread: each step it
asks the scheduler which requests run, runs them, samples, and publishes tokens. Requests join
and leave between steps; the handoff is decoded as soon as it arrives, so tokens are ready when
the router claims the stream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

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
    def __init__(self, runner: TextModelRunner, eos_token_ids: frozenset[int], lease_s: float) -> None:
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.lease_s = lease_s
        self.scheduler = DecodeScheduler()
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
            for request in running:
                try:
                    self._step(request)
                except Exception:  # noqa: BLE001 - one request's failure must not stop the loop
                    log.exception("decode step failed for %s", request.request_id)
                    with self._lock:
                        self.scheduler.finish(request, FinishReason.ERROR)

    def _step(self, request: DecodeRequest) -> None:
        state = request.state
        if state is None:  # finished (cancelled) since the scheduler picked it
            return
        request.status = RequestStatus.DECODING
        position = positions.decode_position(request.prompt_len, request.num_generated - 1, request.rope_delta)
        token_tensor = torch.tensor([request.last_token], dtype=torch.long)
        hidden = self.runner.forward(self.runner.embed(token_tensor), torch.full((3, 1), position), state)
        token, logprobs = sample(self.runner.logits(hidden), request.sampling, step=request.num_generated)
        with self._lock:
            if request.status is RequestStatus.FINISHED:
                return
            reason = self.scheduler.after_token(request, token, self.eos_token_ids)
            request.outbox.put(TokenEvent(token_id=token, logprobs=logprobs, finish_reason=reason))
            if reason is not None:
                self.scheduler.finish(request, reason)
