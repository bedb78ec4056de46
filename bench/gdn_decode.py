"""``python -m bench.gdn_decode [--batch-sizes 1,8,16] [--dtype bfloat16] [--threads 1]``: one Gated
DeltaNet layer's decode step (``epd.lm._linear_attention_step``: input projections, conv, the
recurrent state, gated norm, out_proj) with the fused C++ kernel (``epd.fused``) and with the torch
path, alternating call by call on the same inputs.

The layer has the 0.8b's shapes (hidden 1024, 16 key and value heads of 128) and random weights;
it cycles through ``--layers`` copies of the batch's state (18 by default, the 0.8b's Gated
DeltaNet layers) so that each call reads its state from memory, not from the cache, as in a
real step. Prints the median CPU time per call (one thread by default: on a shared machine a
single thread's CPU time moves least with what else runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qm
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from epd import fused, kernels, lm


def make_layer(dtype: torch.dtype, hidden: int = 1024, heads: int = 16, dim: int = 128, seed: int = 0):
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(hidden_size=hidden, linear_num_key_heads=heads, linear_num_value_heads=heads,
                               linear_key_head_dim=dim, linear_value_head_dim=dim, linear_conv_kernel_dim=4,
                               num_hidden_layers=1, layer_types=["linear_attention"])
    gdn = qm.Qwen3_5GatedDeltaNet(config, 0)
    with torch.no_grad():
        for param in gdn.parameters():
            param.copy_(torch.randn_like(param) * 0.05)
    gdn = gdn.to(dtype).eval()
    if kernels.can_prepack(torch.device("cpu"), dtype):
        kernels.prepack_linears(gdn)
    return gdn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gdn = make_layer(dtype)
    if fused.ops() is None:
        print("the fused kernel is not available here (see the warning above)")
        return 1
    print(f"{args.dtype}, {args.threads} thread(s), median CPU ms per layer call over {args.calls} calls:")
    saved = os.environ.get(fused.ENV)
    try:
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            _time_batch(gdn, batch, dtype, args.layers, args.calls)
    finally:
        if saved is None:
            os.environ.pop(fused.ENV, None)
        else:
            os.environ[fused.ENV] = saved
    return 0


def _time_batch(gdn, batch: int, dtype: torch.dtype, layers: int, calls: int) -> None:
    """Median CPU time of a layer call, torch path and fused, alternating; printed."""
    conv = [torch.randn(batch, 4, gdn.conv_dim).to(dtype) for _ in range(layers)]
    states = [torch.randn(batch, 16, 128, 128) * 0.05 for _ in range(layers)]
    x = torch.randn(batch, 1, gdn.hidden_size).to(dtype)
    times = {"torch": [], "fused": []}
    with torch.inference_mode():
        for call in range(calls + 2):
            layer = call % layers
            buffers = types.SimpleNamespace(conv={0: conv[layer]}, recurrent={0: states[layer]})
            for name, flag in (("torch", "0"), ("fused", "1")):
                os.environ[fused.ENV] = flag
                start = time.process_time()
                lm._linear_attention_step(gdn, x, buffers, 0)
                if call >= 2:
                    times[name].append(time.process_time() - start)
    t, f = (statistics.median(times[k]) * 1e3 for k in ("torch", "fused"))
    print(f"  batch {batch:3d}: torch path {t:7.2f} ms, fused {f:7.2f} ms, fused / torch {f / t:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
