"""``python -m bench.kernel_bench``: the language model's prefill forward and decode step with
transformers' reference Gated DeltaNet / conv functions against epd's kernels, and with ATen's
default GEMM (MKL on a CPU) against oneDNN pre-packed linear layers, side by side in one process.

Configurations, each timed on the same checkpoint and inputs, alternating round by round so that
a noisy neighbour on shared cores hurts all alike (round 0 warms each one up and is dropped):

- ``reference``: transformers' ``torch_chunk_gated_delta_rule`` / ``causal_conv1d_fn`` for
  prompts and, per decode token, ``torch_recurrent_gated_delta_rule`` / ``causal_conv1d_update``
  (what transformers' own model runs), with ``F.linear``;
- ``epd_kernels``: ``epd.kernels`` with ``F.linear``;
- ``epd_kernels_packed``: ``epd.kernels`` with every linear layer and the LM head pre-packed for
  oneDNN (what ``TextModelRunner.load`` gives on a CPU); absent where packing does not apply.

The reference kernels are swapped in for ``epd.lm``'s ``kernels`` module only while timed, with
the fused C++ decode step (``epd.fused``) and chunked rule (``epd.kernels_prefill``) off, so every
configuration runs its torch path
(``bench.decode_step_profile`` and ``epd bench decode-step`` time the fused step). Each
row reports the forward's time and the part of it spent inside the GDN/conv kernels.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from types import SimpleNamespace

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qm

from bench.decode_step import machine_info
from decode_svc.batch import DecodeBatch
from epd import fused, kernels, kernels_prefill, lm, positions


def _ref_chunk(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False):
    # transformers' rule with its own chunk size, whatever the runner asks of epd's
    return qm.torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                           output_final_state=output_final_state,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def _ref_step(query, key, value, g, beta, state, use_qk_l2norm_in_kernel=True):
    out, new_state = qm.torch_recurrent_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=state,
                                                         output_final_state=True,
                                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    state.copy_(new_state)  # epd's contract: the state is updated in place
    return out


def _ref_conv(x, weight, bias, activation, window=None):
    # what epd.lm did before epd.kernels: transformers' causal_conv1d_fn over [window, chunk]
    kernel = weight.shape[1]
    full = x if window is None else torch.cat([window, x], dim=-1)
    new_window = torch.nn.functional.pad(full, (max(0, kernel - full.shape[-1]), 0))[..., -kernel:].contiguous()
    out = qm.causal_conv1d_fn(full, weight, bias, activation=activation)[..., -x.shape[-1]:]
    return out, new_window


def _ref_conv_step(x, window, weight, bias, activation):
    # epd's window is time-major [B, K, C]; transformers' update shifts a [B, C, K] view of it in place
    return qm.causal_conv1d_update(x.unsqueeze(-1), window.transpose(1, 2), weight, bias, activation)[..., 0]


REFERENCE = SimpleNamespace(chunk_gated_delta_rule=_ref_chunk, recurrent_gated_delta_step=_ref_step,
                            causal_conv1d=_ref_conv, causal_conv1d_step=_ref_conv_step)
_NAMES = ("chunk_gated_delta_rule", "recurrent_gated_delta_step", "causal_conv1d", "causal_conv1d_step")


@contextmanager
def kernel_set(module, timer: list[float]):
    """Make the runner call ``module``'s kernels, adding the seconds spent in them to timer[0]."""

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timer[0] += time.perf_counter() - start
        return call

    saved, saved_env, saved_rule = lm.kernels, os.environ.get(fused.ENV), kernels_prefill.gdn_chunk_op
    # the timed kernels in place of epd.kernels' own; its other functions as they are
    public = {name: getattr(kernels, name) for name in dir(kernels) if not name.startswith("_")}
    lm.kernels = SimpleNamespace(**{**public, **{name: timed(getattr(module, name)) for name in _NAMES}})
    os.environ[fused.ENV] = "0"  # these are the torch paths' configurations: not the fused C++ step
    kernels_prefill.gdn_chunk_op = lambda: None  # nor the fused chunked rule (bench.gdn_chunk times it)
    try:
        yield
    finally:
        lm.kernels, kernels_prefill.gdn_chunk_op = saved, saved_rule
        if saved_env is None:
            os.environ.pop(fused.ENV, None)
        else:
            os.environ[fused.ENV] = saved_env


