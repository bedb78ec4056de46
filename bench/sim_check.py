"""The simulator's model of a replica checked against a real run: replay a real multi-turn bench
report (``epd bench --turns N --json``, a local stack, so it carries ``prefill_replicas``) through
``bench.simulate.simulate`` and put the figures side by side.

The replay keeps what the run had: the same conversations, each request's prompt length, when it
reached prefill (sent + the time before prefill: its TTFT less prefill's queue, forward and
handoff), the same replicas, routing policy, block size and snapshot spacing. Prompts are random
tokens per conversation built so that each turn shares with the next what the chat template
shares (measured with the checkpoint's tokenizer: the history re-renders up to the generation
prompt), and prefill snapshots at the generation prompt as the real one does. The simulated
replica computes one prompt at a time at the rate measured on this machine (``bench.prefill_rate``).

    python -m bench.sim_check REPORT.json RATE.json MODEL_DIR [--rate-in-run]

(``--rate-in-run``: the replicas' own seconds per computed token in that run instead of RATE's
rate, measured alone; on a shared machine the two differ several times over)

prints cached fraction of turns 2+, total prefill busy seconds, busiest / mean replica and the
prefill time per request (queue + forward) p50 / mean, real against simulated.
"""

from __future__ import annotations

import json
import random
import statistics
import sys

from bench import simulate


def template_tails(model_dir: str) -> tuple[int, int]:
    """(tokens after the last ``<|im_start|>``, tokens after what the next turn shares) of a
    one-turn prompt with its generation prompt: the chat template's own figures."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    first = [{"role": "user", "content": "what is in the picture"}]
    second = [*first, {"role": "assistant", "content": "a cat"}, {"role": "user", "content": "what colour"}]
    a = tokenizer(tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True))["input_ids"]
    b = tokenizer(tokenizer.apply_chat_template(second, tokenize=False, add_generation_prompt=True))["input_ids"]
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    start = len(a) - 1 - a[::-1].index(tokenizer.convert_tokens_to_ids("<|im_start|>"))
    return len(a) - start, len(a) - shared


REPLAY_GRID = (4, 4)
"""The image placeholder run the replayed first turns carry (the keys need one per image; its
size changes nothing else: the real prompt lengths are kept)."""


def replay_trace(report: dict, start_tail: int, shared_tail: int, seed: int = 0) -> list[simulate.ReplayTurn]:
    rng = random.Random(seed)
    rows = [r for r in report["requests"] if not r["error"] and r["conversation"] >= 0]
    origin = min(r["sent_s"] for r in rows)
    trace = []
    by_conversation: dict[int, list[dict]] = {}
    for row in rows:
        by_conversation.setdefault(row["conversation"], []).append(row)
    for conversation, turns in by_conversation.items():
        previous: list[int] = []
        for row in sorted(turns, key=lambda r: r["turn"]):
            stages = row["stages"]
            before = row["ttft_s"] - stages.get("queue_s", 0.0) - stages.get("prefill_s", 0.0) - stages.get(
                "handoff_s", 0.0)
            keep = previous[:max(0, len(previous) - shared_tail)]
            if not previous:  # a first turn: the template's opening, then the image
                keep = [1, 2, 3, 4] + [simulate.IMAGE_TOKEN] * (REPLAY_GRID[0] * REPLAY_GRID[1])
            tokens = keep + [rng.randrange(1000, 100_000) for _ in range(row["prompt_tokens"] - len(keep))]
            trace.append(simulate.ReplayTurn(conversation, row["turn"], row["sent_s"] - origin + max(0.0, before),
                                             tokens, max(0, len(tokens) - start_tail)))
            previous = tokens
    return sorted(trace, key=lambda t: t.arrival)


def compare(report: dict, rate: dict, model_dir: str) -> dict:
    stack = report["config"]["stack"]["serve"]
    prefill = stack["prefill"]
    config = simulate.SimConfig(
        num_replicas=report["config"]["stack"]["num_prefill"], block_size=prefill["prefix_block_size"],
        snapshot_every_blocks=prefill["snapshot_every_blocks"],
        prefix_cache_mb=prefill["prefix_cache_mb"], image_grid=REPLAY_GRID,
        **{k: rate[k] for k in ("per_token_s", "fixed_s", "kv_bytes_per_token", "linear_state_bytes")})
    policy = stack["router"]["prefill_routing"]
    start_tail, shared_tail = template_tails(model_dir)
    result = simulate.simulate(config, policy, replay_trace(report, start_tail, shared_tail))
    sim = result.figures()
    rows = [r for r in report["requests"] if not r["error"] and r["conversation"] >= 0]
    later = [r for r in rows if r["turn"] > 0]
    real_prefill = [r["stages"].get("queue_s", 0.0) + r["stages"].get("prefill_s", 0.0) for r in rows]
    sim_prefill = [t.first_token - t.arrival for t in result.turns]
    busy = [w["busy_s"] for w in report["prefill_replicas"].values()]
    sim_busy = list(result.busy_s.values())
    return {
        "replicas": config.num_replicas, "policy": policy, "requests": len(rows),
        "template_tails": [start_tail, shared_tail],
        "cached_fraction_turns2": {"real": sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later),
                                   "sim": sim["cached_fraction_turns2"]},
        "busy_s_total": {"real": sum(busy), "sim": sum(sim_busy)},
        "busiest_over_mean": {"real": max(busy) / statistics.fmean(busy), "sim": sim["imbalance"]},
        "prefill_s_p50": {"real": statistics.median(real_prefill), "sim": statistics.median(sim_prefill)},
        "prefill_s_mean": {"real": statistics.fmean(real_prefill), "sim": statistics.fmean(sim_prefill)},
    }


def rate_in_run(report: dict, kv_from: dict) -> dict:
    """The replicas' own rate in the run: their forward seconds over the tokens they computed (no
    fixed part); the byte figures from ``kv_from`` (a measured rate's JSON)."""
    work = report["prefill_replicas"].values()
    return {**kv_from, "fixed_s": 0.0,
            "per_token_s": sum(w["busy_s"] for w in work) / max(1, sum(w["computed_tokens"] for w in work))}


def main(report_path: str, rate_path: str, model_dir: str, in_run: bool = False) -> None:
    with open(report_path) as f:
        report = json.load(f)
    with open(rate_path) as f:
        rate = json.load(f)
    if in_run:
        rate = rate_in_run(report, rate)
    print(f"rate: {rate['fixed_s'] * 1000:.1f} ms + {rate['per_token_s'] * 1e6:.0f} us per token"
          f"{' (the replicas own, in the run)' if in_run else ''}")
    figures = compare(report, rate, model_dir)
    print(json.dumps({k: v for k, v in figures.items() if not isinstance(v, dict)}))
    for name, pair in figures.items():
        if isinstance(pair, dict):
            ratio = pair["sim"] / pair["real"] if pair["real"] else float("nan")
            print(f"{name:<24} real {pair['real']:10.4f}  sim {pair['sim']:10.4f}  sim/real {ratio:5.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:4], in_run="--rate-in-run" in sys.argv[4:])
