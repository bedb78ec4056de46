"""A tensor-parallel decode replica through a real `epd serve` stack (Ray local, embedded redis,
gRPC on loopback): `--decode-tensor-parallel 2` makes the decode replica two processes (rank 0 the
Ray actor, rank 1 a local process it starts, gloo over loopback), each holding half of every
sharded weight and half of every request's K/V and linear state. A plain (TP=1) prefill hands it
the whole state. Greedy tokens equal transformers' generate (float32) for text, an image and
concurrent requests sharing steps; a follower rank killed under a stream takes its replica down,
the stream resumes on the other decode replica and the killed one comes back."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from bench.synthetic import make_image
from epd import client
from tests.conftest import epd_status, ray_address, serving

PROMPT = "Tell me about the weather in three sentences."


@pytest.fixture(scope="module")
def tp_stack(tiny_model_dir, tmp_path_factory):
    with serving(tiny_model_dir, "--encoders", "1", "--decode", "1", "--decode-tensor-parallel", "2",
                 "--max-batch-size", "4", "--log-level", "INFO",
                 log_path=str(tmp_path_factory.mktemp("logs") / "serve-tp.log")) as server:
        yield server


def _followers(address: str) -> list[psutil.Process]:
    """The decode replicas' follower ranks (children of the decode actor running
    ``decode_svc.tensor_parallel``), by decode pid."""
    out = []
    for replica in epd_status(address)["roles"]["decode"]:
        for child in psutil.Process(replica["pid"]).children():
            if "decode_svc.tensor_parallel" in " ".join(child.cmdline()):
                out.append(child)
    return out


def test_tp2_decode_is_token_identical_to_transformers(tp_stack, oracle):
    assert len(_followers(ray_address(tp_stack))) == 1  # rank 1 of the one decode replica runs
    image = make_image(448, 448, seed=1)
    cases = [(PROMPT, []), ("What is in this picture?", [image])]
    expected = [oracle.generate_through_eos(oracle.inputs(prompt, images), 24) for prompt, images in cases]
    results: list = [None] * len(cases)

    def run(index: int) -> None:  # concurrently: the two requests share decode steps
        prompt, images = cases[index]
        results[index] = client.generate(tp_stack.address, client.user_request(
            prompt, images, max_tokens=24, temperature=0.0, ignore_eos=True), timeout_s=180)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=200)
    for result, want in zip(results, expected):
        assert result is not None and result.token_ids == want


def test_status_shows_one_decode_replica(tp_stack):
    decode = epd_status(ray_address(tp_stack))["roles"]["decode"]
    assert len(decode) == 1 and decode[0].get("kv")  # one replica to the router and status, its pool reported


@pytest.mark.slow
def test_a_killed_follower_rank_restarts_its_replica_and_no_request_fails(tiny_model_dir, oracle, tmp_path):
    """Two TP=2 decode replicas; while a long stream runs, the follower rank of the replica holding
    it is killed: the replica exits, the stream resumes on the other one (token-identical), and
    the replica comes back with a new follower."""
    num_tokens = 400
    inputs = oracle.inputs(PROMPT, [])
    want = oracle.generate_through_eos(inputs, num_tokens)
    with serving(tiny_model_dir, "--encoders", "1", "--decode", "2", "--decode-tensor-parallel", "2",
                 "--log-level", "INFO", log_path=str(tmp_path / "serve.log")) as server:
        address = ray_address(server)
        outcome: dict = {}

        def stream() -> None:
            try:
                outcome["result"] = client.generate(server.address, client.user_request(
                    PROMPT, [], max_tokens=num_tokens, temperature=0.0, ignore_eos=True), timeout_s=300)
            except BaseException as error:  # noqa: BLE001 - reported below
                outcome["error"] = error

        thread = threading.Thread(target=stream)
        thread.start()
        killed = None
        deadline = time.monotonic() + 120
        while killed is None and thread.is_alive() and time.monotonic() < deadline:
            for replica in epd_status(address)["roles"]["decode"]:
                if replica.get("in_flight"):
                    for child in psutil.Process(replica["pid"]).children():
                        if "decode_svc.tensor_parallel" in " ".join(child.cmdline()):
                            killed = (replica["pid"], child.pid)
                            os.kill(child.pid, signal.SIGKILL)
            time.sleep(0.1)
        thread.join(timeout=300)
        assert killed is not None, f"the stream ended before a decode replica was seen holding it: {outcome}"
        assert "error" not in outcome, outcome["error"]
        assert outcome["result"].summary.resumes >= 1
        assert outcome["result"].token_ids == want
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            decode = epd_status(address)["roles"]["decode"]
            if len(decode) == 2 and all(r["pid"] != killed[0] for r in decode) and len(_followers(address)) == 2:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"the replica did not come back with its follower: {decode}")
        again = client.generate(server.address, client.user_request(PROMPT, [], max_tokens=12, temperature=0.0,
                                                                     ignore_eos=True), timeout_s=120)
        assert again.token_ids == want[:12]
