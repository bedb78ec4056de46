"""``python -m bench.mixed_step MODEL``: a prefill chunk and a decode batch in one forward
(``TextModelRunner.mixed_step``) against the two forwards apart (``forward_many`` then
``decode_step``), in one process, alternating round by round.

The shape is W1's (``epd bench`` workload 1): a 247-token prompt whose 196 image rows sit at a
14x14 M-RoPE grid, and ``--rows`` decode requests each holding a 247-token context plus the
tokens it has decoded so far. Each case is timed twice per round: one thread's CPU time
(``time.process_time``, what the work costs) and wall time with ``--threads`` torch threads (what
a request waits). The batches grow by one token a call on both sides, so both see the same
contexts. Besides ``mixed`` and ``separate`` (= ``prefill`` + ``decode``) the report gives each
part alone, so the mixed forward's extra cost over the prefill alone can be read against a
whole decode step. Alternating in one process is what makes the ratios usable on a shared
machine; the load average is in the report."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from decode_svc.batch import DecodeBatch
from epd import positions
from epd.lm import TextModelRunner

PROMPT_TOKENS = 247  # W1's prompt: 32 text tokens + 196 image tokens + the template's
IMAGE = positions.ImageSpan(start=15, merged_height=14, merged_width=14)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, default=8, help="decode rows (W1: concurrency 8)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the wall-time measure")
    parser.add_argument("--as-replica", action="store_true",
                        help="load the runner as an aggregated replica does (decode=True: merged projections, "
                             "the linear kernel lm.decode_linear_default picks); default: as a prefill replica")
    args = parser.parse_args(argv)
    runner = TextModelRunner.load(args.model_dir, dtype=args.dtype, decode=args.as_replica)
    runner.prepare_decode_kernels()
    generator = torch.Generator().manual_seed(0)
    embeds = runner.embed(torch.randint(0, runner.vocab_size, (PROMPT_TOKENS,), generator=generator))
    pos, rope_delta = positions.mrope_positions(PROMPT_TOKENS, [IMAGE])
    context = runner.new_state()
    runner.forward(embeds, pos, context)

    def batch() -> tuple[DecodeBatch, list[int]]:
        made = DecodeBatch(runner, max_slots=args.rows, kv_tokens=args.rows * (PROMPT_TOKENS + 512))
        for _ in range(args.rows):
            made.add(context)
        return made, [1] * args.rows

    batches = {"mixed": batch(), "separate": batch(), "decode": batch()}

    def decode_inputs(name: str) -> tuple[DecodeBatch, list[int], list[int]]:
        made, tokens = batches[name]
        return made, tokens, [length + rope_delta for length in made.lengths]

    def chunk() -> list:
        return [(embeds, pos, runner.new_state())]

    cases = {
        "mixed": lambda: runner.mixed_step(chunk(), *decode_inputs("mixed"), sample_chunks=frozenset({0})),
        "separate": lambda: (runner.logits(runner.forward_many(chunk())), runner.decode_step(*decode_inputs("separate"))),
        "prefill": lambda: runner.logits(runner.forward_many(chunk())),
        "decode": lambda: runner.decode_step(*decode_inputs("decode")),
    }
    cpu = {name: [] for name in cases}
    wall = {name: [] for name in cases}
    load_before = os.getloadavg()
    for round_ in range(args.rounds):
        order = list(cases) if round_ % 2 == 0 else list(reversed(cases))
        for name in order:
            torch.set_num_threads(1)
            cases[name]()  # warm-up: oneDNN primitives for this shape and thread count
            start = time.process_time()
            cases[name]()
            cpu[name].append(time.process_time() - start)
            torch.set_num_threads(args.threads)
            cases[name]()
            start = time.perf_counter()
            cases[name]()
            wall[name].append(time.perf_counter() - start)
    report = {"model": args.model_dir, "dtype": args.dtype, "prompt_tokens": PROMPT_TOKENS, "image_tokens":
              IMAGE.num_tokens, "decode_rows": args.rows, "rounds": args.rounds, "threads": args.threads,
              "load_average_before": load_before, "load_average_after": os.getloadavg()}
    for measure, seconds in (("cpu_1_thread", cpu), (f"wall_{args.threads}_threads", wall)):
        median = {name: statistics.median(values) for name, values in seconds.items()}
        report[measure] = {
            "median_ms": {name: round(1000 * value, 1) for name, value in median.items()},
            "mixed_over_separate": round(median["mixed"] / median["separate"], 3),
            "rows_extra_ms": round(1000 * (median["mixed"] - median["prefill"]), 1),  # what the rows add to a chunk
            "all_ms": {name: [round(1000 * v, 1) for v in values] for name, values in seconds.items()},
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
