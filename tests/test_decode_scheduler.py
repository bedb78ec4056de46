"""DecodeScheduler bookkeeping: admission and slots, leases, deadlines, finish reasons, claims,
reaping; no model involved."""

import pytest

from decode_svc.scheduler import DecodeRequest, DecodeScheduler, RequestStatus, TokenEvent
from epd.lm import HybridState
from epd.request import FinishReason
from epd.sampling import SamplingConfig

EOS = frozenset({5, 6})


def _request(request_id="r1", *, lease=10.0, deadline=100.0, max_tokens=8, ignore_eos=False):
    return DecodeRequest(
        request_id=request_id,
        prompt_len=12,
        rope_delta=-3,
        sampling=SamplingConfig(max_tokens=max_tokens, ignore_eos=ignore_eos),
        state=HybridState.empty(4),
        last_token=1,
        lease_deadline=lease,
        deadline=deadline,
    )


class Sink(list):
    """A stream's receiving end: the events in the order they were delivered."""

    def __call__(self, event: TokenEvent) -> None:
        self.append(event)


def _claimed(sched, request_id="r1", **kwargs):
    request = _request(request_id, **kwargs)
    sched.add(request)
    sink = Sink()
    assert sched.claim(request_id, sink) is request
    return request, sink


def test_admission_is_oldest_first_up_to_the_batch_limit():
    sched = DecodeScheduler(max_batch_size=2)
    reqs = [_request(f"r{i}") for i in range(3)]
    for r in reqs:
        sched.add(r)
    assert sched.admit() == reqs[:2]
    assert sched.slots == reqs[:2]
    assert [r.status for r in reqs] == [RequestStatus.DECODING, RequestStatus.DECODING, RequestStatus.HANDED_OFF]
    assert sched.admit() == []  # full: the third waits
    assert sched.num_waiting() == 1
    sched.finish(reqs[0], FinishReason.EOS)
    assert sched.compact() == [(1, 0)]  # slot 0 freed: the last slot's request moves into it
    assert sched.slots == [reqs[1]]
    assert sched.admit() == [reqs[2]] and sched.slots == [reqs[1], reqs[2]]


def test_compact_moves_the_last_slots_into_freed_ones():
    sched = DecodeScheduler(max_batch_size=8)
    reqs = [_request(f"r{i}") for i in range(5)]
    for r in reqs:
        sched.add(r)
    sched.admit()
    for index in (0, 2, 4):
        sched.finish(reqs[index], FinishReason.LENGTH)
    moves = sched.compact()
    slots = list(reqs)  # replay the moves on a copy of the slots: the batch does the same to its tensors
    for src, dst in moves:
        slots[dst] = slots[src]
    assert slots[: len(sched.slots)] == sched.slots
    assert sorted(r.request_id for r in sched.slots) == ["r1", "r3"]
    assert all(r.status is RequestStatus.DECODING for r in sched.slots)


def test_a_rejected_admission_leaves_the_slots_the_batch_has():
    sched = DecodeScheduler(max_batch_size=4)
    reqs = [_request(f"r{i}") for i in range(3)]
    for r in reqs:
        sched.add(r)
    joining = sched.admit()
    sched.reject(joining[1])  # the batch refused the second state: the third moves up a slot
    assert sched.slots == [reqs[0], reqs[2]]
    assert reqs[1].finish_reason is FinishReason.ERROR and reqs[1].state is None


def test_unclaimed_request_past_lease_is_cancelled_and_cannot_be_claimed_late():
    sched = DecodeScheduler(max_batch_size=4)
    req = _request(lease=10.0)
    sched.add(req)
    sched.expire(now=9.9)
    assert req.status is RequestStatus.HANDED_OFF  # still inside its lease
    sched.expire(now=10.1)
    assert req.status is RequestStatus.FINISHED and req.finish_reason is FinishReason.CANCELLED
    assert req.state is None  # state freed
    # A stream that arrives after the lease ran out (but before the request is reaped) gets
    # nothing: a lone "cancelled" must never reach the router as if it were an answer.
    assert sched.claim("r1", Sink()) is None
    sched.reap(now=10.2)
    assert sched.requests == {}


def test_events_before_the_claim_are_delivered_first_in_order():
    sched = DecodeScheduler(max_batch_size=4)
    req = _request()
    sched.add(req)
    req.publish(TokenEvent(token_id=9, logprobs=None))
    req.publish(TokenEvent(token_id=10, logprobs=None, finish_reason=FinishReason.LENGTH))
    sched.finish(req, FinishReason.LENGTH)  # finished before any stream came (a short answer)
    sched.reap(now=1.0)
    assert "r1" in sched.requests  # a stream may still come for its events
    sink = Sink()
    assert sched.claim("r1", sink) is req
    assert [e.token_id for e in sink] == [9, 10] and sink[-1].finish_reason is FinishReason.LENGTH
    assert sched.claim("r1", Sink()) is None  # claimed once only


