"""One batched decode step in a loop, for profilers: ``python -m bench.decode_step_profile MODEL
[--dtype bfloat16] [--batch 16] [--context 200] [--steps 60] [--threads 1] [--table]
[--linears replica|decode|onednn] [--no-merge] [--no-fused-norms] [--no-paged-attention]
[--no-screen] [--no-plan]``.

The runner is loaded as a decode replica loads it (merged projections, the fused
residual add + RMSNorm, the full-attention step in two calls); ``--linears`` puts the linear
layers where a decode replica puts them on this CPU and dtype (``replica``, the default:
``lm.decode_linear_default``), on epd's few-row kernel (``decode``) or on oneDNN (``onednn``); the
other options turn each part off, to measure what each is worth. Each step takes every row's
greedy token as the served loop does for greedy rows (``TextModelRunner.decode_step_greedy``:
the int8 screen of the LM head where the CPU has AMX-INT8 or AVX-512 VNNI; ``--no-screen``: the whole head's
logits and ``greedy_rows``). A decode-only step runs as the runner's decode plan
(``lm._DecodePlan``: the layers as direct kernel calls) where it applies; ``--no-plan`` runs the
module path instead.

Prints the median wall and CPU time of a step (after 3 warm-up steps), and how long the process's
threads waited for a core a step on average (ready to run while other processes held the cores:
the per-thread ``run_delay`` of ``/proc``'s schedstat; "-" where the kernel does not keep it). On a
machine whose every core is in the thread team, each such wait also holds the rest of the team at
the next barrier (``bench.stack_tax``). Run it under
``py-spy record`` to see where a step goes by Python line, or with ``--table`` for torch's
profiler table by op (5 more steps). One thread by default: on a shared machine a single
thread's CPU time moves least with what else runs, and no OpenMP barrier waits are counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.decode_step import prefilled_batch
from epd import kernels, lm
from epd.lm import TextModelRunner


def runqueue_wait_s() -> float | None:
    """Seconds this process's threads have waited for a core (ready to run, another process on
    it), from the second field of each thread's ``/proc`` schedstat; None where there is none."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return total / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--table", action="store_true", help="print torch's profiler table for 5 more steps")
    parser.add_argument("--linears", choices=["replica", "decode", "onednn"], default="replica",
                        help="replica: what a decode replica picks here (lm.decode_linear_default); decode: epd's "
                             "few-row kernel; onednn: oneDNN's pre-packed GEMM")
    parser.add_argument("--no-merge", dest="merge", action="store_false")
    parser.add_argument("--no-fused-norms", dest="fused_norms", action="store_false")
    parser.add_argument("--no-paged-attention", dest="paged_attention", action="store_false")
    parser.add_argument("--no-screen", dest="screen", action="store_false")
    parser.add_argument("--no-plan", dest="plan", action="store_false")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = TextModelRunner.load(args.model, dtype=args.dtype, prepack=False)
    if args.linears == "replica":
        args.linears = "decode" if lm.decode_linear_default(runner.dtype) else "onednn"
    runner.prepack_linears(decode=True, merge=args.merge, few_rows=args.linears == "decode")
    if not args.fused_norms:
        runner._fused_norms = lambda hidden: False
    if not args.paged_attention:
        kernels.can_attend_paged = lambda query, pool: False
        lm._fused_attention = lambda attn, x, batch: False
    if not args.screen:
        runner.greedy_screen = None
    if not args.plan:
        runner.decode_plan = False
    batch, tokens = prefilled_batch(runner, args.batch, args.context)
    position = args.context
    walls, cpus = [], []
    waited = None
    for step in range(args.steps + 3):
        if step == 3:  # after the warm-up steps, as the medians
            waited = runqueue_wait_s()
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = runner.decode_step_greedy(batch, tokens, [position] * args.batch)[0].tolist()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        position += 1
    end = runqueue_wait_s()
    wait = f"{(end - waited) / args.steps * 1e3:.1f} ms" if waited is not None and end is not None else "-"
    print(f"{args.dtype}, batch {args.batch}, {args.context} tokens of context, {args.threads} thread(s), "
          f"linears {args.linears}, merge {args.merge}, fused norms {args.fused_norms}, "
          f"paged attention {args.paged_attention}, screen {runner.greedy_screen is not None}, "
          f"plan {isinstance(runner.decode_plan, lm._DecodePlan)}: "
          f"step median {statistics.median(walls[3:]) * 1e3:.1f} ms wall, {statistics.median(cpus[3:]) * 1e3:.1f} ms CPU, "
          f"waited for a core {wait} a step")
    if args.table:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                tokens = runner.decode_step_greedy(batch, tokens, [position] * args.batch)[0].tolist()
                position += 1
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
