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
