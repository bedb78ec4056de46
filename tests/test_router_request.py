"""The router's request as a state machine: plain Python, no stack."""

import pytest

from router_svc.request import InvalidTransition, RouterRequest, RouteStatus


def test_a_request_walks_its_path_and_keeps_its_id_across_retries_and_resumes():
    run = RouterRequest(client_id="client-1")
    first_id = run.id
    assert run.status is RouteStatus.TOKENIZING and run.attempt_id == first_id and run.stage == "tokenize"
    run.to(RouteStatus.ENCODING)
    run.to(RouteStatus.PREFILLING)
    assert run.stage == "prefill"
    retry_id = run.new_attempt("prefill retried on another replica")
    assert retry_id == f"{first_id}.1" and run.id == first_id
    run.to(RouteStatus.STREAMING)
    assert run.streamed and run.stage == "decode"
    run.resume(preempted=False)
    assert run.status is RouteStatus.RESUMING and run.resumes == 1 and run.preemptions == 0
    assert run.attempt_id == f"{first_id}.2" and run.stage == "decode"  # a client that leaves now left in decode
    run.to(RouteStatus.PREFILLING)
    run.to(RouteStatus.ENCODING)  # an embedding went missing during the resume's prefill
    run.to(RouteStatus.PREFILLING)
    run.to(RouteStatus.STREAMING)
    run.resume(preempted=True)
    assert (run.resumes, run.preemptions) == (2, 1)
    run.to(RouteStatus.FINISHED)
    assert run.id == first_id


@pytest.mark.parametrize("start, bad", [
    (RouteStatus.TOKENIZING, RouteStatus.PREFILLING),  # no prefill before the images are encoded
    (RouteStatus.ENCODING, RouteStatus.STREAMING),
    (RouteStatus.STREAMING, RouteStatus.PREFILLING),  # a lost stream is a resume, one visible step
    (RouteStatus.FINISHED, RouteStatus.ENCODING),
])
def test_a_move_that_is_not_a_transition_is_refused(start, bad):
    run = RouterRequest(client_id="")
    run.status = start
    with pytest.raises(InvalidTransition, match=f"{start.name} -> {bad.name}"):
        run.to(bad)
    assert run.status is start


def test_any_status_may_finish():
    for status in RouteStatus:
        run = RouterRequest(client_id="")
        run.status = status
        run.to(RouteStatus.FINISHED)
        assert run.status is RouteStatus.FINISHED
