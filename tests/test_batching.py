"""Continuous batching in the decode engine, in-process on the tiny checkpoint, against transformers.

Requests of different prompt lengths (text and images) and different max_tokens join a running
batch at different steps, wait when the batch is full, and leave as they finish; each must still
produce exactly the tokens transformers' generate gives for it alone.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

import pytest
import torch

from bench.synthetic import make_image
from decode_svc.batch import DecodeBatch
from decode_svc.engine import DecodeEngine
from epd import checkpoint, positions
from epd.config import DecodeConfig
from epd.lm import TextModelRunner
from epd.modelinfo import ModelInfo
from epd.request import FinishReason
from epd.sampling import SamplingConfig

CASES = [  # prompt, images, max_new_tokens
    ("Hello there, tell me a story about a very long road.", [], 24),
    ("What is in this picture?", [make_image(448, 448, seed=31)], 9),
    ("Hi", [], 30),
    ("Compare these.", [make_image(200, 300, seed=32), make_image(320, 160, seed=33)], 14),
    ("Describe the colours.", [make_image(256, 256, seed=34)], 19),
]


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> TextModelRunner:
    return TextModelRunner.load(tiny_model_dir)


@pytest.fixture(scope="module")
def vision(tiny_model_dir):
    return checkpoint.build_vision_model(tiny_model_dir, device="cpu")


def _prefill(runner, vision, oracle, prompt, images):
    """Prefill the oracle's own inputs the way prefill_svc does: splice vision embeddings, M-RoPE."""
    inputs = oracle.inputs(prompt, images)
    ids = inputs["input_ids"][0]
    embeds = runner.embed(ids).clone()
    spans = []
    if images:
        grids = inputs["image_grid_thw"]
        merged = [(int(h) // 2, int(w) // 2) for _, h, w in grids.tolist()]
        spans = positions.find_image_spans(ids.tolist(), oracle.image_token_id, merged)
        with torch.inference_mode():
            image_embeds = vision(inputs["pixel_values"], grid_thw=grids).pooler_output
        offset = 0
        for span in spans:
            embeds[span.start : span.start + span.num_tokens] = image_embeds[offset : offset + span.num_tokens]
            offset += span.num_tokens
    pos, rope_delta = positions.mrope_positions(len(ids), spans)
    state = runner.new_state()
    first = int(runner.logits(runner.forward(embeds, pos, state)).argmax())
    return len(ids), rope_delta, first, state


def _drain(events: queue.Queue, timeout_s=120):
    tokens = []
    deadline = time.monotonic() + timeout_s
    while True:
        event = events.get(timeout=max(0.1, deadline - time.monotonic()))
        if event.token_id >= 0:
            tokens.append(event.token_id)
        if event.finish_reason is not None:
            return tokens, event.finish_reason


def test_requests_join_and_leave_a_running_batch_token_identical(runner, vision, oracle, tiny_model_dir):
    info = ModelInfo.load(tiny_model_dir)
    expected = [oracle.generate(p, imgs, max_new_tokens=n)[0] for p, imgs, n in CASES]
    prefilled = [_prefill(runner, vision, oracle, p, imgs) for p, imgs, _ in CASES]
    assert len({p[0] for p in prefilled}) == len(CASES), "prompts must differ in length"
    for (_, _, first, _), want in zip(prefilled, expected):
        assert first == want[0]

    engine = DecodeEngine(runner, info.eos_token_ids, DecodeConfig(handoff_lease_s=60, max_batch_size=3))
    try:
        claimed = []

        def submit(index):
            prompt_len, rope_delta, first, state = prefilled[index]
            engine.submit(f"r{index}", prompt_len, rope_delta, first, SamplingConfig(max_tokens=CASES[index][2]),
                          state, deadline_unix=0)
            events: queue.Queue = queue.Queue()
            assert engine.claim(f"r{index}", events.put) is not None
            claimed.append(events)

        submit(0)
        submit(1)
        # Let the first two run a few steps before the others join mid-flight.
        first_tokens = [claimed[0].get(timeout=60), claimed[1].get(timeout=60)]
        for index in range(2, len(CASES)):
            submit(index)
        results = []
        for index, request in enumerate(claimed):
            tokens, _ = _drain(request)
            if index < 2:
                tokens = [first_tokens[index].token_id] + tokens
            results.append([prefilled[index][2]] + tokens)
    finally:
        engine.stop()
    assert results == expected
    decode_tokens = sum(len(tokens) - 1 for tokens in expected)
    assert engine.steps < decode_tokens, "requests were stepped one by one, not batched"
    assert engine.batch_sizes_total == decode_tokens
    assert engine.batch_sizes_total / engine.steps > 1.5


@pytest.mark.parametrize("fragmented", [False, True], ids=["runs", "fragmented"])
def test_batched_step_matches_one_request_steps(runner, fragmented):
    """decode_step over ragged slots gives each slot the logits of its own one-request forward,
    whether each slot's blocks are one run (attention reads a view of the pool) or scattered
    one block apart (attention joins the runs)."""
    vocab = runner.lm_head_weight.shape[0]
    lengths = [3, 40, 17, 66]  # 66 + steps crosses several 16-token block edges mid-run
    states, singles, tokens = [], [], []
    for seed, length in enumerate(lengths):
        ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))
        state = runner.new_state()
        pos, _ = positions.mrope_positions(length, [])
        tokens.append(int(runner.logits(runner.forward(runner.embed(ids), pos, state)).argmax()))
        states.append(state)
        single = runner.new_state()
        runner.forward(runner.embed(ids), pos, single)
        singles.append(single)
    batch = DecodeBatch(runner)
    if fragmented:  # every other block taken: each free run is one block long
        every = batch.pool.allocate(batch.pool.num_blocks)
        batch.pool.free(every[::2])
    for state in states:
        batch.add(state)
    runs = [batch._step_index().runs[slot] for slot in range(len(lengths))]
    assert all(len(r) == (lengths[slot] // 16 + 1 if fragmented else 1) for slot, r in enumerate(runs))
    single_tokens = list(tokens)
    for step in range(70):
        logits = runner.decode_step(batch, tokens, [n + step for n in lengths])
        for row, length in enumerate(lengths):
            hidden = runner.forward(runner.embed(torch.tensor([single_tokens[row]])), torch.full((3, 1), length + step),
                                    singles[row])
            reference = runner.logits(hidden)
            torch.testing.assert_close(logits[row], reference, rtol=1e-4, atol=1e-4)
            single_tokens[row] = int(reference.argmax())
        tokens = [int(row.argmax()) for row in logits]
        assert tokens == single_tokens
    # The slot's state is the request's own state, wherever it sits in the buffers.
    batch.move(len(lengths) - 1, 0)
    batch.truncate(len(lengths) - 1)
    state = batch.state_of(0)  # the last request now lives in slot 0
    assert state.num_tokens == singles[-1].num_tokens
    for layer in range(runner.num_layers):
        for kind in ("keys", "values", "conv", "recurrent"):
            got, want = getattr(state, kind)[layer], getattr(singles[-1], kind)[layer]
            assert (got is None) == (want is None)
            if got is not None:
                torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-4, atol=1e-4)
    batch.truncate(0)
    assert len(batch) == 0 and batch.pool.num_used == (batch.pool.num_blocks // 2 if fragmented else 0)


def test_decode_step_rejects_mismatched_inputs(runner):
    batch = DecodeBatch(runner)
    with pytest.raises(ValueError, match="one token and position per slot"):
        runner.decode_step(batch, [], [])


def test_a_malformed_state_is_refused_and_leaves_the_batch_usable(runner):
    vocab = runner.lm_head_weight.shape[0]
    ids = torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(3))
    pos, _ = positions.mrope_positions(9, [])
    good = runner.new_state()
    token = int(runner.logits(runner.forward(runner.embed(ids), pos, good)).argmax())
    bad = runner.new_state()
    runner.forward(runner.embed(ids), pos, bad)
    bad.num_tokens = 5  # disagrees with the K/V it holds
    batch = DecodeBatch(runner)
    with pytest.raises(ValueError, match=r"keys\.\d+ has shape \[1, \d+, 9, \d+\], expected \[1, \d+, 5, \d+\]"):
        batch.add(bad)
    assert len(batch) == 0 and batch.pool.num_used == 0
    bad.num_tokens = 10**9  # a forged length: refused before any buffer is sized from it
    with pytest.raises(ValueError, match="state holds 1000000000 tokens"):
        batch.add(bad)
    assert len(batch) == 0 and batch.pool.num_used == 0
    assert batch.add(good) == 0
    assert runner.decode_step(batch, [token], [9]).shape == (1, vocab)


def test_a_cancel_during_admission_is_not_lost(runner, tiny_model_dir, monkeypatch):
    """A cancel that lands while the request's state is being copied into the batch must end it:
    admission and cancellation both change the request's status under the engine's lock, so the
    admission can never overwrite the cancel and decode a request nobody reads any more."""
    info = ModelInfo.load(tiny_model_dir)
    vocab = runner.lm_head_weight.shape[0]
    ids = torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(7))
    pos, rope_delta = positions.mrope_positions(20, [])
    state = runner.new_state()
    first = int(runner.logits(runner.forward(runner.embed(ids), pos, state)).argmax())
    entered, release = threading.Event(), threading.Event()
    add = DecodeBatch.add

    def slow_add(self, state, blocks=None):
        entered.set()
        release.wait(10)
        return add(self, state, blocks)

    monkeypatch.setattr(DecodeBatch, "add", slow_add)
    engine = DecodeEngine(runner, info.eos_token_ids, DecodeConfig(max_batch_size=4))
    try:
        engine.submit("r", 20, rope_delta, first, SamplingConfig(max_tokens=200, ignore_eos=True), state, 0)
        events: queue.Queue = queue.Queue()
        engine.claim("r", events.put)
        assert entered.wait(30), "the request was never admitted"
        canceller = threading.Thread(target=engine.cancel, args=("r",))
        canceller.start()
        # Wait until the canceller is inside cancel() (blocked on the engine's lock, or, if
        # unguarded, already done): a fixed sleep lost this race on a loaded machine.
        deadline = time.monotonic() + 30
        while canceller.is_alive() and time.monotonic() < deadline:
            frame = sys._current_frames().get(canceller.ident)
            if frame is not None and frame.f_code is DecodeEngine.cancel.__code__:
                break
            time.sleep(0.01)
        time.sleep(0.1)  # from the first line of cancel() onto the lock
        release.set()
        canceller.join(timeout=30)
        tokens, reason = _drain(events)
        time.sleep(0.5)  # a request wrongly left decoding would keep stepping here
        assert reason is FinishReason.CANCELLED and tokens == []
        assert engine.num_unfinished() == 0
        assert engine.steps <= 1
    finally:
        release.set()
        engine.stop()