def _prefill_once(runner, ids, pos) -> float:
    start = time.perf_counter()
    runner.forward(runner.embed(ids), pos, runner.new_state())
    return time.perf_counter() - start


def _decode_once(runner, batch, tokens) -> float:
    start = time.perf_counter()
    runner.decode_step(batch, tokens, list(batch.lengths))  # a slot's next position is its length
    return time.perf_counter() - start


def run(model_dir: str, prompt_tokens: int, batch_sizes: list[int], rounds: int, dtype: str) -> dict:
    dense = lm.TextModelRunner.load(model_dir, dtype=dtype, prepack=False)
    configs = {"reference": (dense, REFERENCE), "epd_kernels": (dense, kernels)}
    if kernels.can_prepack(dense.device, dense.dtype):
        configs["epd_kernels_packed"] = (lm.TextModelRunner.load(model_dir, dtype=dtype), kernels)
    vocab = dense.lm_head_weight.shape[0]
    ids = torch.randint(0, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    pos, _ = positions.mrope_positions(prompt_tokens, [])
    context = dense.new_state()  # every decode slot starts from this prompt's state
    dense.forward(dense.embed(ids), pos, context)
    samples = {name: [] for name in configs}
    for round_ in range(rounds + 1):
        for name, (runner, module) in configs.items():
            sample = _measure(runner, module, ids, pos, context, batch_sizes)
            if round_:
                samples[name].append(sample)
    return _report(model_dir, dtype, prompt_tokens, batch_sizes, rounds, samples)


def _measure(runner, module, ids, pos, context, batch_sizes) -> dict:
    """One prefill forward and one decode step per batch size; seconds, total and in kernels."""
    timer = [0.0]
    sample = {}
    with kernel_set(module, timer):
        sample["prefill_s"] = _prefill_once(runner, ids, pos)
        sample["prefill_kernel_s"] = timer[0]
        for size in batch_sizes:
            batch = DecodeBatch(runner)
            for _ in range(size):
                batch.add(context.clone())
            _decode_once(runner, batch, [1] * size)  # the step's own first-call costs
            timer[0] = 0.0
            sample[f"decode_b{size}_s"] = _decode_once(runner, batch, [2] * size)
            sample[f"decode_b{size}_kernel_s"] = timer[0]
    return sample


def _report(model_dir, dtype, prompt_tokens, batch_sizes, rounds, samples) -> dict:
    rows = {name: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
            for name, runs in samples.items()}
    fastest = {name: {key: min(s[key] for s in runs) for key in runs[0]} for name, runs in samples.items()}
    keys = ["prefill_s"] + [f"decode_b{b}_s" for b in batch_sizes]
    base = rows["reference"]
    ratios = {name: {key: base[key] / row[key] for key in keys} for name, row in rows.items() if name != "reference"}
    return {
        "model": model_dir, "dtype": dtype, "prompt_tokens": prompt_tokens, "rounds": rounds,
        "statistic": "median over rounds", "torch_threads": torch.get_num_threads(), "configs": rows,
        "configs_min": fastest, "load_average": os.getloadavg(),
        "speedup_over_reference": ratios,
        "machine": machine_info(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _print(report: dict) -> None:
    rows = report["configs"]
    keys = [key for key in next(iter(rows.values())) if not key.endswith("kernel_s")]
    print(f"{'config':<20}" + "".join(f" {key[:-2] + ' ms':>16} {'in kernels':>11}" for key in keys))
    for name, row in rows.items():
        print(f"{name:<20}" + "".join(f" {row[key] * 1e3:>16.1f} {row[key[:-2] + '_kernel_s'] * 1e3:>11.1f}"
                                      for key in keys))
    for name, ratios in report["speedup_over_reference"].items():
        print(f"{name} vs reference: " + ", ".join(f"{key[:-2]} {value:.2f}x" for key, value in ratios.items()))


def run_micro(model_dir: str, prompt_tokens: int, chunk_sizes: list[int], rounds: int) -> dict:
    """The GDN kernels alone at the checkpoint's layer shapes, on random inputs: transformers'
    chunked rule (chunk 64) against epd's at each of ``chunk_sizes``, and the chunk's causal
    conv. Fastest of ``rounds`` alternating calls, in milliseconds."""
    from epd.checkpoint import read_config

    cfg = read_config(model_dir).text_config
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    k_dim, v_dim, kernel = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    t = prompt_tokens
    q, k, v = rand(1, t, k_heads, k_dim), rand(1, t, k_heads, k_dim), rand(1, t, v_heads, v_dim)
    g, beta = -torch.rand(1, t, v_heads, generator=gen), torch.rand(1, t, v_heads, generator=gen)
    channels = 2 * k_heads * k_dim + v_heads * v_dim
    x, weight, window = rand(1, t, channels).transpose(1, 2), rand(channels, kernel), rand(1, channels, kernel)
    calls = {"gdn_reference": lambda: _ref_chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                 output_final_state=True)}
    for size in chunk_sizes:
        calls[f"gdn_epd_chunk{size}"] = functools.partial(
            kernels.chunk_gated_delta_rule, q, k, v, g, beta, chunk_size=size, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
    calls["conv_reference"] = lambda: _ref_conv(x, weight, None, "silu", window)
    calls["conv_epd"] = lambda: kernels.causal_conv1d(x, weight, None, "silu", window)
    best = dict.fromkeys(calls, float("inf"))
    with torch.inference_mode():
        for _ in range(rounds + 1):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - start)
    return {"model": model_dir, "prompt_tokens": t, "statistic": "fastest of rounds",
            "ms": {name: s * 1e3 for name, s in best.items()}, "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(), "machine": machine_info(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def run_gemm(model_dir: str, rows: list[int], rounds: int, dtype: str) -> dict:
    """Every linear layer of the language model once (a forward's GEMMs: projections, MLPs, the
    LM head) at each row count of ``rows``: ATen's ``F.linear`` against ``PackedLinear``. The
    weights are the checkpoint's, so each pass streams them from memory as a forward does.
    Fastest of ``rounds`` alternating passes, in milliseconds, with the FLOP rate."""
    dense = lm.TextModelRunner.load(model_dir, dtype=dtype, prepack=False)
    weights = [m.weight for m in dense.model.modules() if type(m) is torch.nn.Linear]
    weights.append(dense.lm_head_weight)
    packed = [kernels.PackedLinear(w) for w in weights]
    params = sum(w.numel() for w in weights)
    report = {"model": model_dir, "dtype": dtype, "linear_params": params, "statistic": "fastest of rounds",
              "rows": {}, "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
              "machine": machine_info(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    passes = {"f_linear": [functools.partial(torch.nn.functional.linear, weight=w) for w in weights],
              "packed": packed}
    with torch.inference_mode():
        for count in rows:
            inputs = {w.shape[1]: torch.randn(count, w.shape[1], dtype=dense.dtype) for w in weights}
            best = dict.fromkeys(passes, float("inf"))
            for _ in range(rounds + 1):
                for name, layers in passes.items():
                    start = time.perf_counter()
                    for layer, w in zip(layers, weights):
                        layer(inputs[w.shape[1]])
                    best[name] = min(best[name], time.perf_counter() - start)
            report["rows"][str(count)] = {name: {"ms": t * 1e3, "gflop_s": 2 * count * params / t / 1e9}
                                          for name, t in best.items()}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=240)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json")
    parser.add_argument("--micro", metavar="CHUNK_SIZES",
                        help="time the GDN kernels alone at these chunk sizes (e.g. 16,32,64) instead")
    parser.add_argument("--gemm", metavar="ROWS",
                        help="time every linear layer once at these row counts (e.g. 1,16,240) instead")
    args = parser.parse_args(argv)
    if args.gemm:
        report = run_gemm(args.model, [int(r) for r in args.gemm.split(",")], args.rounds, args.dtype)
        for count, row in report["rows"].items():
            print(f"M={count:>4} " + "  ".join(f"{name} {v['ms']:.1f} ms ({v['gflop_s']:.0f} GFLOP/s)"
                                              for name, v in row.items()))
    elif args.micro:
        report = run_micro(args.model, args.prompt_tokens, [int(c) for c in args.micro.split(",")],
                           max(args.rounds, 10))
        print("  ".join(f"{name} {ms:.2f} ms" for name, ms in report["ms"].items()))
    else:
        report = run(args.model, args.prompt_tokens, [int(b) for b in args.batch_sizes.split(",")],
                     args.rounds, args.dtype)
        _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
