"""Tensor parallelism of the language model (epd.tensor_parallel): two real processes joined by a
gloo process group over loopback, each holding half of every sharded weight, give the same greedy
tokens as the one-process runner and as transformers' generate, in float32. Their logits differ
from the one-process runner's only by the all-reduce's summation order (measured: max |diff| 5e-6
dense, 1e-5 MoE over 32 steps; bound here 1e-4)."""

from __future__ import annotations

import pytest

from bench import tp_driver
from epd import tensor_parallel as tp
from epd.lm import TextModelRunner

PROMPT = "Tell me about the weather in three sentences."


def _compare(model_dir: str, oracle, num_tokens: int) -> None:
    inputs = oracle.inputs(PROMPT, [])
    prompt_ids = inputs["input_ids"][0].tolist()
    tokens, logits = tp_driver.run_greedy(model_dir, prompt_ids, num_tokens, world=2)
    one_tokens, one_logits = tp_driver.greedy(TextModelRunner.load(model_dir, prepack=False), prompt_ids, num_tokens)
    assert tokens == one_tokens
    assert tokens == oracle.generate_through_eos(inputs, num_tokens)
    assert logits.shape == one_logits.shape
    assert (logits - one_logits).abs().max().item() < 1e-4


def test_tp2_dense_is_token_identical_to_one_process_and_transformers(tiny_model_dir, oracle):
    _compare(tiny_model_dir, oracle, num_tokens=12)


@pytest.mark.slow
def test_tp2_moe_is_token_identical_to_one_process_and_transformers(tiny_moe_model_dir, moe_oracle):
    _compare(tiny_moe_model_dir, moe_oracle, num_tokens=32)


def test_heads_that_do_not_split_are_refused(tiny_model_dir):
    runner = TextModelRunner.load(tiny_model_dir, prepack=False)
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        tp.shard_runner(runner, 0, 3)  # tiny has 4 query / 2 K/V heads, 4 key / 4 value linear heads


@pytest.mark.slow
def test_a_failed_rank_is_reported_with_its_error(tmp_path):
    with pytest.raises(RuntimeError, match="tensor-parallel rank 0 failed"):
        tp_driver.run_greedy(str(tmp_path / "missing"), [1, 2, 3], 2, world=2, timeout_s=120)


@pytest.mark.slow
def test_state_moves_between_tp2_and_tp1(tiny_model_dir, oracle, tmp_path):
    """Prefill with TP=2 -> the gathered whole state -> decode in one process; and prefill in one
    process -> the whole state split over 2 ranks -> decode with TP=2: both give transformers'
    tokens, and the gathered state equals the one-process prefill's to float32 rounding."""
    inputs = oracle.inputs(PROMPT, [])
    prompt_ids = inputs["input_ids"][0].tolist()
    want = oracle.generate_through_eos(inputs, 10)
    runner = TextModelRunner.load(tiny_model_dir, prepack=False)

    tp_driver.run_greedy(tiny_model_dir, prompt_ids, 10, world=2, state_out=str(tmp_path / "from_tp2.safetensors"))
    gathered, first = tp_driver.load_state(str(tmp_path / "from_tp2.safetensors"), runner.num_layers)
    runner.check_state(gathered)  # exactly the shapes and dtypes of a one-process state
    alone, first_logits = tp_driver.prefill(runner, prompt_ids)
    for (name, a), (_, b) in zip(alone.named_tensors(), gathered.named_tensors()):
        assert (a - b).abs().max().item() < 1e-4, name
    assert first == int(first_logits.argmax())
    assert tp_driver.decode(runner, gathered, first, 10)[0] == want

    tp_driver.save_state(str(tmp_path / "from_tp1.safetensors"), alone, first)
    tokens, _ = tp_driver.run_greedy(tiny_model_dir, prompt_ids, 10, world=2, state_in=str(tmp_path / "from_tp1.safetensors"))
    assert tokens == want