def test_claimed_request_is_not_expired_by_lease():
    sched = DecodeScheduler(max_batch_size=4)
    req, sink = _claimed(sched, lease=10.0, deadline=100.0)
    sched.expire(now=50.0)
    assert req.status is RequestStatus.HANDED_OFF and req.state is not None
    assert sink == []


def test_past_deadline_finishes_with_deadline():
    sched = DecodeScheduler(max_batch_size=4)
    req, sink = _claimed(sched, lease=10.0, deadline=20.0)
    sched.expire(now=20.5)
    assert req.finish_reason is FinishReason.DEADLINE and req.state is None
    assert [e.finish_reason for e in sink] == [FinishReason.DEADLINE]


def test_finished_request_is_not_finished_again():
    sched = DecodeScheduler(max_batch_size=4)
    req, sink = _claimed(sched, deadline=20.0)
    sched.finish(req, FinishReason.CANCELLED)
    sched.expire(now=30.0)
    sched.finish(req, FinishReason.DEADLINE)
    assert req.finish_reason is FinishReason.CANCELLED
    assert len(sink) == 1  # exactly one finish event


def test_expiry_only_touches_expired_requests():
    sched = DecodeScheduler(max_batch_size=4)
    late, ok = _request("late", lease=5.0), _request("ok", lease=50.0)
    sched.add(late)
    sched.add(ok)
    sched.expire(now=6.0)
    assert late.finish_reason is FinishReason.CANCELLED and ok.finish_reason is None
    assert sched.next_wake(now=6.0) == pytest.approx(44.0)


def test_after_token_eos_length_and_ignore_eos():
    sched = DecodeScheduler(max_batch_size=4)
    req = _request(max_tokens=100)
    assert sched.after_token(req, 42, EOS) is None
    assert (req.last_token, req.num_generated) == (42, 2)
    assert sched.after_token(req, 6, EOS) is FinishReason.EOS
    keep = _request(max_tokens=100, ignore_eos=True)
    assert sched.after_token(keep, 5, EOS) is None and keep.num_generated == 2
    short = _request(max_tokens=3)
    assert short.num_generated == 1  # the first token came from prefill
    assert sched.after_token(short, 10, EOS) is None  # 2
    assert sched.after_token(short, 11, EOS) is FinishReason.LENGTH  # 3 == max_tokens
    assert sched.after_token(_request(max_tokens=2, ignore_eos=True), 5, EOS) is FinishReason.LENGTH
    assert sched.after_token(_request(max_tokens=2), 5, EOS) is FinishReason.EOS  # EOS wins on the same token


def test_normal_finish_frees_state_without_extra_event():
    sched = DecodeScheduler(max_batch_size=4)
    req, sink = _claimed(sched)
    sched.finish(req, FinishReason.LENGTH)
    assert req.status is RequestStatus.FINISHED and req.state is None
    assert sink == []  # the token event carrying LENGTH is the engine's to publish
    sched.reap(now=1.0)
    assert sched.requests == {}


def test_reap_keeps_unfinished_and_forgets_finished_claimed():
    sched = DecodeScheduler(max_batch_size=4)
    done, _ = _claimed(sched, "done")
    _claimed(sched, "running")
    sched.add(_request("waiting"))
    sched.finish(done, FinishReason.EOS)
    sched.reap(now=1.0)
    assert set(sched.requests) == {"running", "waiting"}


def test_adding_same_id_twice_raises_and_the_id_can_return_after_reap():
    sched = DecodeScheduler(max_batch_size=4)
    first, _ = _claimed(sched, "dup")
    with pytest.raises(ValueError, match="'dup' was already handed off"):
        sched.add(_request("dup"))
    sched.finish(first, FinishReason.EOS)
    sched.reap(now=0.0)
    sched.add(_request("dup"))
    assert sched.requests["dup"] is not first


# ---------------------------------------------------------------- memory: blocks, admission, preemption

from decode_svc.blocks import BlockPool, NoFreeBlocks  # noqa: E402
from epd import errors  # noqa: E402


def _sized(request_id, prompt_len, max_tokens=1000, num_generated=1):
    request = _request(request_id, max_tokens=max_tokens)
    request.prompt_len = prompt_len
    request.num_generated = num_generated
    request.resumed = num_generated > 1
    return request


def _step(sched, requests):
    """What the engine does after a forward: every running request holds one more token."""
    for request in sched.slots:
        request.steps += 1


