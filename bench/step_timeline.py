"""``python -m bench.step_timeline URL [--interval 0.5] [--duration S] [--json FILE]``: what a
replica's step loop did, interval by interval, read from its Prometheus endpoint while a load
runs (start the stack with ``--prefill-metrics-port N``, the aggregated replica's, then point this
at ``http://127.0.0.1:N/metrics`` and run ``epd bench --addr ...`` or the load of your choice).

Each row is one interval: decode steps run, how many of them also carried prefill chunks, the
prefill tokens those carried, the mean decode batch of the interval's steps, the interval's
length over its steps (a step longer than the interval shows as intervals of none, then one),
the requests running and the prompts waiting at its end, and the prompt tokens computed. It is how
docs/BENCHMARKS.md reads where a workload's wall time goes (a phase of prompt-carrying steps, a
phase of decode at half a batch...), on the served system rather than a model of it.

Stops after ``--duration`` seconds, or at Ctrl-C, or when the endpoint stops answering (the stack
went away); prints the table and writes the samples to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request

from bench import dashboard

# counters (deltas per interval) and gauges (values at the interval's end), unlabelled samples only
COUNTERS = ("epd_decode_steps_total", "epd_decode_mixed_steps_total", "epd_decode_riding_prefill_tokens_total",
            "epd_decode_batch_rows_total", "epd_prefill_computed_tokens_total", "epd_prefill_busy_seconds_total")
GAUGES = ("epd_decode_running_requests", "epd_prefill_waiting_prompts")


def scrape(url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """The unlabelled samples of COUNTERS and GAUGES at ``url`` now (parsed as the dashboard's
    scrape parses them)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        samples = dashboard.parse(response.read().decode())
    return {name: samples[dashboard.key(name, {})] for name in (*COUNTERS, *GAUGES)
            if dashboard.key(name, {}) in samples}


def rows(samples: list[tuple[float, dict[str, float]]]) -> list[dict[str, float]]:
    """Per interval: the counters' deltas and the gauges at its end, time from the first sample."""
    out = []
    start = samples[0][0] if samples else 0.0
    for (t0, before), (t1, after) in zip(samples, samples[1:]):
        delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in COUNTERS}
        steps = delta["epd_decode_steps_total"]
        out.append({
            "t_s": round(t1 - start, 2),
            "steps": int(steps),
            "mixed_steps": int(delta["epd_decode_mixed_steps_total"]),
            "riding_tokens": int(delta["epd_decode_riding_prefill_tokens_total"]),
            "mean_rows": round(delta["epd_decode_batch_rows_total"] / steps, 2) if steps else 0.0,
            "step_ms": round((t1 - t0) * 1e3 / steps, 1) if steps else None,
            "prompt_tokens": int(delta["epd_prefill_computed_tokens_total"]),
            "prefill_busy_s": round(delta["epd_prefill_busy_seconds_total"], 2),
            "running": int(after.get("epd_decode_running_requests", 0)),
            "waiting_prompts": int(after.get("epd_prefill_waiting_prompts", 0)),
        })
    return out


def table(intervals: list[dict[str, float]]) -> str:
    columns = ("t_s", "steps", "mixed_steps", "riding_tokens", "mean_rows", "step_ms", "prompt_tokens",
               "prefill_busy_s", "running", "waiting_prompts")
    lines = ["  ".join(f"{c:>14}" for c in columns)]
    for row in intervals:
        lines.append("  ".join(f"{'-' if row[c] is None else row[c]:>14}" for c in columns))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the replica's metrics endpoint, e.g. http://127.0.0.1:9400/metrics")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between scrapes")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds to watch (0: until Ctrl-C or the "
                                                                      "endpoint goes away)")
    parser.add_argument("--wait-s", type=float, default=600.0, help="how long to wait for the endpoint to answer")
    parser.add_argument("--json", default="", help="write the intervals here")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be positive")
    deadline = time.monotonic() + args.wait_s
    while True:  # the stack may still be starting
        try:
            samples = [(time.monotonic(), scrape(args.url))]
            break
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            if time.monotonic() > deadline:
                raise SystemExit(f"{args.url} did not answer within {args.wait_s:.0f} s: {e}") from None
            time.sleep(0.5)
    end = time.monotonic() + args.duration if args.duration else float("inf")
    try:
        while time.monotonic() < end:
            time.sleep(max(0.0, samples[-1][0] + args.interval - time.monotonic()))
            try:
                samples.append((time.monotonic(), scrape(args.url)))
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                break  # the stack stopped
    except KeyboardInterrupt:
        pass
    intervals = rows(samples)
    # the idle stretches before and after the load say nothing: keep from the first step to the last
    busy = [i for i, row in enumerate(intervals) if row["steps"] or row["prompt_tokens"]]
    if busy:
        intervals = intervals[busy[0]:busy[-1] + 1]
    print(table(intervals))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "interval_s": args.interval, "intervals": intervals}, f, indent=1)


if __name__ == "__main__":
    main()
