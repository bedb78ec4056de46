"""One full-attention layer's decode-step attention over paged K/V, three ways, side by side.

``python -m bench.decode_attention [--threads N] [--contexts 64,300,1024] [--batch 16]`` prints a
table and one JSON line. For each dtype and context it times (median of 20 after 3 warm-up; CPU
time of this process, so the figures hold up on a shared machine better than wall time):

- ``gather+sdpa``: every slot's rows gathered through its block table (``index_select``), one
  batched ``scaled_dot_product_attention`` (what ``DecodeBatch`` did before its tables were
  placed as runs);
- ``views+sdpa``: each slot's rows one view of the pool (its blocks one run), one fused call per
  slot (``epd.kernels.decode_attention`` in float32);
- ``views+matmul``: the same views, two matrix products with a float32 softmax;
- ``padded+sdpa``: each slot's rows as one contiguous ``[1, kv_heads, T, dim]`` tensor (the layout
  of the per-request buffers before paging; the copy is made outside the timing), one fused call
  per slot: what reading the pool's interleaved heads costs against a contiguous layout;
- ``views+float32 sdpa`` (bfloat16 only): the views' rows converted to float32, then the fused
  float32 call (``epd.kernels.decode_attention`` in other dtypes).

Shapes are the ``qwen3.5-0.8b`` preset's (8 query heads, 2 KV heads, head dim 256).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM = 8, 2, 256


def _cpu_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def measure(dtype: torch.dtype, context: int, batch: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    span = context * 3  # each slot's run starts a third of the pool apart, as placement spreads them
    keys = torch.randn(batch * span, KV_HEADS, DIM, generator=generator).to(dtype)
    values = torch.randn(batch * span, KV_HEADS, DIM, generator=generator).to(dtype)
    query = torch.randn(batch, HEADS, 1, DIM, generator=generator).to(dtype)
    starts = [slot * span for slot in range(batch)]
    read = torch.cat([torch.arange(start, start + context) for start in starts])
    scale = DIM ** -0.5

    def gather_sdpa():
        k = keys.index_select(0, read).view(batch, context, KV_HEADS, DIM).transpose(1, 2)
        v = values.index_select(0, read).view(batch, context, KV_HEADS, DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(query, k, v, scale=scale, enable_gqa=True)

    def views_sdpa():
        return torch.cat([F.scaled_dot_product_attention(
            query[i : i + 1], keys[s : s + context].transpose(0, 1).unsqueeze(0),
            values[s : s + context].transpose(0, 1).unsqueeze(0), scale=scale, enable_gqa=True)
            for i, s in enumerate(starts)])

    padded_keys = [keys[s : s + context].transpose(0, 1).unsqueeze(0).contiguous() for s in starts]
    padded_values = [values[s : s + context].transpose(0, 1).unsqueeze(0).contiguous() for s in starts]

    def padded_sdpa():
        return torch.cat([F.scaled_dot_product_attention(query[i : i + 1], padded_keys[i], padded_values[i],
                                                         scale=scale, enable_gqa=True) for i in range(batch)])

    def views_matmul():
        outs = []
        for i, s in enumerate(starts):
            grouped = query[i].view(KV_HEADS, HEADS // KV_HEADS, DIM)
            scores = torch.matmul(grouped, keys[s : s + context].permute(1, 2, 0))
            probs = torch.softmax(scores.float().mul_(scale), dim=-1).to(dtype)
            outs.append(torch.matmul(probs, values[s : s + context].transpose(0, 1)).view(1, HEADS, 1, DIM))
        return torch.cat(outs)

    def views_upcast_sdpa():
        return torch.cat([F.scaled_dot_product_attention(
            query[i : i + 1].float(), keys[s : s + context].float().transpose(0, 1).unsqueeze(0),
            values[s : s + context].float().transpose(0, 1).unsqueeze(0), scale=scale, enable_gqa=True).to(dtype)
            for i, s in enumerate(starts)])

    with torch.inference_mode():
        reference = gather_sdpa().float()
        row = {"dtype": str(dtype).removeprefix("torch."), "context": context, "batch": batch}
        variants = [("gather+sdpa", gather_sdpa), ("views+sdpa", views_sdpa), ("padded+sdpa", padded_sdpa),
                    ("views+matmul", views_matmul)]
        if dtype != torch.float32:
            variants.append(("views+float32 sdpa", views_upcast_sdpa))
        for name, fn in variants:
            row[name] = _cpu_ms(fn)
            row[name + " max_abs_diff"] = float((fn().float() - reference).abs().max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="64,300,1024")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(dtype, int(c), args.batch) for dtype in (torch.float32, torch.bfloat16)
            for c in args.contexts.split(",")]
    print(f"{'dtype':9s} {'context':>7s} {'gather+sdpa':>12s} {'views+sdpa':>11s} {'padded+sdpa':>12s} "
          f"{'views+matmul':>13s} {'views+float32 sdpa':>19s}  (CPU ms per layer)")
    for r in rows:
        upcast = f"{r['views+float32 sdpa']:19.2f}" if "views+float32 sdpa" in r else f"{'-':>19s}"
        print(f"{r['dtype']:9s} {r['context']:7d} {r['gather+sdpa']:12.2f} {r['views+sdpa']:11.2f} "
              f"{r['padded+sdpa']:12.2f} {r['views+matmul']:13.2f} {upcast}")
    print("RESULT", json.dumps({"threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
