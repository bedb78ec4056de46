"""Decode bookkeeping, plain Python (no tensors): which requests exist, which run in which slot of
the batch, which K/V blocks each holds, whose lease or deadline ran out, and why each one finished.

One ``DecodeRequest`` per handed-off request, with an explicit ``RequestStatus``. Before every step
``schedule`` returns one ``StepPlan``, as vLLM v1's ``SchedulerOutput``: the requests that left,
the ones preempted to free K/V, the slot moves, and the ones admitted. ``DecodeEngine`` applies it
to the tensors in one place.

Memory (with a ``BlockPool``): a running request holds the blocks of every token it has plus the
one its next token is written to. A handed-off request is admitted (oldest first; resumed ones
before new ones) only while a slot is free and its blocks fit; when a running request needs a new
block and none is free, the most recently admitted request is preempted: its blocks go back, its
stream ends with ``FinishReason.PREEMPTED`` and the router resumes it by replaying the prompt and
the tokens it already has (the path a decode worker's death takes). A handoff is queued only while
the waiting ones hold fewer than ``max_waiting_tokens`` tokens, and one that could never fit the
pool is refused at once (``check_handoff``).
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from decode_svc.blocks import BlockPool
from epd import errors
from epd.positions import decode_position
from epd.request import FinishReason
from epd.sampling import SamplingConfig, TokenHistory, TokenLogprobs


class RequestStatus(enum.Enum):
    HANDED_OFF = "handed_off"  # state received, waiting for a slot in the batch
    DECODING = "decoding"  # in the batch, producing tokens
    SWAPPED = "swapped"  # preempted: its state copied out of the pool, waiting to come back
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
    blocks: list[int] = field(default_factory=list)  # its K/V block table while it decodes
    admitted: int = -1  # admission order (the youngest is preempted first)
    resumed: bool = False  # it had produced tokens elsewhere before (a replay after a preemption or a death)
    swap_bytes: int = 0  # host memory its swapped-out state takes
    history: TokenHistory | None = None  # what its penalties read (epd.sampling), None without one
    grammar: object | None = None  # a structured output's epd.grammar.GrammarState, at the answer so far
    log_id: str = ""  # the request's public id (epd.logs.REQUEST_ID), which every role's lines name

    @property
    def log_name(self) -> str:
        """How decode's own lines name it: the public id every role logs, then this attempt's id."""
        return f"{self.log_id} (attempt {self.request_id})" if self.log_id and self.log_id != self.request_id \
            else self.request_id

    @property
    def num_tokens(self) -> int:
        """Tokens its K/V holds."""
        return self.prompt_len + self.steps

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


@dataclass
class SwapOut:
    """A preempted request whose state must be copied out of the batch before the plan's moves:
    it sat in ``slot`` with ``length`` tokens in ``blocks`` (already back in the pool, not yet reused)."""

    request: DecodeRequest
    slot: int
    blocks: list[int]
    length: int


@dataclass
class StepPlan:
    """What changes before one decode step, in the order the engine applies it."""

    left: list[DecodeRequest] = field(default_factory=list)  # finished since the last step: out of the batch
    preempted: list[DecodeRequest] = field(default_factory=list)  # taken out to free K/V blocks (both ways)
    swapped: list[SwapOut] = field(default_factory=list)  # of those, the ones whose state the engine copies out
    moves: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) slot moves, in order
    admitted: list[DecodeRequest] = field(default_factory=list)  # join at the end, in this order
    blocks_taken: int = 0  # K/V blocks handed out for this step (admissions and growth)
    size: int = 0  # the batch size after the plan


class DecodeScheduler:
    def __init__(self, max_batch_size: int, pool: BlockPool | None = None, max_waiting_tokens: int = 0,
                 max_waiting_requests: int = 0, swap_bytes: int = 0,
                 state_bytes: Callable[[int], int] = lambda tokens: 0) -> None:
        """``pool``: the K/V block allocator (none: no memory accounting, for bookkeeping tests);
        ``max_waiting_tokens`` / ``max_waiting_requests``: bounds on the handed-off requests
        waiting for the batch (0: none); ``swap_bytes``: host memory swapped-out states may take
        (0: preempt by replay only), ``state_bytes(tokens)`` the size of one."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.pool = pool
        self.max_waiting_tokens = max_waiting_tokens
        self.max_waiting_requests = max_waiting_requests
        self.requests: dict[str, DecodeRequest] = {}
        self.slots: list[DecodeRequest] = []  # slots[i] decodes in batch slot i
        self.finished: Counter[str] = Counter()  # requests by finish reason, ever
        self.preemptions = 0
        self.preempted: Counter[str] = Counter()  # preemptions, by how (swap, replay)
        self.swap_bytes = swap_bytes
        self.swap_used = 0
        self.state_bytes = state_bytes
        self.refused: Counter[str] = Counter()  # handoffs refused, by reason
        self._arrivals = itertools.count()
        self._admissions = itertools.count()
        self._reserved: dict[str, tuple[int, float]] = {}  # handoffs on the way: (tokens, held until)

    # ------------------------------------------------------------ memory

    def tokens_needed(self, prompt_len: int, max_tokens: int, num_generated: int) -> int:
        """The most K/V tokens a request can come to hold here: its state plus every token it may
        still feed (the last token it samples is never fed)."""
        return prompt_len + max(0, max_tokens - max(1, num_generated))

    def check_handoff(self, request_id: str, prompt_len: int, max_tokens: int, num_generated: int,
                      now: float = 0.0, hold_s: float = float("inf")) -> None:
        """Before a handoff's bytes are received: refuse one that could never fit the pool
        (``ValueError``: INVALID_ARGUMENT) or that the waiting queue has no room for
        (``errors.ResourceExhausted``); otherwise hold its tokens against the bound until
        ``add`` (or ``release``, or ``hold_s`` after ``now`` when it never comes). A place already
        held for ``request_id`` is simply kept."""
        if request_id in self._reserved:
            return
        if self.pool is not None:
            need = self.tokens_needed(prompt_len, max_tokens, num_generated)
            if self.pool.blocks_for(need) > self.pool.num_blocks:
                self.refused["never_fits"] += 1
                raise ValueError(f"decode: the request needs K/V for {need} tokens ({prompt_len} in its prompt); this "
                                 f"decode worker's pool holds {self.pool.capacity_tokens} (decode.kv_cache_bytes)")
        self._expire_reservations(now)
        waiting = [r for r in self.requests.values() if r.status is RequestStatus.HANDED_OFF]
        count = len(waiting) + len(self._reserved)
        tokens = sum(r.prompt_len for r in waiting) + sum(tokens for tokens, _ in self._reserved.values())
        if self.max_waiting_requests and count >= self.max_waiting_requests:
            self.refused["queue_full"] += 1
            raise errors.ResourceExhausted(f"decode: {count} handed-off requests already wait for the batch "
                                           f"(decode.max_waiting_requests {self.max_waiting_requests})")
        if self.max_waiting_tokens and count and tokens + prompt_len > self.max_waiting_tokens:
            self.refused["queue_full"] += 1
            raise errors.ResourceExhausted(f"decode: the handed-off requests waiting for the batch hold {tokens} "
                                           f"tokens (decode.max_waiting_tokens {self.max_waiting_tokens})")
        self._reserved[request_id] = (prompt_len, now + hold_s)

    def reserved(self, request_id: str) -> bool:
        return request_id in self._reserved

    def _expire_reservations(self, now: float) -> None:
        for request_id, (_, until) in list(self._reserved.items()):
            if now > until:
                del self._reserved[request_id]

    def release(self, request_id: str) -> None:
        """A handoff checked by ``check_handoff`` that never arrived (its stream broke)."""
        self._reserved.pop(request_id, None)

    def schedule(self, now: float) -> StepPlan:
        """The plan for the next step: expire leases and deadlines, take finished requests out
        (their blocks go back), give every running request the block its next token needs
        (preempting the youngest when none is free), move slots, admit what fits."""
        self.expire(now)
        self._expire_reservations(now)
        plan = StepPlan()
        plan.left = [r for r in self.slots if r.status is RequestStatus.FINISHED]
        for request in plan.left:
            self._free_blocks(request)
        plan.preempted, plan.swapped, plan.blocks_taken = self._grow()
        plan.moves = self.compact()
        if not plan.preempted:  # memory ran short this step: let the running ones go on first
            plan.admitted = self.admit()
            plan.blocks_taken += sum(len(r.blocks) for r in plan.admitted)
        self.reap(now)
        plan.size = len(self.slots)
        return plan

    def _grow(self) -> tuple[list[DecodeRequest], list[SwapOut], int]:
        preempted: list[DecodeRequest] = []
        swapped: list[SwapOut] = []
        taken = 0
        if self.pool is None:
            return preempted, swapped, taken
        for request in sorted(self.slots, key=lambda r: r.admitted):
            if request.status is not RequestStatus.DECODING:
                continue
            need = self.pool.blocks_for(request.num_tokens + 1) - len(request.blocks)
            while need > 0 and self.pool.num_free < need:
                victims = [r for r in self.slots if r.status is RequestStatus.DECODING]
                victim = max(victims, key=lambda r: r.admitted)
                if victim is request and len(victims) == 1:
                    # Alone and still too big: check_handoff keeps this from happening.
                    self.finish(request, FinishReason.ERROR)
                    break
                preempted.append(victim)
                swap = self._preempt(victim)
                if swap is not None:
                    swapped.append(swap)
                if victim is request:
                    break
            if request.status is not RequestStatus.DECODING or need <= 0:
                continue
            request.blocks.extend(self.pool.allocate(need, after=request.blocks[-1] if request.blocks else None))
            taken += need
        return preempted, swapped, taken

    def _preempt(self, victim: DecodeRequest) -> SwapOut | None:
        """Take ``victim`` out of the batch and give its blocks back: swapped out while the swap
        space has room for its state, else finished as PREEMPTED (the router replays it)."""
        self.preemptions += 1
        size = self.state_bytes(victim.num_tokens)
        if self.swap_bytes and self.swap_used + size <= self.swap_bytes:
            self.preempted["swap"] += 1
            swap = SwapOut(victim, self.slots.index(victim), list(victim.blocks), victim.num_tokens)
            victim.status = RequestStatus.SWAPPED
            victim.swap_bytes = size
            self.swap_used += size
            self._free_blocks(victim)
            return swap
        self.preempted["replay"] += 1
        self.finish(victim, FinishReason.PREEMPTED)
        self._free_blocks(victim)
        return None

    def _free_blocks(self, request: DecodeRequest) -> None:
        if self.pool is not None and request.blocks:
            self.pool.free(request.blocks)

    # ------------------------------------------------------------ arrivals and streams

    def add(self, request: DecodeRequest) -> None:
        self._reserved.pop(request.request_id, None)
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
        """Drop finished and swapped-out requests from the slots: each freed slot takes the last
        slot's request. Returns the moves ``(src, dst)`` to apply to the batch, in order; the batch
        then keeps the first ``len(self.slots)`` slots."""
        moves = []
        slot = 0
        while slot < len(self.slots):
            if self.slots[slot].status is RequestStatus.DECODING:
                slot += 1
                continue
            last = self.slots.pop()
            if slot < len(self.slots):
                self.slots[slot] = last
                moves.append((len(self.slots), slot))
        return moves

    def admit(self) -> list[DecodeRequest]:
        """Handed-off requests that join the batch now, while slots are free and (with a pool)
        their blocks fit: resumed requests first, then oldest first, never skipping one that does
        not fit yet (a long prompt is not starved by short ones). Each is DECODING from here on,
        holds its blocks and takes the next slot (``slots[-len(result):]``)."""
        joining = []
        for request in self._queue():
            if len(self.slots) >= self.max_batch_size:
                break
            if self.pool is not None:
                need = self.pool.blocks_for(request.num_tokens + 1)
                if need > self.pool.num_free:
                    break
                request.blocks = self.pool.allocate(need)
            if request.status is RequestStatus.SWAPPED:
                self.swap_used -= request.swap_bytes
                request.swap_bytes = 0
            request.status = RequestStatus.DECODING
            request.admitted = next(self._admissions)
            self.slots.append(request)
            joining.append(request)
        return joining

    def reject(self, request: DecodeRequest) -> None:
        """A request just admitted whose state the batch refused: it leaves the slots and fails.
        The batch has added none of the requests admitted after it yet, so the later ones simply
        move up one slot."""
        self.slots.remove(request)
        self.finish(request, FinishReason.ERROR)
        self._free_blocks(request)

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
        if request.status is RequestStatus.SWAPPED:
            self.swap_used -= request.swap_bytes
            request.swap_bytes = 0
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.state = None
        self.finished[reason.value] += 1
        if reason in (FinishReason.CANCELLED, FinishReason.DEADLINE, FinishReason.ERROR, FinishReason.PREEMPTED):
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

    def _queue(self) -> list[DecodeRequest]:
        """Who joins the batch next, in order: swapped-out requests (they were decoding), then
        resumed handoffs, then the oldest."""
        waiting = [r for r in self.requests.values() if r.status in (RequestStatus.HANDED_OFF, RequestStatus.SWAPPED)]
        return sorted(waiting, key=lambda r: (r.status is not RequestStatus.SWAPPED, not r.resumed, r.arrival))

    def num_waiting(self) -> int:
        return len(self._queue())

    def num_reserved(self) -> int:
        """Handoffs on the way (a place held by ``Reserve``)."""
        return len(self._reserved)

    def free_tokens(self) -> int:
        """Tokens the pool has free, less what the waiting and reserved handoffs will take on arrival."""
        if self.pool is None:
            return -1
        waiting = sum(r.prompt_len for r in self._queue() if r.status is RequestStatus.HANDED_OFF)
        reserved = sum(tokens for tokens, _ in self._reserved.values())
        return max(0, self.pool.num_free * self.pool.block_size - waiting - reserved)

    def waiting_by_reason(self) -> dict[str, int]:
        """Requests waiting for the batch, by what holds them: a free slot, or K/V memory (a slot
        is free but their blocks are not); swapped-out ones apart."""
        queue = self._queue()
        counts = {"slots": 0, "memory": 0, "swapped": sum(r.status is RequestStatus.SWAPPED for r in queue)}
        if queue:
            counts["slots" if len(self.slots) >= self.max_batch_size else "memory"] = len(queue)
        return counts

    def num_unfinished(self) -> int:
        return sum(r.status is not RequestStatus.FINISHED for r in self.requests.values())

    def next_wake(self, now: float) -> float:
        """Seconds until the next lease or deadline can expire (the loop sleeps at most this)."""
        times = [r.lease_deadline for r in self.requests.values()
                 if r.status is not RequestStatus.FINISHED and not r.claimed]
        times += [r.deadline for r in self.requests.values() if r.status is not RequestStatus.FINISHED]
        return max(0.0, min(times, default=now + 1.0) - now)
