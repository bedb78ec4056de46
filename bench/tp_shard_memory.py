"""Anonymous memory (RssAnon) of rank 0 of 2 while and after it loads its shard: ``old`` loads the
whole model in the target dtype and cuts it; ``new`` is ``epd.tp_group.load_shard``
(the files opened in their stored dtype, each slice converted as it is cut). docs/BENCHMARKS.md.

    python -m bench.tp_shard_memory MODEL_DIR {float32,bfloat16} {old,new}
"""

from __future__ import annotations

import argparse
import gc
import threading
import time

import torch


def anon_gib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no RssAnon in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("dtype", choices=["float32", "bfloat16"])
    parser.add_argument("how", choices=["old", "new"])
    args = parser.parse_args()
    from epd.lm import TextModelRunner
    from epd.tensor_parallel import shard_runner
    from epd.tp_group import load_shard

    torch.set_num_threads(1)
    base, peak = anon_gib(), [0.0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], anon_gib())
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    if args.how == "old":
        runner = shard_runner(TextModelRunner.load(args.model, dtype=args.dtype, device="cpu", prepack=False), 0, 2)
    else:
        runner = load_shard(args.model, args.dtype, 0, 2, prepack=False)
    gc.collect()
    time.sleep(0.05)
    print(f"{args.how} {args.dtype}: anonymous memory after the load {anon_gib() - base:.2f} GiB, "
          f"at its peak {peak[0] - base:.2f} GiB ({runner.num_layers} layers)")


if __name__ == "__main__":
    main()
