"""How transformers' experts implementations compare inside epd's runner on a MoE checkpoint.

``python -m bench.moe_experts --model models/tiny-moe [--json PATH]`` times, for each of
transformers' implementations that run on this device ("eager": a Python loop over the experts
that have tokens; "grouped_mm": the (token, expert) pairs sorted by expert and one grouped product
per projection; "batched_mm": every pair's expert weights gathered and multiplied with ``bmm``),
a prefill chunk of 512 tokens and a batched decode step at batch 1 and 16, and how far its logits
are from the pinned one's (``epd.family.EXPERTS_IMPLEMENTATION``). In process, no servers.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.decode_step import machine_info
from bench.metrics import median_seconds
from decode_svc.batch import DecodeBatch
from epd import positions
from epd.family import EXPERTS_IMPLEMENTATION
from epd.lm import TextModelRunner

IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")
_CONTEXT = 64


def measure(model_dir: str, repeats: int = 5) -> dict:
    runner = TextModelRunner.load(model_dir)
    config = runner.model.config  # every experts module reads its implementation from this config
    vocab = runner.vocab_size
    prompt = torch.randint(0, vocab, (512,), generator=torch.Generator().manual_seed(0))
    context = prompt[:_CONTEXT]
    rows, reference = [], {}
    for impl in IMPLEMENTATIONS:
        config._experts_implementation = impl
        pos, _ = positions.mrope_positions(512, [])
        prefill_s = median_seconds(lambda: runner.forward(runner.embed(prompt), pos, runner.new_state()), repeats)
        prefill_logits = runner.logits(runner.forward(runner.embed(prompt), pos, runner.new_state()))
        row = {"implementation": impl, "prefill_512_s": prefill_s}
        cpos, _ = positions.mrope_positions(_CONTEXT, [])
        state = runner.new_state()
        runner.forward(runner.embed(context), cpos, state)
        for size in (1, 16):
            tokens = [int(t) for t in context[:size]]
            batch = DecodeBatch(runner)
            for _ in range(size):
                batch.add(state.clone())
            row[f"decode_b{size}_logits"] = runner.decode_step(batch, tokens, [_CONTEXT] * size)
            steps = iter(range(1, 10**6))
            row[f"decode_b{size}_s"] = median_seconds(
                lambda: runner.decode_step(batch, tokens, [_CONTEXT + next(steps)] * size), repeats)
        row["prefill_logits"] = prefill_logits
        rows.append(row)
        if impl == EXPERTS_IMPLEMENTATION:
            reference = row
    config._experts_implementation = EXPERTS_IMPLEMENTATION
    reference = dict(reference)  # its logits are dropped from the rows below
    for row in rows:
        for key in ("prefill_logits", "decode_b1_logits", "decode_b16_logits"):
            diff = (row[key] - reference[key]).abs().max().item()
            same = bool(torch.equal(row[key].argmax(-1), reference[key].argmax(-1)))
            row[key.replace("_logits", "_max_abs_diff")] = diff
            row[key.replace("_logits", "_same_argmax")] = same
        for key in ("prefill_logits", "decode_b1_logits", "decode_b16_logits"):
            del row[key]
    return {"model": model_dir, "pinned": EXPERTS_IMPLEMENTATION, "torch_threads": torch.get_num_threads(),
            "rows": rows, "machine": machine_info()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = measure(args.model, args.repeats)
    print(f"{'experts':>11} {'prefill512 ms':>14} {'decode b1 ms':>13} {'decode b16 ms':>14} {'max |dlogit|':>13}")
    for row in report["rows"]:
        diff = max(row["prefill_max_abs_diff"], row["decode_b1_max_abs_diff"], row["decode_b16_max_abs_diff"])
        print(f"{row['implementation']:>11} {row['prefill_512_s'] * 1e3:>14.1f} {row['decode_b1_s'] * 1e3:>13.2f} "
              f"{row['decode_b16_s'] * 1e3:>14.2f} {diff:>13.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