def test_a_request_whose_logits_go_bad_fails_alone(runner, tiny_model_dir):
    """Non-finite logits in one row (a numerical blow-up in that request's state) end that request
    with an error; the request decoding beside it in the same batch goes on, its tokens unchanged."""
    info = ModelInfo.load(tiny_model_dir)
    vocab = runner.lm_head_weight.shape[0]
    prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 15)]
    prefilled = []
    for ids in prompts:
        pos, rope_delta = positions.mrope_positions(len(ids), [])
        state = runner.new_state()
        first = int(runner.logits(runner.forward(runner.embed(ids), pos, state)).argmax())
        prefilled.append((len(ids), rope_delta, first, state))
    alone = DecodeEngine(runner, info.eos_token_ids, DecodeConfig())
    try:
        expected = _run_one(alone, "alone", prefilled[1], max_tokens=12)
    finally:
        alone.stop()
    poisoned = prefilled[0][3].clone()
    layer = next(i for i, t in enumerate(poisoned.recurrent) if t is not None)
    poisoned.recurrent[layer].fill_(float("nan"))
    engine = DecodeEngine(runner, info.eos_token_ids, DecodeConfig())
    try:
        bad, good = queue.Queue(), queue.Queue()
        engine.submit("bad", *prefilled[0][:3], SamplingConfig(max_tokens=12, ignore_eos=True), poisoned, 0)
        engine.submit("good", *prefilled[1][:3], SamplingConfig(max_tokens=12, ignore_eos=True),
                      prefilled[1][3].clone(), 0)
        engine.claim("bad", bad.put)
        engine.claim("good", good.put)
        assert _drain(bad) == ([], FinishReason.ERROR)
        assert _drain(good) == (expected, FinishReason.LENGTH)
    finally:
        engine.stop()


