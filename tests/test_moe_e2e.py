"""The mixture-of-experts checkpoint (tiny-moe) through a real `epd serve` stack (Ray local,
embedded redis-server, gRPC on loopback): greedy tokens identical to transformers'
Qwen3_5MoeForConditionalGeneration.generate for text, one image and three images, a second turn
of a conversation served from the prefix cache, and a request resumed after its decode worker
was killed under its stream."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from bench.synthetic import make_image
from epd import client
from tests.conftest import StatusWatch, epd_status, ray_address, serving
from tests.test_cache_e2e import chat, user

SQUARE = make_image(448, 448, seed=1)
WIDE = make_image(640, 200, seed=2)
TALL = make_image(180, 500, seed=3)
BLOCK = 16


@pytest.fixture(scope="module")
def moe_stack(tiny_moe_model_dir, tmp_path_factory):
    with serving(tiny_moe_model_dir, "--encoders", "1", "--decode", "2", "--prefix-block-size", str(BLOCK),
                 "--snapshot-every-blocks", "4", "--log-level", "INFO",
                 log_path=str(tmp_path_factory.mktemp("logs") / "serve-moe.log")) as server:
        yield server


@pytest.mark.parametrize("prompt,images", [
    pytest.param("Hello! Who are you?", [], id="text-only"),
    pytest.param("What is in this picture?", [SQUARE], id="one-image"),
    pytest.param("Compare the three images.", [SQUARE, WIDE, TALL], id="three-images"),
])
def test_greedy_parity_with_transformers_moe(moe_stack, moe_oracle, prompt, images):
    expected, logits, prompt_len = moe_oracle.generate(prompt, images, max_new_tokens=32)
    result = client.generate(moe_stack.address, client.user_request(prompt, images, max_tokens=32, temperature=0.0,
                                                                    logprobs=20), timeout_s=120)
    assert result.token_ids == expected
    assert result.summary.prompt_tokens == prompt_len
    reference = torch.log_softmax(logits, dim=-1)
    ids = [t.token_id for t in result.logprobs[0].top]
    assert ids == torch.topk(reference, 20).indices.tolist()
    ours = torch.tensor([t.logprob for t in result.logprobs[0].top])
    assert torch.allclose(ours, reference[ids], atol=1e-4, rtol=0)


def test_second_turn_through_the_prefix_cache_matches_transformers(moe_stack, moe_oracle):
    image = make_image(448, 448, seed=111)
    turn1 = [user("What is in this picture?", image)]
    first = chat(moe_stack.address, turn1, max_tokens=12)
    assert first.token_ids == moe_oracle.generate_chat(turn1, max_new_tokens=12)[0]
    assert first.text.strip(), "the first answer must have text for the history"
    turn2 = [*turn1, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And what colour?"}]
    second = chat(moe_stack.address, turn2, max_tokens=12)
    assert second.summary.cached_tokens > 196  # the first turn's blocks, its image among them
    assert second.summary.cached_tokens % BLOCK == 0
    assert second.token_ids == moe_oracle.generate_chat(turn2, max_new_tokens=12)[0]


def test_a_request_resumed_after_its_decode_worker_died_still_matches(moe_stack, moe_oracle):
    """Two long streams (one per decode worker, the balancer spreads them); the first decode worker
    seen holding one is killed with SIGKILL: its stream moves to the other worker (a prefill of the
    prompt plus the tokens streamed so far) and both streams still equal transformers' tokens."""
    cases = [("Tell me a long story about the picture.", WIDE), ("Describe every detail you can see here.", TALL)]
    num_tokens = 800
    expected = [moe_oracle.generate_through_eos(moe_oracle.inputs(prompt, [image]), num_tokens)
                for prompt, image in cases]
    watch = StatusWatch(ray_address(moe_stack))
    outcomes: list[dict] = [{} for _ in cases]

    def stream(index: int) -> None:
        prompt, image = cases[index]
        try:
            outcomes[index]["result"] = client.generate(
                moe_stack.address, client.user_request(prompt, [image], max_tokens=num_tokens, ignore_eos=True),
                timeout_s=300)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            outcomes[index]["error"] = error

    threads = [threading.Thread(target=stream, args=(index,)) for index in range(len(cases))]
    try:
        watch.since(time.time())  # the watch is looking (its Ray driver takes seconds to connect)
        started = time.time()
        for thread in threads:
            thread.start()
        killed = None
        deadline = time.monotonic() + 120
        while killed is None and any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            look = watch.since(started)
            started = time.time()
            holders = [r for r in look["roles"]["decode"] if r.get("in_flight")]
            if holders:
                killed = holders[0]
                os.kill(killed["pid"], signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=300)
    finally:
        watch.close()
    assert killed is not None, f"the streams ended before a decode worker was seen holding one: {outcomes}"
    for outcome in outcomes:
        assert "error" not in outcome, outcome["error"]
    results = [outcome["result"] for outcome in outcomes]
    assert sum(result.summary.resumes for result in results) >= 1
    for result, want in zip(results, expected):
        assert len(result.token_ids) == num_tokens
        assert result.token_ids == want
    # the killed worker comes back (Ray restarts it) and the stack serves on
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        decode = epd_status(ray_address(moe_stack))["roles"]["decode"]
        if len(decode) == 2 and all(r["pid"] != killed["pid"] for r in decode):
            break
        time.sleep(1)
    again = client.generate(moe_stack.address, client.user_request("Hello! Who are you?", max_tokens=8), timeout_s=120)
    assert again.token_ids == moe_oracle.generate("Hello! Who are you?", max_new_tokens=8)[0]
