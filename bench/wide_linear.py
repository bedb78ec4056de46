"""Where the few-row kernel hands over to the widened float32 GEMM, on a CPU without AVX-512 BF16:
``python -m bench.wide_linear [--dtypes bfloat16,float32] [--rows 1,8,...] [--threads 2]``.

For each row count M, the time of one pass over three of qwen3.5-0.8b's products (a Gated
DeltaNet layer's merged in_proj 8256x1024, an MLP's merged gate_up 7168x1024, its down 1024x3584)
through ``torch.ops.epd_decode.linear`` (what ``kernels.DecodeLinear`` calls: the register kernel
up to ``kFewRows`` rows, the wide path above), ``linear_wide`` (the weight widened a block of
panels at a time for ATen's float32 GEMM, at any M) and ``F.linear`` over float32 copies of the
weights (MKL: what a float32 weight would cost, at twice the memory), and ``F.linear`` in the
dtype itself (ATen's own bfloat16 product: what ran before on such CPUs). Median of ``--repeats``
after two warm-ups; GFLOP/s over the three products. On an AVX-512 BF16 CPU ``linear`` is the
AVX-512 kernel at every M and the comparison says little about the threshold.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from bench.metrics import median_seconds
from epd import fused

SHAPES = [(8256, 1024), (7168, 1024), (1024, 3584)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,8,16,32,48,64,96,128,256")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-aten", action="store_true", help="skip F.linear in the dtype itself (slow on AVX2)")
    args = parser.parse_args(argv)
    if not fused.decode_ops():
        raise SystemExit("the decode kernels are not built on this machine")
    torch.set_num_threads(args.threads)
    ops = torch.ops.epd_decode
    results = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=gen).to(dtype) for n, k in SHAPES]
        packed = [ops.pack(w) for w in weights]
        wide32 = [w.float() for w in weights]
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, k, generator=gen).to(dtype) for _, k in SHAPES]
            flops = sum(2 * m * n * k for n, k in SHAPES)
            runs = {
                "linear": lambda: [ops.linear(x, p, n, None) for x, p, (n, _) in zip(xs, packed, SHAPES)],
                "linear_wide": lambda: [ops.linear_wide(x, p, n, None) for x, p, (n, _) in zip(xs, packed, SHAPES)],
                "f_linear_float32_weights": lambda: [F.linear(x.float(), w).to(dtype) for x, w in zip(xs, wide32)],
            }
            if not args.no_aten and dtype != torch.float32:
                runs[f"f_linear_{name}"] = lambda: [F.linear(x, w) for x, w in zip(xs, weights)]
            row = {"dtype": name, "rows": m}
            for label, fn in runs.items():
                seconds = median_seconds(fn, args.repeats, warmups=2)
                row[label] = {"ms": round(seconds * 1e3, 2), "gflops": round(flops / seconds / 1e9, 1)}
            results.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"threads": args.threads, "load_average": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
