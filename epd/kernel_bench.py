"""``python -m epd.kernel_bench``: epd's Gated DeltaNet / conv kernels against transformers'
reference functions, side by side in one process on one checkpoint.

Both kernel sets run inside the same ``TextModelRunner`` (the reference set is swapped in for
``epd.lm``'s ``kernels`` module only while it is timed), alternating round by round so that a
noisy neighbour on shared cores hurts both alike. For each set it times a prefill forward of
``--prompt-tokens`` tokens and one decode step at each ``--batch-sizes``, and reports the time
spent inside the kernels themselves. The reference decode step is what transformers' own model
runs per token: ``torch_recurrent_gated_delta_rule`` and ``causal_conv1d_update``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from types import SimpleNamespace

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qm

from epd import kernels, lm, positions
from epd.decode_step import machine_info


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
    return qm.causal_conv1d_update(x.unsqueeze(-1), window, weight, bias, activation)[..., 0]


REFERENCE = SimpleNamespace(chunk_gated_delta_rule=_ref_chunk, recurrent_gated_delta_step=_ref_step,
                            causal_conv1d=_ref_conv, causal_conv1d_step=_ref_conv_step)
KERNEL_SETS = {"transformers_reference": REFERENCE, "epd": kernels}
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

    saved = lm.kernels
    lm.kernels = SimpleNamespace(**{name: timed(getattr(module, name)) for name in _NAMES})
    try:
        yield
    finally:
        lm.kernels = saved


def _prefill_once(runner, ids, pos) -> float:
    start = time.perf_counter()
    runner.forward(runner.embed(ids), pos, runner.new_state())
    return time.perf_counter() - start


def _decode_once(runner, batch, tokens) -> float:
    start = time.perf_counter()
    runner.decode_step(batch, tokens, list(batch.lengths))  # a slot's next position is its length
    return time.perf_counter() - start


def run(model_dir: str, prompt_tokens: int, batch_sizes: list[int], rounds: int, dtype: str) -> dict:
    runner = lm.TextModelRunner.load(model_dir, dtype=dtype)
    vocab = runner.lm_head_weight.shape[0]
    ids = torch.randint(0, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    pos, _ = positions.mrope_positions(prompt_tokens, [])
    state = runner.new_state()
    runner.forward(runner.embed(ids), pos, state)  # warm-up, and the context every decode slot starts from
    results = {name: {"prefill_s": [], "prefill_kernel_s": [], "decode": {b: [] for b in batch_sizes},
                      "decode_kernel": {b: [] for b in batch_sizes}} for name in KERNEL_SETS}
    for round_ in range(rounds + 1):  # round 0 warms each set up (first-call costs) and is dropped
        for name, module in KERNEL_SETS.items():
            row, timer = results[name], [0.0]
            with kernel_set(module, timer):
                row["prefill_s"].append(_prefill_once(runner, ids, pos))
                row["prefill_kernel_s"].append(timer[0])
                for size in batch_sizes:
                    batch = runner.new_batch()
                    for _ in range(size):
                        batch.add(state.clone())
                    _decode_once(runner, batch, [1] * size)  # warm-up step
                    timer[0] = 0.0
                    row["decode"][size].append(_decode_once(runner, batch, [2] * size))
                    row["decode_kernel"][size].append(timer[0])
            if round_ == 0:
                row["prefill_s"].clear(), row["prefill_kernel_s"].clear()
                for size in batch_sizes:
                    row["decode"][size].clear(), row["decode_kernel"][size].clear()
    return _report(model_dir, dtype, prompt_tokens, batch_sizes, rounds, results)


def _report(model_dir, dtype, prompt_tokens, batch_sizes, rounds, results) -> dict:
    med = statistics.median
    sets = {}
    for name, row in results.items():
        sets[name] = {
            "prefill_s": med(row["prefill_s"]), "prefill_min_s": min(row["prefill_s"]),
            "prefill_kernel_s": med(row["prefill_kernel_s"]),
            "decode_step_s": {str(b): med(row["decode"][b]) for b in batch_sizes},
            "decode_kernel_s": {str(b): med(row["decode_kernel"][b]) for b in batch_sizes},
        }
    ref, ours = sets["transformers_reference"], sets["epd"]
    return {
        "model": model_dir, "dtype": dtype, "prompt_tokens": prompt_tokens, "rounds": rounds,
        "torch_threads": torch.get_num_threads(), "sets": sets,
        "speedup": {
            "prefill": ref["prefill_s"] / ours["prefill_s"],
            "prefill_kernels": ref["prefill_kernel_s"] / ours["prefill_kernel_s"],
            **{f"decode_b{b}": ref["decode_step_s"][str(b)] / ours["decode_step_s"][str(b)] for b in batch_sizes},
        },
        "machine": machine_info(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _print(report: dict) -> None:
    print(f"{'kernels':<24} {'prefill s':>10} {'in kernels':>11}" +
          "".join(f" {'b' + b + ' step ms':>13} {'in kernels':>11}" for b in report["sets"]["epd"]["decode_step_s"]))
    for name, row in report["sets"].items():
        line = f"{name:<24} {row['prefill_s']:>10.3f} {row['prefill_kernel_s']:>11.3f}"
        for b, step in row["decode_step_s"].items():
            line += f" {step * 1e3:>13.1f} {row['decode_kernel_s'][b] * 1e3:>11.1f}"
        print(line)
    print("speedup (reference / epd): " + ", ".join(f"{k} {v:.2f}x" for k, v in report["speedup"].items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epd.kernel_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=240)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = run(args.model, args.prompt_tokens, [int(b) for b in args.batch_sizes.split(",")], args.rounds,
                 args.dtype)
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
