"""Prefix-aware routing through a real stack with two prefill replicas (tiny model), and a
conversation that outlives the replica holding its prefix (kill -9): every turn token-identical
to transformers, every later turn served from the cache of the replica that holds it, and after
the kill the lost conversations' next turn finds its image in the store (no encode) and
recomputes only the prompt."""

from __future__ import annotations

import os
import signal
import time

import pytest

from bench.synthetic import make_image
from epd import client
from epd.v1 import epd_pb2
from prefill_svc.caches import snapshot_points
from tests.conftest import epd_status, ray_address, serving

BLOCK = 16
EVERY = 4
pytestmark = pytest.mark.slow  # a stack of its own with two prefill replicas and a kill: ~2 min


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    with serving(tiny_model_dir, "--prefill", "2", "--prefix-block-size", str(BLOCK), "--snapshot-every-blocks",
                 str(EVERY), "--prefill-routing", "epd", "--log-level", "INFO",
                 log_path=str(tmp_path_factory.mktemp("logs") / "routing.log")) as server:
        yield server


def _proto(messages):
    return [epd_pb2.ChatMessage(role=m["role"], content=[
        epd_pb2.ContentPart(image=p["image"]) if p["type"] == "image" else epd_pb2.ContentPart(text=p["text"])
        for p in ([{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"])])
        for m in messages]


def _chat(addr, messages):
    return client.generate(addr, client.chat_request(_proto(messages), max_tokens=8), timeout_s=180)


def _expected_cached(oracle, before, after) -> int:
    """What prefill's cache serves ``after`` from the snapshots ``before`` left."""
    ids1 = oracle.chat_inputs(before)["input_ids"][0].tolist()
    ids2 = oracle.chat_inputs(after)["input_ids"][0].tolist()
    shared = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
    turn_start = len(ids1) - 1 - ids1[::-1].index(oracle.tokenizer.convert_tokens_to_ids("<|im_start|>"))
    return max(p for p in snapshot_points(len(ids1), BLOCK, EVERY, turn_start) if p <= shared)


def test_turns_follow_their_prefix_and_outlive_its_replica(stack, oracle):
    conversations = []
    for n in range(4):
        image = make_image(224, 224, seed=500 + n)
        turn = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": f"Picture {n}: what is it?"}]}]
        result = _chat(stack.address, turn)
        assert result.token_ids == oracle.generate_chat(turn, max_new_tokens=8)[0]
        conversations.append((turn, result))
    time.sleep(2.0)  # the replicas' reports (a heartbeat) reach the router's view

    # Turn 2: each lands on the replica holding its first turn (least-load would be right ~half the time).
    turn2s = []
    for turn, first in conversations:
        turn2 = [*turn, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And its colour?"}]
        result = _chat(stack.address, turn2)
        assert result.token_ids == oracle.generate_chat(turn2, max_new_tokens=8)[0]
        assert result.summary.cached_tokens == _expected_cached(oracle, turn, turn2) > 0
        assert result.summary.images_encoded == 0
        turn2s.append((turn2, result))
    time.sleep(2.0)

    # Kill one prefill replica: its conversations' cache is gone; Ray restarts it empty.
    victim = epd_status(ray_address(stack))["roles"]["prefill"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    kept, lost = [], []
    for turn2, second in turn2s:
        turn3 = [*turn2, {"role": "assistant", "content": second.text}, {"role": "user", "content": "Thanks!"}]
        result = _chat(stack.address, turn3)
        assert result.token_ids == oracle.generate_chat(turn3, max_new_tokens=8)[0]
        assert result.summary.images_encoded == 0 and result.summary.images_cached == 1  # the image: from the store
        expected = _expected_cached(oracle, turn2, turn3)
        assert result.summary.cached_tokens in (expected, 0)
        (kept if result.summary.cached_tokens else lost).append(result.summary)
    assert kept and lost, "two replicas held two conversations each: the kill loses some and keeps the others"
    print(f"turn 3 TTFT: kept {[round(s.ttft_s, 3) for s in kept]} s, lost {[round(s.ttft_s, 3) for s in lost]} s; "
          f"prompt {[s.prompt_tokens for s in lost]} tokens recomputed")
