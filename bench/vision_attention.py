"""One vision attention layer of a 448x448 image in bfloat16, three ways, side by side.

``python -m bench.vision_attention [--threads 1] [--repeats 7]`` prints one line per way and one
JSON line: 784 patches, 12 heads of 64 (the 0.8b's tower), random bfloat16 query, key and value,
CPU time of this process (the fastest of ``--repeats`` after a warm-up; the ways interleaved):

- ``kernel``: ``epd_gdn_chunk.vision_attention`` (``epd/csrc/vision_attention.h``, AVX-512 BF16):
  what ``kernels_prefill.vision_attention`` runs for bfloat16 where it is built;
- ``float32 products``: the same function's other path, scores and weighted sum as float32
  products through oneDNN with torch's softmax between (what bfloat16 ran before the kernel);
- ``sdpa``: torch's fused ``scaled_dot_product_attention`` on the bfloat16 tensors.

Each way's largest difference from float32 attention on the same inputs is printed too.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from epd import kernels_prefill

HEADS, PATCHES, DIM = 12, 784, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    op = kernels_prefill._bf16_attention_op()
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, HEADS, PATCHES, DIM, generator=gen).bfloat16() for _ in range(3))
    scale = DIM ** -0.5
    exact = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), scale=scale)[0].transpose(0, 1)

    def float32_products():
        with kernels_prefill_bf16_off():
            return kernels_prefill.vision_attention(None, query, key, value, None, scale)[0][0]

    ways = {"float32 products": float32_products,
            "sdpa": lambda: F.scaled_dot_product_attention(query, key, value, scale=scale)[0].transpose(0, 1)}
    if op is not None:
        ways = {"kernel": lambda: op(query[0], key[0], value[0], scale), **ways}
    best = {name: float("inf") for name in ways}
    with torch.inference_mode():
        errors = {name: (fn().float() - exact).abs().max().item() for name, fn in ways.items()}
        for _ in range(args.repeats):
            for name, fn in ways.items():
                start = time.process_time()
                fn()
                best[name] = min(best[name], time.process_time() - start)
    for name in ways:
        print(f"{name}: {best[name] * 1e3:.1f} ms CPU a layer, largest difference from float32 {errors[name]:.2e}")
    print(json.dumps({"threads": args.threads, "cpu_ms": {k: round(v * 1e3, 2) for k, v in best.items()},
                      "max_abs_error": errors}))


class kernels_prefill_bf16_off:
    """Within it, ``kernels_prefill.vision_attention`` takes its float32-products path."""

    def __enter__(self):
        self.saved = kernels_prefill._bf16_attention_op
        kernels_prefill._bf16_attention_op = lambda: None

    def __exit__(self, *exc):
        kernels_prefill._bf16_attention_op = self.saved


if __name__ == "__main__":
    main()
