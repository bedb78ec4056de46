"""How far tensor parallelism's logits are from the one-process runner's (epd.tensor_parallel).

    python -m bench.tp_parity --model DIR [--world 2] [--tokens 32] [--prompt-tokens 40]

Greedy on a random text prompt (seeded), once in this process and once over ``--world`` gloo
ranks; prints whether the tokens are identical, the largest absolute and relative logit
difference over every step, and how many steps' logits are bit-identical. Float32 sums in the
all-reduce run in another order than one matmul's, so the last bits can differ.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench import tp_driver
from epd.lm import TextModelRunner


def measure(model_dir: str, world: int, num_tokens: int, prompt_tokens: int) -> dict:
    runner = TextModelRunner.load(model_dir, prepack=False)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, min(500, runner.vocab_size), (prompt_tokens,), generator=generator).tolist()
    one_tokens, one_logits = tp_driver.greedy(runner, prompt, num_tokens)
    tokens, logits = tp_driver.run_greedy(model_dir, prompt, num_tokens, world=world)
    diff = (logits - one_logits).abs()
    return {"model": model_dir, "world": world, "tokens": num_tokens, "identical_tokens": tokens == one_tokens,
            "max_abs_logit_diff": diff.max().item(),
            "max_rel_logit_diff": (diff.max() / one_logits.abs().max()).item(),
            "bit_identical_steps": int((diff.amax(-1) == 0).sum()), "steps": diff.shape[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    args = parser.parse_args()
    print(json.dumps(measure(args.model, args.world, args.tokens, args.prompt_tokens)))


if __name__ == "__main__":
    main()
