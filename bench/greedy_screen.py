"""The greedy screen of the LM head against the whole head, on this CPU's screen path.

``python -m bench.greedy_screen [MODEL] [--rows 8,16] [--threads 2] [--repeats 25]`` prints one
line per row count and one JSON line. With MODEL (a checkpoint) the head is its LM head and the
rows are real final-normed hidden states of a greedy decode (16 prompts of random token ids, a
few steps in); without, a random head of the 0.8b's shape (248,320 x 1,024, N(0, 0.02)) and
Gaussian rows (N(0, 3)), one of them with an outlier feature 40x its size. bfloat16.

For each row count it times (wall, median of ``--repeats`` after 3 warm-up, the calls
interleaved so that the machine's drift falls on each alike):

- ``full``: the head's logits on the few-row kernel and each row's first maximum
  (``greedy_rows(head.forward_float(x))``: what a decode step does without the screen);
- ``columns``: the screen's pass over the int8 copy alone (``GreedyScreen.columns``);
- ``screen``: the screen and its exact product of the columns left (``GreedyScreen.argmax``);

and reports the columns left (for all rows, and the median and largest for one row alone) and
which path the CPU takes (``tiles``: AMX-INT8; ``vector``: AVX-512 VNNI).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from epd import fused, kernels

VOCAB, WIDTH = 248320, 1024


def _real(model: str, rows: int):
    """The checkpoint's LM head and ``rows`` final-normed hidden rows of a greedy decode."""
    from bench.decode_step import prefilled_batch
    from epd.lm import TextModelRunner

    runner = TextModelRunner.load(model, dtype="bfloat16", prepack=False)
    runner.prepack_linears(decode=True, merge=True, few_rows=True)
    runner.decode_plan = False
    saved = []
    greedy = runner.greedy

    def keep(hidden):
        saved.append(hidden.detach().reshape(-1, hidden.shape[-1]).clone())
        return greedy(hidden)

    runner.greedy = keep
    context = 200
    batch, tokens = prefilled_batch(runner, rows, context)
    for step in range(4):
        tokens = runner.decode_step_greedy(batch, tokens, [context + step] * rows)[0].tolist()
    return runner.lm_head_weight, saved[-1]


def _synthetic(rows: int, gen: torch.Generator):
    x = torch.randn(rows, WIDTH, generator=gen) * 3
    x[min(2, rows - 1), 5] *= 40  # an outlier feature
    return x.bfloat16()


def _wall_ms(fns: dict, repeats: int) -> dict[str, float]:
    for fn in fns.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="a checkpoint (default: a random head of the 0.8b's shape)")
    parser.add_argument("--rows", default="8,16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not fused.decode_screens():
        raise SystemExit("this CPU or build has no greedy screen (it needs AMX-INT8 or AVX-512 VNNI)")
    counts = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    if args.model:
        weight, hidden = _real(args.model, max(counts))
    else:
        weight, hidden = (torch.randn(VOCAB, WIDTH, generator=gen) * 0.02).bfloat16(), _synthetic(max(counts), gen)
    head = kernels.DecodeLinear(weight)
    screen = kernels.GreedyScreen(head, weight)
    results = []
    for rows in counts:
        x = hidden[:rows].contiguous()
        got = screen.argmax(x)
        want = kernels.greedy_rows(head.forward_float(x))[0]
        assert got is not None and torch.equal(got[0], want), "the screen disagrees with the whole head"
        times = _wall_ms({"full": lambda: kernels.greedy_rows(head.forward_float(x)),
                          "columns": lambda: screen.columns(x), "screen": lambda: screen.argmax(x)}, args.repeats)
        alone = sorted(screen.columns(x[r:r + 1]).numel() for r in range(rows))
        result = {"rows": rows, **{f"{k}_ms": v for k, v in times.items()}, "columns_left": screen.columns(x).numel(),
                  "one_row_median": alone[len(alone) // 2], "one_row_max": alone[-1]}
        results.append(result)
        print(f"{rows} rows: whole head {times['full']} ms, screen {times['screen']} ms (its int8 pass "
              f"{times['columns']} ms), {result['columns_left']} columns left (one row alone: median "
              f"{result['one_row_median']}, largest {result['one_row_max']})")
    print(json.dumps({"path": fused.decode_screen_kind(), "model": args.model or "random 248320x1024",
                      "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
