"""``python -m bench.prefill_ab --before /path/to/other/tree MODEL``: this tree's prefill and vision
forwards against another tree's, in one process, alternating round by round, one thread's CPU
time (``time.process_time``) of each. The other tree's ``epd/kernels.py`` is loaded from its path
and the runner switches between the two modules (the language model's weights are shared; the
before side also runs without this tree's fused chunked rule, ``kernels_prefill.gdn_chunk_op``); the
vision tower is built twice, once with pre-packed linears only (or, ``--vision-before
use-for-vision-no-gelu``, with this tree's ``use_for_vision`` but the MLPs' GELU unfused) and once
with ``kernels_prefill.use_for_vision``. Alternating in one process is what makes a ratio usable
on a shared machine: separate processes drift by 10-30% under load."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import torch

from epd import checkpoint, kernels, kernels_prefill, lm, positions
from epd.lm import TextModelRunner

PROMPT_TOKENS = 247  # W1's prompt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--before", required=True, help="the other tree (its epd/kernels.py is loaded)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=1, help="247-token prompts in one forward")
    parser.add_argument("--images", type=int, default=1, help="448x448 images in one vision forward")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--vision-before", choices=["prepacked", "use-for-vision-no-gelu"], default="prepacked",
                        help="the before side's vision tower: pre-packed linears only, or this tree's "
                             "use_for_vision without the MLPs' fused GELU (to time that alone)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("before_kernels", os.path.join(args.before, "epd", "kernels.py"))
    before_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before_kernels)
    after_kernels, dtype = lm.kernels, getattr(torch, args.dtype)
    runner = TextModelRunner.load(args.model_dir, dtype=args.dtype)
    embeds = runner.embed(torch.randint(0, min(1000, runner.vocab_size), (PROMPT_TOKENS,)))
    pos, _ = positions.mrope_positions(PROMPT_TOKENS, [])

    def prefill():
        runner.forward_many([(embeds, pos, runner.new_state()) for _ in range(args.prompts)])

    towers = {}
    for side in ("before", "after"):
        towers[side] = checkpoint.build_vision_model(args.model_dir, dtype=dtype)
        kernels.prepack_linears(towers[side])
    if args.vision_before == "use-for-vision-no-gelu":
        fuse = kernels_prefill.fuse_mlp_activations
        kernels_prefill.fuse_mlp_activations = lambda vision: 0
        kernels_prefill.use_for_vision(towers["before"])
        kernels_prefill.fuse_mlp_activations = fuse
    kernels_prefill.use_for_vision(towers["after"])
    pixels = torch.randn(784 * args.images, 1536).to(dtype)
    grid = torch.tensor([[1, 28, 28]] * args.images)

    def vision(tower):
        def run():
            with torch.inference_mode():
                tower(pixels, grid_thw=grid)
        return run

    cases = {("prefill", "before"): (before_kernels, prefill), ("prefill", "after"): (after_kernels, prefill),
             ("vision", "before"): (after_kernels, vision(towers["before"])),
             ("vision", "after"): (after_kernels, vision(towers["after"]))}
    seconds = {key: [] for key in cases}
    load_before = os.getloadavg()
    fused_rule = kernels_prefill.gdn_chunk_op
    for _ in range(args.rounds):
        for key, (module, fn) in cases.items():
            lm.kernels = module
            # the before side runs as the other tree: without this tree's fused chunk rule
            kernels_prefill.gdn_chunk_op = (lambda: None) if key[1] == "before" else fused_rule
            fn()  # warm-up: oneDNN primitives for this side's shapes
            start = time.process_time()
            fn()
            seconds[key].append(round(time.process_time() - start, 4))
    lm.kernels, kernels_prefill.gdn_chunk_op = after_kernels, fused_rule
    report = {"dtype": args.dtype, "prompts": args.prompts, "images": args.images, "load_average_before": load_before,
              "load_average_after": os.getloadavg()}
    for case in ("prefill", "vision"):
        before, after = seconds[(case, "before")], seconds[(case, "after")]
        report[case] = {"before_s": before, "after_s": after, "ratio_of_bests": round(min(after) / min(before), 3)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
