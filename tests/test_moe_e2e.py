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


def _streams_and_a_kill(stack, watch: StatusWatch, cases, num_tokens: int):
    """The ``cases`` streamed at once; the first decode worker a status look shows holding one is
    killed with SIGKILL, but only while both streams are decoding (the client has tokens of each)
    and neither is within a tenth of its end: a look that comes later kills nothing (the tiny
    model streams 800 tokens in ~4-5 s, and `epd status --watch` looked 0.4 s and then 3.2 s into
    one attempt). Returns (the killed replica's status row or None, [(token ids, summary)] per case)."""
    received: list[list[int]] = [[] for _ in cases]
    summaries: list = [None] * len(cases)
    failures: list = [None] * len(cases)

    def stream(index: int) -> None:
        prompt, image = cases[index]
        request = client.user_request(prompt, [image], max_tokens=num_tokens, ignore_eos=True)
        try:
            for event in client.stream(stack.address, request, timeout_s=300):
                if event.WhichOneof("event") == "summary":
                    summaries[index] = event.summary
                else:
                    received[index].extend(event.chunk.token_ids)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            failures[index] = error

    threads = [threading.Thread(target=stream, args=(index,)) for index in range(len(cases))]
    started = time.time()
    for thread in threads:
        thread.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        look = watch.since(started)
        started = time.time()
        holders = [r for r in look["roles"]["decode"] if r.get("in_flight")]
        progress = [len(tokens) for tokens in received]
        if holders and min(progress) >= 4 and max(progress) <= 0.9 * num_tokens:
            killed = holders[0]
            os.kill(killed["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=300)
    assert failures == [None] * len(cases), failures
    return killed, list(zip(received, summaries))


def test_a_request_resumed_after_its_decode_worker_died_still_matches(moe_stack, moe_oracle):
    """Two long streams (one per decode worker, the balancer spreads them); the first decode worker
    seen holding one is killed with SIGKILL: its stream moves to the other worker (a prefill of the
    prompt plus the tokens streamed so far) and both streams still equal transformers' tokens. An
    attempt whose status look came too late to kill anything mid-stream is checked the same and
    run again (three at most)."""
    cases = [("Tell me a long story about the picture.", WIDE), ("Describe every detail you can see here.", TALL)]
    num_tokens = 800
    expected = [moe_oracle.generate_through_eos(moe_oracle.inputs(prompt, [image]), num_tokens)
                for prompt, image in cases]
    watch = StatusWatch(ray_address(moe_stack))
    try:
        watch.since(time.time())  # the watch is looking (its Ray driver takes seconds to connect)
        for _ in range(3):
            killed, results = _streams_and_a_kill(moe_stack, watch, cases, num_tokens)
            for (tokens, summary), want in zip(results, expected):
                assert summary is not None and len(tokens) == num_tokens
                assert tokens == want
            if killed is not None:
                break
            watch.since(time.time() + 1)  # the ended streams are out of the registry's loads
    finally:
        watch.close()
    assert killed is not None, "no status look showed a decode worker holding a stream while both had tokens to go"
    assert sum(summary.resumes for _, summary in results) >= 1
    # the killed worker comes back (Ray restarts it) and the stack serves on
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        decode = epd_status(ray_address(moe_stack))["roles"]["decode"]
        if len(decode) == 2 and all(r["pid"] != killed["pid"] for r in decode):
            break
        time.sleep(1)
    again = client.generate(moe_stack.address, client.user_request("Hello! Who are you?", max_tokens=8), timeout_s=120)
    assert again.token_ids == moe_oracle.generate("Hello! Who are you?", max_new_tokens=8)[0]
