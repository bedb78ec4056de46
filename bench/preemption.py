"""What a preemption costs, both ways (docs/ARCHITECTURE.md, "The memory model").

``python -m bench.preemption --model DIR --prompt-tokens 400 --generated 200``: one request's state
is put in a paged decode batch, then
- swap: copied out of the pool (``DecodeBatch.state_of``) and back into a slot (``DecodeBatch.add``),
- replay: prefill of the prompt plus the answer so far, as the router's resume runs it (the prompt
  from the prefix cache: only the answer tokens are computed; ``--no-prefix`` computes it all),
each timed as the median of ``--repeats`` runs, in the same process, one after the other.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.metrics import median_seconds
from decode_svc.batch import DecodeBatch
from epd import positions
from epd.lm import TextModelRunner


def measure(model_dir: str, prompt_tokens: int, generated: int, dtype: str = "float32", repeats: int = 3,
            prefix: bool = True) -> dict:
    runner = TextModelRunner.load(model_dir, dtype=dtype)
    vocab = runner.lm_head_weight.shape[0]
    ids = torch.randint(0, vocab, (prompt_tokens + generated,), generator=torch.Generator().manual_seed(0))
    total = prompt_tokens + generated
    pos, _ = positions.mrope_positions(total, [])
    state = runner.new_state()
    runner.forward(runner.embed(ids), pos, state)
    batch = DecodeBatch(runner, max_slots=2, kv_tokens=2 * (total + 64))
    batch.add(state.clone())

    def swap() -> None:
        out = batch.state_of(0)
        batch.truncate(0)
        batch.add(out)

    prompt_state = runner.new_state()
    runner.forward(runner.embed(ids[:prompt_tokens]), pos[:, :prompt_tokens], prompt_state)

    def replay() -> None:
        if prefix:  # the prompt's snapshot from the prefix cache, the answer computed again
            again = prompt_state.clone()
            runner.forward(runner.embed(ids[prompt_tokens:]), pos[:, prompt_tokens:], again)
        else:
            runner.forward(runner.embed(ids), pos, runner.new_state())

    with torch.inference_mode():
        swap()  # warm-up
        replay()
        swap_s, replay_s = median_seconds(swap, repeats, warmups=0), median_seconds(replay, repeats, warmups=0)
    report = {"model": model_dir, "dtype": dtype, "prompt_tokens": prompt_tokens, "generated": generated,
              "state_bytes": state.nbytes(), "swap_out_and_in_s": swap_s, "replay_prefill_s": replay_s,
              "replay_computes_tokens": generated if prefix else total, "replay_over_swap": replay_s / swap_s,
              "torch_threads": torch.get_num_threads()}
    print(json.dumps(report))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--generated", type=int, default=200)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-prefix", action="store_true", help="replay the prompt too (no prefix-cache hit)")
    args = parser.parse_args()
    measure(args.model, args.prompt_tokens, args.generated, args.dtype, args.repeats, not args.no_prefix)


if __name__ == "__main__":
    main()
