"""Admission control on a real stack: a router lets at most --max-queued-requests requests wait for
their first token and refuses the rest at once with RESOURCE_EXHAUSTED (no waiting without bound)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from epd import client
from tests.conftest import serving


@pytest.fixture(scope="module")
def limited(tiny_model_dir, tmp_path_factory):
    with serving(tiny_model_dir, "--max-queued-requests", "2",
                 log_path=str(tmp_path_factory.mktemp("logs") / "admission.log")) as server:
        yield server


def test_a_burst_beyond_the_limit_is_refused_at_once_and_the_rest_complete(limited):
    outcomes: list = [None] * 12
    go = threading.Barrier(12)

    def send(n: int) -> None:
        request = client.user_request(f"{n} " + "a long prompt to wait on " * 350, max_tokens=100, ignore_eos=True)
        go.wait()
        started = time.monotonic()
        try:
            result = client.generate(limited.address, request, timeout_s=300)
            outcomes[n] = ("ok", len(result.token_ids), time.monotonic() - started)
        except grpc.RpcError as error:
            outcomes[n] = (error.code().name, error.details(), time.monotonic() - started)

    threads = [threading.Thread(target=send, args=(n,)) for n in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    admitted = [o for o in outcomes if o[0] == "ok"]
    refused = [o for o in outcomes if o[0] != "ok"]
    assert len(admitted) >= 2 and refused, outcomes
    assert all(tokens == 100 for _, tokens, _ in admitted)
    for code, details, took in refused:
        assert code == "RESOURCE_EXHAUSTED" and "limit 2" in details and "retry" in details, details
        assert took < 1.0, f"refused only after {took:.2f} s"
    after = client.generate(limited.address, client.user_request("And now?", max_tokens=3), timeout_s=60)
    assert len(after.token_ids) >= 1
