"""Figures of a multi-turn bench report (``epd bench --turns N --json``) by turn: the cached-token
fraction and TTFT of turns 2 and later, and how evenly the prefill replicas worked (the busiest
replica's forward time over the mean; ``prefill_replicas`` of a local stack's report).
``python -m bench.turns REPORT.json ...`` prints one row a report."""

from __future__ import annotations

import json
import sys

import numpy as np


def later_turns(report: dict) -> dict:
    rows = [r for r in report["requests"] if r["turn"] > 0 and not r["error"]]
    prompt = sum(r["prompt_tokens"] for r in rows)
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    busy = [w["busy_s"] for w in report.get("prefill_replicas", {}).values()]
    computed = [w["computed_tokens"] for w in report.get("prefill_replicas", {}).values()]
    return {"requests": len(rows), "cached_fraction": sum(r["cached_tokens"] for r in rows) / prompt if prompt else 0.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
            "busiest_over_mean": max(busy) / (sum(busy) / len(busy)) if busy and sum(busy) else None,
            "busy_s": busy, "most_tokens_over_mean": max(computed) / (sum(computed) / len(computed))
            if computed and sum(computed) else None, "computed_tokens": computed, "failed": report["failed"]}


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            figures = later_turns(json.load(f))
        print(f"{path}: turns 2+: {figures['requests']} requests, cached {figures['cached_fraction']:.1%}, "
              f"TTFT p50 {figures['ttft_p50_s']:.3f} s p99 {figures['ttft_p99_s']:.3f} s, failed {figures['failed']}"
              + (f"; prefill busy {', '.join(f'{b:.1f}' for b in figures['busy_s'])} s, busiest / mean "
                 f"{figures['busiest_over_mean']:.2f}; computed tokens {', '.join(map(str, figures['computed_tokens']))}, "
                 f"most / mean {figures['most_tokens_over_mean']:.2f}" if figures["busiest_over_mean"] else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
