"""``python -m bench.lm_ab MODEL [DTYPE]``: another tree's ``epd/lm.py`` (``LM_BEFORE``, default /work/main)
against this one, sharing the weights: a batch-8 decode step and a 247-token prefill forward, one
thread's CPU time, alternating round by round (``ROUNDS``, default 6). What a refactor of the runner
costs the separate prefill and decode forwards."""
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

from decode_svc.batch import DecodeBatch
from epd import positions
from epd.lm import TextModelRunner


def main() -> None:
    spec = importlib.util.spec_from_file_location("lm_main", os.path.join(os.environ.get("LM_BEFORE", "/work/main"), "epd", "lm.py"))
    lm_main = importlib.util.module_from_spec(spec); sys.modules["lm_main"] = lm_main; spec.loader.exec_module(lm_main)
    torch.set_num_threads(1)
    new = TextModelRunner.load(sys.argv[1], dtype=sys.argv[2] if len(sys.argv) > 2 else "bfloat16")
    new.prepare_decode_kernels()
    old = lm_main.TextModelRunner(model=new.model, lm_head_weight=new.lm_head_weight)
    old.lm_head = new.lm_head
    embeds = new.embed(torch.randint(0, 1000, (247,)))
    pos, delta = positions.mrope_positions(247, [positions.ImageSpan(15, 14, 14)])
    ctx = new.new_state(); new.forward(embeds, pos, ctx)
    def mk():
        b = DecodeBatch(new, max_slots=8, kv_tokens=8 * 800)
        for _ in range(8): b.add(ctx)
        return b
    batches = {"old": mk(), "new": mk()}
    runners = {"old": old, "new": new}
    res = {f"{k}_{s}": [] for k in ("decode", "prefill") for s in ("old", "new")}
    for r in range(int(os.environ.get("ROUNDS", 6))):
        for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
            run, b = runners[side], batches[side]
            for kind in ("decode", "prefill"):
                fn = (lambda: run.decode_step(b, [1] * 8, [n + delta for n in b.lengths])) if kind == "decode" else \
                     (lambda: run.forward_many([(embeds, pos, new.new_state())]))
                fn(); t = time.process_time(); fn(); res[f"{kind}_{side}"].append(time.process_time() - t)
    out = {k: round(1000 * statistics.median(v), 1) for k, v in res.items()}
    out["decode_new_over_old"] = round(out["decode_new"] / out["decode_old"], 3)
    out["prefill_new_over_old"] = round(out["prefill_new"] / out["prefill_old"], 3)
    out["load"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