def _run_one(engine, request_id, prefilled, max_tokens):
    prompt_len, rope_delta, first, state = prefilled
    events: queue.Queue = queue.Queue()
    engine.submit(request_id, prompt_len, rope_delta, first, SamplingConfig(max_tokens=max_tokens, ignore_eos=True),
                  state.clone(), 0)
    engine.claim(request_id, events.put)
    tokens, _ = _drain(events)
    return tokens


def test_a_state_of_another_dtype_is_refused_before_it_can_size_the_batch(runner):
    """A batch sizes its buffers from its first state: one in another dtype (a forged handoff)
    would make every later step mix dtypes, so it is refused and the batch stays usable."""
    ids = torch.arange(3, 10)
    pos, _ = positions.mrope_positions(7, [])
    state = runner.new_state()
    runner.forward(runner.embed(ids), pos, state)
    other = state.clone()
    name = next(n for n, _ in other.named_tensors() if n.startswith("keys."))
    layer = int(name.split(".")[1])
    other.keys[layer] = other.keys[layer].to(torch.float16)
    batch = DecodeBatch(runner)
    with pytest.raises(ValueError, match=rf"{name} is torch.float16, expected torch.float32"):
        batch.add(other)
    assert len(batch) == 0 and batch.pool.num_used == 0
    assert batch.add(state) == 0
