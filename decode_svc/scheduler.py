"""Decode bookkeeping, plain Python (no tensors): which requests exist, which run in which slot of
the batch, whose lease or deadline ran out, and why each one finished.

One ``DecodeRequest`` per handed-off request, with an explicit ``RequestStatus``. The scheduler
decides admission (up to ``max_batch_size`` requests decode together; the rest wait, oldest
first) and the slot mapping (``slots[i]`` is the request in batch slot ``i``; a leaving request's
slot is filled by the last one). ``DecodeEngine`` applies the same moves to the tensors.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from epd.positions import decode_position
from epd.request import FinishReason
from epd.sampling import SamplingConfig, TokenLogprobs


class RequestStatus(enum.Enum):
    HANDED_OFF = "handed_off"  # state received, waiting for a slot in the batch
    DECODING = "decoding"  # in the batch, producing tokens
    FINISHED = "finished"  # done, cancelled or failed; its state is freed


@dataclass
class TokenEvent:
    token_id: int  # -1 when the event only ends the stream
    logprobs: TokenLogprobs | None
    finish_reason: FinishReason | None = None


@dataclass(eq=False)
class DecodeRequest:
    """One request on the decode side: its state until it joins the batch, its progress, and
    where its tokens go (``sink``, set when a stream claims it; events wait in ``pending`` until then)."""

    request_id: str
    prompt_len: int  # tokens in the handed-off state (the prompt, plus the answer so far when resumed)
    rope_delta: int
    sampling: SamplingConfig
    state: object | None  # the HybridState until the batch holds it
    last_token: int
    lease_deadline: float  # monotonic time by which a stream must claim it
    deadline: float  # monotonic time after which it is abandoned
    num_generated: int = 1  # answer tokens so far (the first came from prefill; more when resumed)
    status: RequestStatus = RequestStatus.HANDED_OFF
    claimed: bool = False
    lease_expired: bool = False
    finish_reason: FinishReason | None = None
    sink: Callable[[TokenEvent], None] | None = None
    pending: list[TokenEvent] = field(default_factory=list)
    arrival: int = 0
    steps: int = 0  # decode steps run here: the state holds prompt_len + steps tokens

    @property
    def position(self) -> int:
        """M-RoPE position (all three components) of the token the next step feeds: the state's
        length plus ``rope_delta`` (``epd.positions.decode_position``)."""
        return decode_position(self.prompt_len, self.steps, self.rope_delta)

    def publish(self, event: TokenEvent) -> None:
        if self.sink is None:
            self.pending.append(event)
        else:
            self.sink(event)

    def attach(self, sink: Callable[[TokenEvent], None]) -> None:
        """A stream claimed this request: what waited is delivered first, in order."""
        self.claimed = True
        for event in self.pending:
            sink(event)
        self.pending.clear()
        self.sink = sink


class DecodeScheduler:
    def __init__(self, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.requests: dict[str, DecodeRequest] = {}
        self.slots: list[DecodeRequest] = []  # slots[i] decodes in batch slot i
        self.finished: Counter[str] = Counter()  # requests by finish reason, ever
        self._arrivals = itertools.count()

    # ------------------------------------------------------------ arrivals and streams

    def add(self, request: DecodeRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} was already handed off")
        request.arrival = next(self._arrivals)
        self.requests[request.request_id] = request

    def claim(self, request_id: str, sink: Callable[[TokenEvent], None]) -> DecodeRequest | None:
        """Attach a stream to a handed-off request; None when there is nothing to stream (unknown,
        already claimed, or freed because its lease ran out: a late claim must not look like an
        answer)."""
        request = self.requests.get(request_id)
        if request is None or request.claimed or request.lease_expired:
            return None
        request.attach(sink)
        return request

    # ------------------------------------------------------------ between steps

    def expire(self, now: float) -> None:
        """Finish what must end now: unclaimed past the lease, or past the deadline."""
        for request in self.requests.values():
            if request.status is RequestStatus.FINISHED:
                continue
            if not request.claimed and now > request.lease_deadline:
                request.lease_expired = True
                self.finish(request, FinishReason.CANCELLED)
            elif now > request.deadline:
                self.finish(request, FinishReason.DEADLINE)

    def compact(self) -> list[tuple[int, int]]:
        """Drop finished requests from the slots: each freed slot takes the last slot's request.
        Returns the moves ``(src, dst)`` to apply to the batch, in order; the batch then keeps the
        first ``len(self.slots)`` slots."""
        moves = []
        slot = 0
        while slot < len(self.slots):
            if self.slots[slot].status is not RequestStatus.FINISHED:
                slot += 1
                continue
            last = self.slots.pop()
            if slot < len(self.slots):
                self.slots[slot] = last
                moves.append((len(self.slots), slot))
        return moves

    def admit(self) -> list[DecodeRequest]:
        """Handed-off requests that join the batch now, oldest first, while slots are free; each
        is DECODING from here on and takes the next slot (``slots[-len(result):]``)."""
        free = self.max_batch_size - len(self.slots)
        waiting = [r for r in self.requests.values() if r.status is RequestStatus.HANDED_OFF]
        joining = sorted(waiting, key=lambda r: r.arrival)[: max(0, free)]
        for request in joining:
            request.status = RequestStatus.DECODING
            self.slots.append(request)
        return joining

    def reject(self, request: DecodeRequest) -> None:
        """A request just admitted whose state the batch refused: it leaves the slots and fails.
        The batch has added none of the requests admitted after it yet, so the later ones simply
        move up one slot."""
        self.slots.remove(request)
        self.finish(request, FinishReason.ERROR)

    # ------------------------------------------------------------ after a step

    def after_token(self, request: DecodeRequest, token: int, eos_token_ids: frozenset[int]) -> FinishReason | None:
        request.last_token = token
        request.num_generated += 1
        request.steps += 1
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
        self.finished[reason.value] += 1
        if reason in (FinishReason.CANCELLED, FinishReason.DEADLINE, FinishReason.ERROR):
            request.publish(TokenEvent(token_id=-1, logprobs=None, finish_reason=reason))

    def reap(self, now: float) -> None:
        """Forget finished requests no stream will come for: claimed ones (their stream has the
        events), unclaimed ones with nothing to deliver, and unclaimed ones past their lease."""
        for request_id, request in list(self.requests.items()):
            if request.status is not RequestStatus.FINISHED:
                continue
            if request.claimed or not request.pending or request.lease_expired or now > request.lease_deadline:
                del self.requests[request_id]

    # ------------------------------------------------------------ queries

    @property
    def running(self) -> list[DecodeRequest]:
        return list(self.slots)

    def num_waiting(self) -> int:
        return sum(r.status is RequestStatus.HANDED_OFF for r in self.requests.values())

    def num_unfinished(self) -> int:
        return sum(r.status is not RequestStatus.FINISHED for r in self.requests.values())

    def next_wake(self, now: float) -> float:
        """Seconds until the next lease or deadline can expire (the loop sleeps at most this)."""
        times = [r.lease_deadline for r in self.requests.values()
                 if r.status is not RequestStatus.FINISHED and not r.claimed]
        times += [r.deadline for r in self.requests.values() if r.status is not RequestStatus.FINISHED]
        return max(0.0, min(times, default=now + 1.0) - now)
