"""``python -m bench.decode_engine MODEL [--dtype bfloat16] [--batch 8] [--tokens 100]
[--prompt-tokens 48] [--threads 0]``: the decode engine's step as a served replica runs it, in
one process: ``--batch`` prompts of ``--prompt-tokens`` prefilled, handed to a ``DecodeEngine``
and decoded greedily for ``--tokens`` tokens each while this thread reads their event queues as a
stream would. Prints the wall time per engine step (forward, sampling and publishing together), to
set beside ``epd bench decode-step`` (the bare forward) and a served run's TPOT (the same step
behind gRPC, in a Ray worker)."""

from __future__ import annotations

import argparse
import queue
import time

import torch

from decode_svc.engine import DecodeEngine
from epd import positions
from epd.config import DecodeConfig
from epd.lm import TextModelRunner
from epd.modelinfo import ModelInfo
from epd.sampling import SamplingConfig

PROMPT_TOKENS = 48
STALL_S = 600.0  # no token for this long: the engine is stuck (queue.Empty ends the run)


def time_engine_steps(model_dir: str, dtype: str, batch: int, tokens: int,
                      prompt_tokens: int = PROMPT_TOKENS) -> tuple[int, float, int]:
    """(engine steps, wall seconds, rows over those steps) for ``batch`` requests of ``tokens`` greedy tokens each."""
    runner = TextModelRunner.load(model_dir, dtype=dtype, decode=True)  # as a decode replica loads it
    runner.prepare_decode_kernels()
    info = ModelInfo.load(model_dir)
    engine = DecodeEngine(runner, info.eos_token_ids, DecodeConfig(max_batch_size=batch))
    try:
        # every prompt prefilled before any is submitted: a request submitted while the next
        # prompts still prefill would decode (and finish) alone, and the timed steps would not
        # be ``batch`` rows
        prefilled = []
        for i in range(batch):
            ids = torch.randint(0, runner.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(i))
            pos, rope_delta = positions.mrope_positions(prompt_tokens, [])
            state = runner.new_state()
            first = int(runner.logits(runner.forward(runner.embed(ids), pos, state)).argmax())
            prefilled.append((rope_delta, first, state))
        # one queue for every request's events, read with a blocking get: this thread sleeps until
        # a token comes (polling each request's queue every 2 ms cost the step ~2-4 ms at 8 rows,
        # docs/BENCHMARKS.md "Issue 18, 2026-12-05")
        events: queue.Queue = queue.Queue()
        for i, (rope_delta, first, state) in enumerate(prefilled):
            engine.submit(f"r{i}", prompt_tokens, rope_delta, first,
                          SamplingConfig(max_tokens=tokens, ignore_eos=True), state, 0)
            engine.claim(f"r{i}", events.put)
        start, steps_before, rows_before, finished = time.perf_counter(), engine.steps, engine.batch_sizes_total, 0
        while finished < batch:
            if events.get(timeout=STALL_S).finish_reason is not None:
                finished += 1
        return engine.steps - steps_before, time.perf_counter() - start, engine.batch_sizes_total - rows_before
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="each request's prompt length")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, wall, rows = time_engine_steps(args.model, args.dtype, args.batch, args.tokens, args.prompt_tokens)
    print(f"{args.dtype}, batch {args.batch}, {args.prompt_tokens}-token prompts, {args.tokens} tokens each: "
          f"{steps} engine steps of {rows / max(1, steps):.1f} rows on average, "
          f"{wall / max(1, steps) * 1e3:.1f} ms a step")


if __name__ == "__main__":
    main()
