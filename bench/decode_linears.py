"""One decode step's linear layers through epd's few-row kernel, nothing else:
``python -m bench.decode_linears [--rows 8] [--threads 2] [--passes 12]``.

The products of one bfloat16 step of qwen3.5-0.8b at its shapes (18 Gated DeltaNet layers: merged
in_proj 8224x1024, out_proj 1024x2048; 6 full-attention layers: merged qkv 5120x1024, o_proj
1024x2048; every layer's merged MLP gate_up 7168x1024 and down 1024x3584; the LM head
248320x1024), each with a weight of its own (1.5 GB in all, so every product reads its weight from
memory as in a step), as ``torch.ops.epd_decode.linear``. Prints the median over the passes after
two warm-up ones of the layers' time and the LM head's, and where the CPU has AMX-INT8 or AVX-512 VNNI the LM
head's greedy screen too (``kernels.GreedyScreen.argmax``: the int8 copy and the exact product of
the columns left, after another pass of the layers, so its copy comes from memory as in a step).
To compare two versions of the kernel, run it from each tree (``git worktree add``): each builds
its own ``epd/csrc/decode_ops.cpp``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from epd import fused, kernels

GDN = [(8224, 1024), (1024, 2048)]
ATTENTION = [(5120, 1024), (1024, 2048)]
MLP = [(7168, 1024), (1024, 3584)]
SHAPES = 18 * (GDN + MLP) + 6 * (ATTENTION + MLP)
LM_HEAD = (248320, 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=12)
    args = parser.parse_args()
    if not fused.decode_ops():
        raise SystemExit("the decode kernel is not built (see the warning above)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    packed = [(torch.ops.epd_decode.pack(torch.randn(n, k).to(torch.bfloat16)), n, k) for n, k in SHAPES]
    head_weight = torch.randn(*LM_HEAD).to(torch.bfloat16)
    lm_head = kernels.DecodeLinear(head_weight)
    screen = kernels.GreedyScreen(lm_head, head_weight) if fused.decode_screens() else None
    xs = {k: torch.randn(args.rows, k).to(torch.bfloat16) for k in {k for _, k in [*SHAPES, LM_HEAD]}}
    layers, head, screened = [], [], []

    def run_layers() -> float:
        start = time.perf_counter()
        for weight, n, k in packed:
            torch.ops.epd_decode.linear(xs[k], weight, n, None)
        return time.perf_counter() - start

    with torch.inference_mode():
        for _ in range(args.passes + 2):
            layers.append(run_layers())
            start = time.perf_counter()
            lm_head(xs[LM_HEAD[1]])
            head.append(time.perf_counter() - start)
            if screen is not None:
                run_layers()
                start = time.perf_counter()
                screen.argmax(xs[LM_HEAD[1]])
                screened.append(time.perf_counter() - start)
    layer_ms, head_ms = statistics.median(layers[2:]) * 1e3, statistics.median(head[2:]) * 1e3
    line = (f"{args.rows} rows, {args.threads} thread(s): layers {layer_ms:.1f} ms, LM head {head_ms:.1f} ms, "
            f"total {layer_ms + head_ms:.1f} ms")
    if screen is not None:
        line += (f"; LM head through the greedy screen {statistics.median(screened[2:]) * 1e3:.1f} ms "
                 f"({screen.screened} of {screen.screened + screen.full} answered by it)")
    print(line)


if __name__ == "__main__":
    main()
