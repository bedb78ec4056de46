"""``python -m bench.step_costs MODEL CASE``: the in-process measurements behind "Issue 18 on the
AMD EPYC, a fourth time" (docs/BENCHMARKS.md), each alternated in one process so that a noisy
host moves both sides alike.

- ``chunks --sizes 247,64 --threads T``: a W1 prompt (247 tokens, one image) prefilled whole and
  in chunks of each size, continuing one state: what splitting a prompt into more forwards costs.
- ``gil --period-ms P --burst-us B``: an 8-row bfloat16 decode step (300 tokens of context, two
  threads) alone and beside one more Python thread that wakes every P ms and runs B µs of Python,
  as a served replica's gRPC loop does for a step's tokens: what the GIL's hand-overs cost a step.
- ``beside --threads 1``: the prompt alone and beside a one-thread vision-tower loop in another
  process (two roles' forwards on two cores): whether they slow each other.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

import torch

from bench.mixed_step import IMAGE, PROMPT_TOKENS
from epd import positions
from epd.lm import TextModelRunner


def _prompt(runner: TextModelRunner):
    embeds = runner.embed(torch.randint(0, runner.vocab_size, (PROMPT_TOKENS,),
                                        generator=torch.Generator().manual_seed(0)))
    pos, _ = positions.mrope_positions(PROMPT_TOKENS, [IMAGE])

    def prefill(chunk: int) -> float:
        state, start = runner.new_state(), time.perf_counter()
        for lo in range(0, PROMPT_TOKENS, chunk):
            runner.forward_many([(embeds[lo:lo + chunk], pos[:, lo:lo + chunk], state)])
        return time.perf_counter() - start
    return prefill


def _alternate(cases: dict, rounds: int) -> dict[str, float]:
    """Each case once as warm-up, then ``rounds`` rounds in alternating order: median seconds."""
    for run in cases.values():
        run()
    times = {name: [] for name in cases}
    for round_ in range(rounds):
        for name in (list(cases) if round_ % 2 == 0 else list(reversed(cases))):
            times[name].append(cases[name]())
    return {name: statistics.median(values) for name, values in times.items()}


def chunks(args, runner: TextModelRunner) -> None:
    prefill = _prompt(runner)
    sizes = [int(size) for size in args.sizes.split(",")]
    for size, seconds in _alternate({str(s): (lambda s=s: prefill(s)) for s in sizes}, args.rounds).items():
        print(f"{PROMPT_TOKENS} tokens in chunks of {size}, {args.threads} thread(s): {seconds:.3f} s")


def gil(args, runner: TextModelRunner) -> None:
    from bench.decode_step import prefilled_batch

    rows, context = 8, 300
    batch, tokens = prefilled_batch(runner, rows, context, vocab=1000)
    position = [context]

    def steps(count: int = 25) -> float:
        walls = []
        for _ in range(count):
            start = time.perf_counter()
            tokens[:] = runner.decode_step_greedy(batch, tokens, [position[0]] * rows)[0].tolist()
            walls.append(time.perf_counter() - start)
            position[0] += 1
        return statistics.median(walls)

    def beside_python() -> float:
        stop = threading.Event()

        def burst() -> None:
            while not stop.wait(args.period_ms / 1e3):
                until = time.perf_counter() + args.burst_us / 1e6
                while time.perf_counter() < until:
                    pass
        thread = threading.Thread(target=burst, daemon=True)
        thread.start()
        try:
            return steps()
        finally:
            stop.set()
            thread.join()

    result = _alternate({"alone": steps, "beside": beside_python}, args.rounds)
    print(f"{rows}-row step, {args.threads} thread(s): alone {result['alone'] * 1e3:.1f} ms, beside a thread running "
          f"{args.burst_us:.0f} µs of Python every {args.period_ms:g} ms {result['beside'] * 1e3:.1f} ms")


def vision_loop(args) -> None:
    """A one-thread vision-tower loop (what ``beside`` runs in another process) until killed."""
    from bench.prefill_profile import load_vision, vision_case

    encode = vision_case(load_vision(args.model_dir, torch.bfloat16), 1, torch.bfloat16)
    while True:
        encode()


def beside(args, runner: TextModelRunner) -> None:
    prefill = _prompt(runner)
    alone = _alternate({"alone": lambda: prefill(PROMPT_TOKENS)}, args.rounds)["alone"]
    loop = subprocess.Popen([sys.executable, "-m", "bench.step_costs", args.model_dir, "vision-loop"])
    try:
        time.sleep(20)  # its model loaded and looping
        with_loop = _alternate({"beside": lambda: prefill(PROMPT_TOKENS)}, args.rounds)["beside"]
    finally:
        loop.kill()
        loop.wait()
    print(f"{PROMPT_TOKENS}-token prompt, {args.threads} thread(s): alone {alone:.3f} s, "
          f"beside a vision loop {with_loop:.3f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.step_costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("case", choices=["chunks", "gil", "beside", "vision-loop"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", default="247,64", help="chunks: chunk sizes to compare")
    parser.add_argument("--period-ms", type=float, default=8.0)
    parser.add_argument("--burst-us", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1 if args.case == "vision-loop" else args.threads)
    if args.case == "vision-loop":
        vision_loop(args)
        return
    runner = TextModelRunner.load(args.model_dir, dtype="bfloat16", decode=True)
    runner.prepare_decode_kernels()
    {"chunks": chunks, "gil": gil, "beside": beside}[args.case](args, runner)


if __name__ == "__main__":
    main()
