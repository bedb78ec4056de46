"""bfloat16 and float16 runs against the float32 transformers oracle, within stated tolerances.

Half precision cannot be token-identical to float32 (argmax flips where two logits are close), so
the check is on distributions, teacher-forced along the oracle's own greedy answer: every step's
KL divergence from float32 stays small, the oracle's token keeps nearly its float32 logprob (on
average; a single low-confidence step may drift more) and stays among the half-precision top 3. The float32 path is held to exact parity elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from bench.synthetic import make_image
from decode_svc.batch import DecodeBatch
from epd import checkpoint, positions
from epd.lm import TextModelRunner

# Measured on the tiny checkpoint (random weights, init 0.1: sharper than a trained model):
# bfloat16 KL <= 0.004 nats per step, the reference token's logprob drifting ~0.04 on average and up
# to ~0.38 at a low-confidence step; float16 KL <= 2e-5 and drift <= 0.015. About 3-5x headroom.
TOLERANCE = {"bfloat16": {"kl": 0.02, "mean_drift": 0.15, "max_drift": 1.0},
             "float16": {"kl": 1e-4, "mean_drift": 0.02, "max_drift": 0.1}}
CASES = [("Tell me about the weather in a long sentence please.", []),
         ("What is in this picture?", [make_image(320, 224, seed=51)])]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_stays_close_to_float32_transformers(dtype, tiny_model_dir, oracle):
    runner = TextModelRunner.load(tiny_model_dir, dtype=dtype)
    vision = checkpoint.build_vision_model(tiny_model_dir, dtype=getattr(torch, dtype))
    limits = TOLERANCE[dtype]
    for prompt, images in CASES:
        inputs = oracle.inputs(prompt, images)
        tokens, _, prompt_len = oracle.generate(prompt, images, max_new_tokens=12)
        with torch.no_grad():  # the oracle's float32 logits at every step of its own answer
            full = torch.cat([inputs["input_ids"], torch.tensor([tokens[:-1]])], dim=1)
            ref = oracle.model(**{**inputs, "input_ids": full, "mm_token_type_ids": (full == oracle.image_token_id).int()})
            ref_logprobs = torch.log_softmax(ref.logits[0, prompt_len - 1 :].float(), dim=-1)

        ids = inputs["input_ids"][0]
        embeds = runner.embed(ids).clone()
        spans = []
        if images:
            grids = inputs["image_grid_thw"]
            spans = positions.find_image_spans(ids.tolist(), oracle.image_token_id,
                                               [(h // 2, w // 2) for _, h, w in grids.tolist()])
            with torch.inference_mode():
                pixel_values = inputs["pixel_values"].to(getattr(torch, dtype))
                image_embeds = vision(pixel_values, grid_thw=grids).pooler_output
            embeds[spans[0].start : spans[0].start + spans[0].num_tokens] = image_embeds
        pos, rope_delta = positions.mrope_positions(len(ids), spans)
        state = runner.new_state()
        got = [runner.logits(runner.forward(embeds, pos, state))]
        batch = DecodeBatch(runner)
        batch.add(state)
        for step, token in enumerate(tokens[:-1]):
            position = positions.decode_position(prompt_len, step, rope_delta)
            got.append(runner.decode_step(batch, [token], [position])[0])
        got_logprobs = torch.log_softmax(torch.stack(got), dim=-1)

        kl = (ref_logprobs.exp() * (ref_logprobs - got_logprobs)).sum(-1)
        rows = torch.arange(len(tokens))
        drift = (ref_logprobs[rows, tokens] - got_logprobs[rows, tokens]).abs()
        top3 = got_logprobs.topk(3, dim=-1).indices
        assert kl.max() < limits["kl"], f"{dtype} KL per step {kl.tolist()}"
        assert drift.mean() < limits["mean_drift"], f"{dtype} reference-token logprob drift {drift.tolist()}"
        assert drift.max() < limits["max_drift"], f"{dtype} reference-token logprob drift {drift.tolist()}"
        assert all(t in row for t, row in zip(tokens, top3.tolist())), f"{dtype}: a reference token left the top 3"
