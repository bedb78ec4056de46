"""``python -m bench.gdn_chunk``: one Gated DeltaNet layer's chunked delta rule for a prefill chunk
(the 0.8b's shapes: 16 key and value heads of 128, W1's 247-token prompt), the torch path
(``epd.kernels``) against the fused C++ rule (``epd.kernels_prefill``), alternating round by round
in one process; CPU time (``time.process_time``) per call, best of ``--rounds``, in each dtype.
q/k/v are strided views of one conv-output row, as the runner passes them."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from epd import kernels, kernels_prefill


def case(length: int, heads: int, dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    mixed = torch.randn(1, length, 3 * heads * dim, generator=gen).to(dtype)
    query, key, value = (t.reshape(1, length, heads, dim) for t in torch.split(mixed, heads * dim, dim=-1))
    g = -torch.rand(1, length, heads, generator=gen) * 0.5
    beta = torch.rand(1, length, heads, generator=gen).to(dtype)
    return query, key, value, g, beta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=247)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=5, help="calls timed together in a round")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if kernels_prefill.gdn_chunk_op() is None:
        raise SystemExit("the fused rule is not available here (EPD_PREFILL_KERNELS=0 or no build)")
    rules = {"torch": kernels.chunk_gated_delta_rule, "fused": kernels_prefill.chunk_gated_delta_rule}
    report = {"length": args.length, "heads": args.heads, "dim": args.dim, "threads": args.threads,
              "load_average_before": os.getloadavg(), "ms": {}}
    for name in args.dtypes.split(","):
        inputs = case(args.length, args.heads, args.dim, getattr(torch, name))
        best = dict.fromkeys(rules, float("inf"))
        with torch.inference_mode():
            for _ in range(args.rounds):
                for side, rule in rules.items():
                    rule(*inputs, chunk_size=32, output_final_state=True, use_qk_l2norm_in_kernel=True)  # warm-up
                    start = time.process_time()
                    for _ in range(args.calls):
                        rule(*inputs, chunk_size=32, output_final_state=True, use_qk_l2norm_in_kernel=True)
                    best[side] = min(best[side], (time.process_time() - start) / args.calls * 1e3)
        report["ms"][name] = {side: round(ms, 3) for side, ms in best.items()}
        report["ms"][name]["ratio"] = round(best["fused"] / best["torch"], 3)
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
