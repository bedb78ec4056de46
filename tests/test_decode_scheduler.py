"""DecodeScheduler bookkeeping: leases, deadlines, finish reasons, reaping; no model involved."""

import pytest

from decode_svc.engine import DecodeRequest, DecodeScheduler, TokenEvent
from epd.lm import HybridState
from epd.request import FinishReason, RequestStatus
from epd.sampling import SamplingConfig

EOS = frozenset({5, 6})


def _request(request_id="r1", *, lease=10.0, deadline=100.0, max_tokens=8, ignore_eos=False, claimed=False):
    return DecodeRequest(
        request_id=request_id,
        prompt_len=12,
        rope_delta=-3,
        sampling=SamplingConfig(max_tokens=max_tokens, ignore_eos=ignore_eos),
        state=HybridState.empty(4),
        last_token=1,
        lease_deadline=lease,
        deadline=deadline,
        claimed=claimed,
    )


def _drain(request):
    events = []
    while not request.outbox.empty():
        events.append(request.outbox.get_nowait())
    return events


def test_runnable_returns_live_requests_in_order():
    sched = DecodeScheduler()
    reqs = [_request(f"r{i}") for i in range(3)]
    for r in reqs:
        sched.add(r)
    assert sched.runnable(now=1.0) == reqs
    assert all(r.status is RequestStatus.HANDED_OFF and r.finish_reason is None for r in reqs)


def test_unclaimed_request_past_lease_is_cancelled():
    sched = DecodeScheduler()
    req = _request(lease=10.0)
    sched.add(req)
    assert sched.runnable(now=9.9) == [req]  # still inside its lease
    assert _drain(req) == []
    assert sched.runnable(now=10.1) == []
    assert req.status is RequestStatus.FINISHED
    assert req.finish_reason is FinishReason.CANCELLED
    assert req.state is None  # state freed
    (event,) = _drain(req)
    assert isinstance(event, TokenEvent)
    assert event.finish_reason is FinishReason.CANCELLED and event.token_id == -1


def test_claimed_request_is_not_expired_by_lease():
    sched = DecodeScheduler()
    req = _request(lease=10.0, deadline=100.0, claimed=True)
    sched.add(req)
    assert sched.runnable(now=50.0) == [req]
    assert req.status is not RequestStatus.FINISHED and req.state is not None
    assert _drain(req) == []


def test_past_deadline_finishes_with_deadline():
    sched = DecodeScheduler()
    req = _request(lease=10.0, deadline=20.0, claimed=True)
    sched.add(req)
    assert sched.runnable(now=20.5) == []
    assert req.finish_reason is FinishReason.DEADLINE and req.state is None
    (event,) = _drain(req)
    assert event.finish_reason is FinishReason.DEADLINE


def test_finished_request_is_not_finished_again():
    sched = DecodeScheduler()
    req = _request(lease=10.0, deadline=20.0)
    sched.add(req)
    sched.runnable(now=30.0)
    assert req.finish_reason is FinishReason.CANCELLED
    sched.runnable(now=31.0)
    sched.finish(req, FinishReason.DEADLINE)
    assert req.finish_reason is FinishReason.CANCELLED
    assert len(_drain(req)) == 1  # exactly one finish event


def test_expiry_only_touches_expired_requests():
    sched = DecodeScheduler()
    late = _request("late", lease=5.0)
    ok = _request("ok", lease=50.0)
    sched.add(late)
    sched.add(ok)
    assert sched.runnable(now=6.0) == [ok]
    assert late.finish_reason is FinishReason.CANCELLED and ok.finish_reason is None


def test_after_token_eos():
    sched = DecodeScheduler()
    req = _request(max_tokens=100)
    sched.add(req)
    assert sched.after_token(req, 42, EOS) is None
    assert req.last_token == 42 and req.num_generated == 2
    assert sched.after_token(req, 6, EOS) is FinishReason.EOS
    assert req.last_token == 6 and req.num_generated == 3


def test_after_token_ignore_eos():
    sched = DecodeScheduler()
    req = _request(max_tokens=100, ignore_eos=True)
    sched.add(req)
    assert sched.after_token(req, 5, EOS) is None
    assert sched.after_token(req, 6, EOS) is None
    assert req.num_generated == 3


def test_after_token_length():
    sched = DecodeScheduler()
    req = _request(max_tokens=4)
    sched.add(req)
    assert req.num_generated == 1  # the first token came from prefill
    assert sched.after_token(req, 10, EOS) is None  # 2
    assert sched.after_token(req, 11, EOS) is None  # 3
    assert sched.after_token(req, 12, EOS) is FinishReason.LENGTH  # 4 == max_tokens
    assert req.num_generated == 4


def test_ignore_eos_still_stops_at_length():
    sched = DecodeScheduler()
    req = _request(max_tokens=2, ignore_eos=True)
    sched.add(req)
    assert sched.after_token(req, 5, EOS) is FinishReason.LENGTH


def test_eos_wins_over_length_on_the_same_token():
    sched = DecodeScheduler()
    req = _request(max_tokens=2)
    sched.add(req)
    assert sched.after_token(req, 5, EOS) is FinishReason.EOS


def test_normal_finish_frees_state_without_extra_event():
    sched = DecodeScheduler()
    req = _request(claimed=True)
    sched.add(req)
    sched.finish(req, FinishReason.LENGTH)
    assert req.status is RequestStatus.FINISHED and req.state is None
    assert _drain(req) == []  # the token event carrying LENGTH is the engine's to publish
    assert sched.runnable(now=1.0) == []


def test_reap_removes_finished_claimed_keeps_unfinished():
    sched = DecodeScheduler()
    done = _request("done", claimed=True)
    running = _request("running", claimed=True)
    waiting = _request("waiting")
    for r in (done, running, waiting):
        sched.add(r)
    sched.finish(done, FinishReason.EOS)
    sched.reap(now=1.0)
    assert set(sched.requests) == {"running", "waiting"}


def test_reap_keeps_unclaimed_finished_with_pending_events_until_lease():
    sched = DecodeScheduler()
    req = _request(lease=10.0)
    sched.add(req)
    req.outbox.put(TokenEvent(token_id=9, logprobs=None))
    sched.finish(req, FinishReason.CANCELLED)  # e.g. cancelled before any stream claimed it
    sched.reap(now=5.0)
    assert "r1" in sched.requests  # a stream may still come for its events
    sched.reap(now=11.0)
    assert "r1" not in sched.requests


def test_reap_after_lease_expiry_forgets_request():
    sched = DecodeScheduler()
    req = _request(lease=10.0)
    sched.add(req)
    sched.runnable(now=12.0)
    sched.reap(now=12.0)
    assert sched.requests == {}


def test_adding_same_id_twice_raises():
    sched = DecodeScheduler()
    sched.add(_request("dup"))
    with pytest.raises(ValueError, match="'dup' was already handed off"):
        sched.add(_request("dup"))
    assert len(sched.requests) == 1


def test_same_id_can_return_after_reap():
    sched = DecodeScheduler()
    first = _request("again", claimed=True)
    sched.add(first)
    sched.finish(first, FinishReason.EOS)
    sched.reap(now=0.0)
    sched.add(_request("again"))
    assert sched.requests["again"] is not first