def test_block_pool_hands_out_and_takes_back():
    pool = BlockPool(num_blocks=4, block_size=16)
    assert pool.blocks_for(0) == 0 and pool.blocks_for(1) == 1 and pool.blocks_for(16) == 1 and pool.blocks_for(17) == 2
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free == 1 and pool.usage() == 0.75
    with pytest.raises(NoFreeBlocks, match="asked for 2 K/V blocks, 1 of 4 are free"):
        pool.allocate(2)
    pool.free(blocks)
    assert blocks == [] and pool.num_free == 4
    again = pool.allocate(1)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([again[0], again[0]])


def test_block_pool_keeps_each_table_one_run_while_it_can():
    """Placement: a growing table takes the block after its last; a new one goes halfway into the
    largest free run, leaving its predecessor room; a full pool still serves, in pieces."""
    pool = BlockPool(num_blocks=64, block_size=16)
    first = pool.allocate(4)
    assert first == [0, 1, 2, 3]  # an empty pool: from the start
    second = pool.allocate(4)
    assert second[0] == 4 + (60 - 4) // 2 and second == list(range(second[0], second[0] + 4))
    for _ in range(10):  # both grow in place
        first += pool.allocate(1, after=first[-1])
        second += pool.allocate(1, after=second[-1])
    assert first == list(range(14)) and second == list(range(32, 46))
    assert pool.runs() == [(14, 32), (46, 64)]
    third = pool.allocate(2)  # halfway into the first of the two largest runs
    assert third == [22, 23]
    grown = pool.allocate(20, after=first[-1])  # 14..21 in place, the rest halfway into 46..63
    assert grown == list(range(14, 22)) + list(range(49, 61))
    assert pool.num_free == 64 - 14 - 14 - 2 - 20 and pool.runs() == [(24, 32), (46, 49), (61, 64)]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(15)
    assert len(pool.allocate(14)) == 14 and pool.num_free == 0  # a full pool still serves, in pieces


def test_admission_waits_for_blocks_and_never_skips_the_oldest():
    pool = BlockPool(num_blocks=10, block_size=16)
    sched = DecodeScheduler(max_batch_size=8, pool=pool)
    big, small = _sized("big", 16 * 9), _sized("small", 10)  # big needs 10 blocks (its next token too)
    running = _sized("running", 20)  # 2 blocks
    for r in (running, big, small):
        sched.add(r)
    plan = sched.schedule(now=0.0)
    assert plan.admitted == [running] and len(running.blocks) == 2
    assert big.status is RequestStatus.HANDED_OFF and small.status is RequestStatus.HANDED_OFF  # behind big
    assert sched.waiting_by_reason() == {"slots": 0, "memory": 2, "swapped": 0}
    sched.finish(running, FinishReason.EOS)
    plan = sched.schedule(now=0.0)
    assert plan.left == [running] and plan.admitted == [big] and pool.num_free == 0


def test_a_running_request_that_needs_a_block_preempts_the_youngest():
    pool = BlockPool(num_blocks=4, block_size=4)
    sched = DecodeScheduler(max_batch_size=8, pool=pool)  # no swap space: preempted by replay
    old, young = _sized("old", 7), _sized("young", 3)  # 2 blocks and 1 block (next token included)
    sched.add(old)
    assert sched.schedule(now=0.0).admitted == [old]
    sched.add(young)
    assert sched.schedule(now=0.0).admitted == [young]
    sink = Sink()
    young.attach(sink)
    assert pool.num_free == 1
    _step(sched, sched.slots)  # old holds 8 tokens: its 9th needs a third block; young holds 4: a second
    plan = sched.schedule(now=0.0)
    assert plan.preempted == [young] and young.finish_reason is FinishReason.PREEMPTED
    assert [e.finish_reason for e in sink] == [FinishReason.PREEMPTED]  # its stream ends: the router replays it
    assert sched.slots == [old] and len(old.blocks) == 3 and young.blocks == []
    assert plan.admitted == []  # memory ran short this step: nothing new joins
    assert sched.preemptions == 1 and sched.finished["preempted"] == 1 and sched.preempted == {"replay": 1}


