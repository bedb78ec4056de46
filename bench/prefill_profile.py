"""``python -m bench.prefill_profile MODEL``: one thread's CPU time (``time.process_time``) for a
prefill forward and a vision forward, the workload of W1: a 247-token prompt alone and 8 of them
in one forward, one 448x448 image (784 patches) alone and 4 in one forward; best of ``--repeats``
after a warm-up, in each ``--dtypes``. ``--profile`` adds torch profiler tables (their times are
wall time: on a loaded machine read them as shares). Runs against whichever ``epd`` is on the
path (``PYTHONPATH=/path/to/other/tree`` measures another tree with the same script)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from epd import checkpoint, kernels, positions
from epd.lm import TextModelRunner
from epd.tensors import parse_dtype

PROMPT_TOKENS = 247  # W1's prompt: 196 image tokens, the template and 32 text tokens
IMAGE_PATCHES = (1, 28, 28)  # 448x448 at 16-pixel patches


def best_cpu_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: oneDNN primitives, allocator
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def prefill_case(runner: TextModelRunner, prompts: int):
    embeds = runner.embed(torch.randint(0, min(1000, runner.vocab_size), (PROMPT_TOKENS,)))
    pos, _ = positions.mrope_positions(PROMPT_TOKENS, [])
    return lambda: runner.forward_many([(embeds, pos, runner.new_state()) for _ in range(prompts)])


def vision_case(vision: torch.nn.Module, images: int, dtype: torch.dtype):
    t, h, w = IMAGE_PATCHES
    pixels = torch.randn(images * t * h * w, 3 * 2 * 16 * 16).to(dtype)
    grid = torch.tensor([IMAGE_PATCHES] * images)

    def run():
        with torch.inference_mode():
            vision(pixels, grid_thw=grid)
    return run


def load_vision(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    """As an encoder replica on a CPU builds it (prepacked linears; the oneDNN attention where
    this tree has it)."""
    vision = checkpoint.build_vision_model(model_dir, dtype=dtype, device="cpu")
    if kernels.can_prepack(torch.device("cpu"), dtype):
        kernels.prepack_linears(vision)
    try:
        from epd import kernels_prefill
    except ImportError:  # an older tree
        return vision
    kernels_prefill.use_for_vision(vision)
    return vision


def profile_table(fn, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--cases", default="prefill1,prefill8,vision1,vision4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cases = args.cases.split(",")
    results = []
    for name in args.dtypes.split(","):
        dtype = parse_dtype(name)
        runner = TextModelRunner.load(args.model_dir, dtype=name) if any(c.startswith("prefill") for c in cases) else None
        vision = load_vision(args.model_dir, dtype) if any(c.startswith("vision") for c in cases) else None
        for case in cases:
            count = int(case.removeprefix("prefill").removeprefix("vision"))
            fn = prefill_case(runner, count) if case.startswith("prefill") else vision_case(vision, count, dtype)
            seconds = best_cpu_seconds(fn, args.repeats)
            results.append({"case": case, "dtype": name, "cpu_s": round(seconds, 4)})
            print(json.dumps(results[-1]), flush=True)
            if args.profile:
                print(profile_table(fn), flush=True)
    print(json.dumps({"load_average": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
