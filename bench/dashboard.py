"""The Grafana dashboard's panels (``deploy/grafana-epd.json``) drawn from a real scrape, for
machines without Grafana: scrape a router's /metrics at an interval into a JSON-lines file, then
plot the same queries the dashboard runs (rates over a window; quantiles from histogram buckets
with Prometheus' ``histogram_quantile`` interpolation).

    python -m bench.dashboard scrape --url http://HOST:PORT/metrics --interval 2 --duration 120 --out scrape.jsonl
    python -m bench.dashboard plot scrape.jsonl --out dashboard.png [--window 20]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import time
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

Sample = dict[str, float]  # "name{label=value,...}" -> value


def scrape(url: str, interval_s: float, duration_s: float, out: str) -> int:
    """Scrape ``url`` every ``interval_s`` for ``duration_s``; one JSON line per scrape. Returns the count."""
    count = 0
    deadline = time.monotonic() + duration_s
    with open(out, "w") as f:
        while time.monotonic() < deadline:
            started = time.monotonic()
            try:
                text = urllib.request.urlopen(url, timeout=10).read().decode()
            except OSError as error:
                print(f"scrape failed: {error}")
            else:
                f.write(json.dumps({"t": time.time(), "samples": parse(text)}) + "\n")
                f.flush()
                count += 1
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    return count


def parse(text: str) -> Sample:
    samples: Sample = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[key(s.name, s.labels)] = s.value
    return samples


def key(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f"{k}={labels[k]}" for k in sorted(labels)) + "}"


def _labels(sample_key: str) -> tuple[str, dict[str, str]]:
    name, _, rest = sample_key.partition("{")
    pairs = [p.split("=", 1) for p in rest.rstrip("}").split(",") if p]
    return name, dict(pairs)


def rate(scrapes: list[dict], name: str, by: tuple[str, ...], window_s: float, where: dict | None = None):
    """``sum by (by) (rate(name[window]))`` at each scrape: {label values: [(t, per second)]}."""
    series: dict[tuple, list] = defaultdict(list)
    for index, now in enumerate(scrapes):
        past = next((s for s in scrapes[:index] if now["t"] - s["t"] <= window_s), None)
        if past is None or past is now:
            continue
        sums: dict[tuple, float] = defaultdict(float)
        for sample_key, value in now["samples"].items():
            metric, labels = _labels(sample_key)
            if metric != name or any(labels.get(k) != v for k, v in (where or {}).items()):
                continue
            sums[tuple(labels.get(k, "") for k in by)] += max(0.0, value - past["samples"].get(sample_key, 0.0))
        for group, delta in sums.items():
            series[group].append((now["t"], delta / (now["t"] - past["t"])))
    return series


def quantile(scrapes: list[dict], name: str, q: float, by: tuple[str, ...], window_s: float):
    """``histogram_quantile(q, sum by (le, by) (rate(name_bucket[window])))`` at each scrape."""
    buckets = rate(scrapes, name + "_bucket", (*by, "le"), window_s)
    grouped: dict[tuple, dict[float, dict[float, float]]] = defaultdict(lambda: defaultdict(dict))
    for group, points in buckets.items():
        *labels, le = group
        for t, value in points:
            grouped[tuple(labels)][t][float(le)] = value
    out: dict[tuple, list] = {}
    for labels, times in grouped.items():
        out[labels] = [(t, histogram_quantile(q, bounds)) for t, bounds in sorted(times.items())]
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' interpolation: linear within the bucket the rank falls in; NaN without observations."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return bounds[-2] if len(bounds) > 1 else math.nan


def plot(scrape_path: str, out: str, window_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (gzip.open(scrape_path, "rt") if scrape_path.endswith(".gz") else open(scrape_path)) as f:
        scrapes = [json.loads(line) for line in f if line.strip()]
    start = scrapes[0]["t"]
    fig, axes = plt.subplots(3, 2, figsize=(14, 11))
    fig.suptitle(f"epd router: the Grafana dashboard's panels from a real scrape ({len(scrapes)} scrapes, "
                 f"{window_s:g} s rate window)")

    def draw(ax, series: dict, title: str, unit: str, label) -> None:
        for group, points in sorted(series.items()):
            points = [(t, v) for t, v in points if not math.isnan(v)]
            if points:
                ax.plot([t - start for t, _ in points], [v for _, v in points], label=label(group))
        ax.set_title(title)
        ax.set_xlabel("s")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)

    draw(axes[0][0], rate(scrapes, "epd_requests_total", ("front", "status"), window_s),
         "Requests by front and status", "req/s", lambda g: f"{g[0]} {g[1]}")
    for ax, metric, title in ((axes[0][1], "epd_time_to_first_token_seconds", "Time to first token"),
                              (axes[1][0], "epd_inter_token_latency_seconds", "Inter-token latency"),
                              (axes[1][1], "epd_e2e_request_latency_seconds", "End-to-end latency")):
        series = {}
        for q in (0.5, 0.99):
            for group, points in quantile(scrapes, metric, q, ("front",), window_s).items():
                series[(f"p{int(q * 100)}", *group)] = points
        draw(ax, series, title, "s", lambda g: f"{g[1]} {g[0]}")
    draw(axes[2][0], rate(scrapes, "epd_generation_tokens_total", ("front",), window_s),
         "Generated tokens", "tok/s", lambda g: g[0])
    running = defaultdict(list)
    for s in scrapes:
        for sample_key, value in s["samples"].items():
            name, labels = _labels(sample_key)
            if name == "epd_num_requests_running":
                running[(labels.get("front", ""),)].append((s["t"], value))
    draw(axes[2][1], running, "Requests running", "requests", lambda g: g[0])
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("scrape")
    s.add_argument("--url", required=True)
    s.add_argument("--interval", type=float, default=2.0)
    s.add_argument("--duration", type=float, required=True)
    s.add_argument("--out", required=True)
    p = sub.add_parser("plot")
    p.add_argument("scrape")
    p.add_argument("--out", required=True)
    p.add_argument("--window", type=float, default=20.0, help="rate window in seconds (the dashboard's [1m])")
    args = parser.parse_args(argv)
    if args.command == "scrape":
        print(f"{scrape(args.url, args.interval, args.duration, args.out)} scrapes written to {args.out}")
    else:
        plot(args.scrape, args.out, args.window)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
