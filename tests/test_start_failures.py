"""What the controller does when a role's new replicas fail in their constructors
(``control.fleet.StartFailures``): replace them up to the limit, then stop the deployment when
none of the role serves, or keep the ones that serve and start no more; a replica that joins,
or `epd scale`, starts the count again."""

from __future__ import annotations

from control.fleet import StartFailures


def test_none_serving_stops_the_deployment_at_the_limit():
    failures = StartFailures(limit=3)
    assert failures.failed("router", "ValueError: bad", serving=0) == ("replace", "")
    assert failures.failed("router", "ValueError: bad", serving=0) == ("replace", "")
    assert failures.failed("router", "ValueError: bad", serving=0) == (
        "stop", "router replicas failed to start 3 times in a row, last: ValueError: bad")


def test_some_serving_hold_and_scale_tries_again():
    failures = StartFailures(limit=2)
    failures.failed("prefill", "OSError: x", serving=1)
    action, why = failures.failed("prefill", "OSError: x", serving=1)
    assert action == "hold" and failures.holding == {"prefill": why}
    failures.reset("prefill")  # epd scale prefill 2
    assert failures.holding == {} and failures.failed("prefill", "OSError: x", serving=1) == ("replace", "")


def test_a_replica_that_joins_in_between_starts_the_count_again():
    failures = StartFailures(limit=2)
    failures.failed("decode", "e", serving=0)
    failures.reset("decode")  # decode-7 joined
    assert failures.failed("decode", "e", serving=0) == ("replace", "")
    assert failures.failed("encoder", "e", serving=0) == ("replace", "")  # roles count apart
