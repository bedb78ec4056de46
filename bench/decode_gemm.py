"""Decode's linear layers, one shape at a time: ``python -m bench.decode_gemm [--dtype bfloat16]
[--rows 1,2,4,8,16] [--threads 1] [--shapes all|lm_head|...]``.

For each of qwen3.5-0.8b's projection shapes and each row count M, the median time of
``x [M, K] @ W^T`` through oneDNN with a pre-packed weight (``kernels.PackedLinear``, what the
runner used before) and through epd's decode kernel (``kernels.DecodeLinear``), as GB/s of weight
read, beside a plain stream (a sum over a 512 MiB tensor: what one thread reads when it does
nothing else). Weights are cycled through copies of >= 256 MiB in all, so every product reads its
weight from memory as in a decode step (one shape's weight alone would sit in the 32 MiB L3).
Calls alternate between the two kernels, so both see the same machine. With one thread the times
are the process's CPU time (``time.process_time``), the figure that moves least with neighbours.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from epd import fused, kernels

# (name, out_features, in_features) of qwen3.5-0.8b; the merged ones are what the runner multiplies
SHAPES = [
    ("gdn in_proj_qkv", 6144, 1024), ("gdn in_proj_z", 2048, 1024), ("gdn in_proj_b/a", 16, 1024),
    ("gdn in_proj_qkvzba (merged)", 8224, 1024), ("gdn out_proj", 1024, 2048),
    ("attn q_proj", 4096, 1024), ("attn k/v_proj", 512, 1024), ("attn qkv (merged)", 5120, 1024),
    ("attn o_proj", 1024, 2048), ("mlp gate/up", 3584, 1024), ("mlp gate_up (merged)", 7168, 1024),
    ("mlp down", 1024, 3584), ("lm_head", 248320, 1024),
]
_CYCLE_BYTES = 256 * 2**20


def stream_bandwidth(clock, repeats: int = 5) -> float:
    """Bytes per second a sum over 512 MiB of float32 reads (median of ``repeats``)."""
    data = torch.ones(128 * 2**20)
    data.sum()
    times = []
    for _ in range(repeats):
        start = clock()
        data.sum()
        times.append(clock() - start)
    return data.numel() * 4 / statistics.median(times)


def measure(out_features: int, in_features: int, rows: list[int], dtype: torch.dtype, repeats: int, clock):
    """{M: (oneDNN seconds, decode-kernel seconds)} for one shape, medians over ``repeats`` calls
    that cycle through enough copies of the weight to miss the caches."""
    weight = torch.randn(out_features, in_features).to(dtype)
    copies = max(1, -(-_CYCLE_BYTES // (weight.numel() * weight.element_size())))
    onednn = [kernels.PackedLinear(weight.clone()) for _ in range(copies)]
    ours = [kernels.DecodeLinear(weight.clone()) for _ in range(copies)]
    results = {}
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, in_features).to(dtype)
            times = {0: [], 1: []}
            for i in range(repeats * copies):
                for side, layers in ((0, onednn), (1, ours)):
                    layer = layers[i % copies]
                    start = clock()
                    layer(x)
                    times[side].append(clock() - start)
            results[m] = tuple(statistics.median(times[side][copies:]) for side in (0, 1))
    return weight.numel() * weight.element_size(), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default="all", help="comma-separated substrings of the shape names")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    if not fused.decode_ops():
        raise SystemExit("the decode kernel is not built (see the warning above)")
    # one thread: CPU time (what moves least with the neighbours on a shared machine); more: wall
    clock = time.process_time if args.threads == 1 else time.perf_counter
    stream = stream_bandwidth(clock)
    print(f"{args.dtype}, {args.threads} thread(s); plain stream (sum of 512 MiB): {stream / 1e9:.1f} GB/s")
    print(f"{'shape':30s} {'N x K':>13s} {'M':>3s} {'oneDNN ms':>9s} {'GB/s':>6s} {'epd ms':>8s} {'GB/s':>6s} {'ratio':>6s}")
    wanted = None if args.shapes == "all" else args.shapes.split(",")
    for name, n, k in SHAPES:
        if wanted and not any(w in name for w in wanted):
            continue
        nbytes, results = measure(n, k, rows, dtype, args.repeats, clock)
        for m, (theirs, ours) in results.items():
            print(f"{name:30s} {f'{n}x{k}':>13s} {m:3d} {theirs * 1e3:9.3f} {nbytes / theirs / 1e9:6.1f} "
                  f"{ours * 1e3:8.3f} {nbytes / ours / 1e9:6.1f} {ours / theirs:6.2f}")


if __name__ == "__main__":
    main()