def test_a_swapped_out_request_comes_back_first_and_its_swap_space_is_bounded():
    pool = BlockPool(num_blocks=4, block_size=4)
    sched = DecodeScheduler(max_batch_size=8, pool=pool, swap_bytes=100, state_bytes=lambda tokens: 10 * tokens)
    old, young = _sized("old", 7), _sized("young", 3)
    for request in (old, young):
        sched.add(request)
        sched.schedule(now=0.0)
    young_slot = sched.slots.index(young)
    sink = Sink()
    young.attach(sink)
    waiting = _sized("waiting", 1)
    sched.add(waiting)  # arrived before young comes back, but young goes first
    _step(sched, sched.slots)
    plan = sched.schedule(now=0.0)
    assert plan.preempted == [young] and [s.request for s in plan.swapped] == [young]
    (swap,) = plan.swapped
    assert (swap.slot, swap.length, len(swap.blocks)) == (young_slot, 4, 1)  # what the engine copies out
    assert young.status is RequestStatus.SWAPPED and sink == [] and sched.swap_used == 40
    assert sched.waiting_by_reason()["swapped"] == 1
    sched.finish(old, FinishReason.EOS)
    plan = sched.schedule(now=0.0)
    assert plan.admitted == [young, waiting] and sched.swap_used == 0 and young.status is RequestStatus.DECODING
    assert len(young.blocks) == 2  # its 4 tokens and the 5th it writes next
    # A state bigger than the swap space left is preempted by replay instead.
    big = DecodeScheduler(max_batch_size=8, pool=BlockPool(num_blocks=4, block_size=4), swap_bytes=30,
                          state_bytes=lambda tokens: 10 * tokens)
    first, second = _sized("first", 7), _sized("second", 3)
    for request in (first, second):
        big.add(request)
        big.schedule(now=0.0)
    _step(big, big.slots)
    plan = big.schedule(now=0.0)
    assert plan.swapped == [] and second.finish_reason is FinishReason.PREEMPTED and big.preempted == {"replay": 1}


def test_a_swapped_request_cancelled_gives_its_swap_space_back():
    sched = DecodeScheduler(max_batch_size=8, pool=BlockPool(num_blocks=4, block_size=4), swap_bytes=100,
                            state_bytes=lambda tokens: 10 * tokens)
    old, young = _sized("old", 7), _sized("young", 3)
    for request in (old, young):
        sched.add(request)
        sched.schedule(now=0.0)
    _step(sched, sched.slots)
    sched.schedule(now=0.0)
    assert sched.swap_used == 40
    sched.finish(young, FinishReason.CANCELLED)
    assert sched.swap_used == 0 and young.state is None


def test_a_resumed_request_is_admitted_before_older_new_ones():
    pool = BlockPool(num_blocks=100, block_size=16)
    sched = DecodeScheduler(max_batch_size=1, pool=pool)
    fresh, resumed = _sized("fresh", 10), _sized("resumed", 30, num_generated=5)
    sched.add(fresh)
    sched.add(resumed)
    assert sched.schedule(now=0.0).admitted == [resumed]


def test_check_handoff_refuses_what_never_fits_and_bounds_the_waiting_queue():
    pool = BlockPool(num_blocks=8, block_size=16)  # 128 tokens
    sched = DecodeScheduler(max_batch_size=4, pool=pool, max_waiting_tokens=100, max_waiting_requests=3)
    with pytest.raises(ValueError, match=r"needs K/V for 139 tokens \(100 in its prompt\); .* holds 128"):
        sched.check_handoff("huge", prompt_len=100, max_tokens=40, num_generated=1)
    sched.check_handoff("a", prompt_len=60, max_tokens=10, num_generated=1)  # held while its bytes arrive
    with pytest.raises(errors.ResourceExhausted, match="hold 60 tokens"):
        sched.check_handoff("b", prompt_len=60, max_tokens=10, num_generated=1)
    sched.release("a")
    sched.check_handoff("b", prompt_len=60, max_tokens=10, num_generated=1)
    sched.add(_sized("b", 60, max_tokens=10))
    sched.check_handoff("c", prompt_len=20, max_tokens=10, num_generated=1)
    sched.check_handoff("d", prompt_len=10, max_tokens=10, num_generated=1)
    with pytest.raises(errors.ResourceExhausted, match="3 handed-off requests already wait"):
        sched.check_handoff("e", prompt_len=1, max_tokens=1, num_generated=1)
    assert sched.refused == {"never_fits": 1, "queue_full": 2}
    DecodeScheduler(max_batch_size=4, pool=pool).check_handoff("exact", prompt_len=100, max_tokens=29,
                                                               num_generated=1)  # 128 tokens: fits exactly


def test_blocks_of_a_cancelled_request_go_back_at_the_next_schedule():
    pool = BlockPool(num_blocks=4, block_size=16)
    sched = DecodeScheduler(max_batch_size=4, pool=pool)
    request = _sized("r", 40)
    sched.add(request)
    sched.schedule(now=0.0)
    assert pool.num_free == 1
    sched.finish(request, FinishReason.CANCELLED)  # another thread, mid-step: the blocks stay until then
    assert pool.num_free == 1
    plan = sched.schedule(now=0.0)
    assert plan.left == [request] and pool.num_free == 4 and sched.slots == []


def test_decode_lines_name_the_public_request_id_first():
    request = _request("a1b2-attempt")
    assert request.log_name == "a1b2-attempt"  # no public id known (a direct caller)
    request.log_id = "public-7"
    assert request.log_name == "public-7 (attempt a1b2-attempt)"
    request.log_id = "a1b2-attempt"
    assert request.log_name == "a1b2-attempt"
