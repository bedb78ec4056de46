"""Tensor parallelism of the language model (epd.tensor_parallel): two real processes joined by a
gloo process group over loopback, each holding half of every sharded weight, give the same greedy
tokens as the one-process runner and as transformers' generate, in float32. Their logits differ
from the one-process runner's only by the all-reduce's summation order (measured: max |diff| 5e-6
dense, 1e-5 MoE over 32 steps; bound here 1e-4)."""

from __future__ import annotations

import pytest

from epd import tensor_parallel as tp
from epd.lm import TextModelRunner

PROMPT = "Tell me about the weather in three sentences."


def _compare(model_dir: str, oracle, num_tokens: int) -> None:
    inputs = oracle.inputs(PROMPT, [])
    prompt_ids = inputs["input_ids"][0].tolist()
    tokens, logits = tp.run_greedy(model_dir, prompt_ids, num_tokens, world=2)
    one_tokens, one_logits = tp.greedy(TextModelRunner.load(model_dir, prepack=False), prompt_ids, num_tokens)
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
        tp.run_greedy(str(tmp_path / "missing"), [1, 2, 3], 2, world=2, timeout_s=120)
