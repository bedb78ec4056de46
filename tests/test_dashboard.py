"""The Grafana dashboard queries metrics the router really exports, and the scrape plotter reads
the router's real histogram output the way Prometheus' histogram_quantile does."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from bench import dashboard
from epd.metrics import render
from epd.v1 import epd_pb2
from router_svc.stats import RequestStats

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _exported_names() -> set[str]:
    names = set()
    for family in RequestStats().families():
        names.add(family.name)
        if family.kind == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    source = (ROOT / "router_svc" / "core.py").read_text()  # the router's cache and store families
    names |= set(re.findall(r'"(epd_[a-z0-9_]+)"', source))
    return names


def test_every_dashboard_query_names_an_exported_metric():
    board = json.loads((ROOT / "deploy" / "grafana-epd.json").read_text())
    used = {name for panel in board["panels"] for target in panel["targets"]
            for name in re.findall(r"\b(epd_[a-z0-9_]+)", target["expr"])}
    assert used and used <= _exported_names(), used - _exported_names()
    assert {p["title"] for p in board["panels"]} >= {"Time to first token", "Inter-token latency",
                                                     "Time per output token", "End-to-end latency"}


async def _events(chunks: list[int]):
    for size in chunks:
        yield epd_pb2.GenerateResponse(chunk=epd_pb2.TokenChunk(token_ids=list(range(size)), text="x"))
    yield epd_pb2.GenerateResponse(summary=epd_pb2.Summary(prompt_tokens=10, completion_tokens=sum(chunks),
                                                           finish_reason="length"))


def test_stats_histograms_and_quantiles_from_a_scrape():
    import asyncio

    stats = RequestStats()
    for value in [0.003] * 50 + [0.3] * 40 + [3.0] * 10:  # 50% at 3 ms, 40% at 300 ms, 10% at 3 s
        stats.ttft.observe(value, "http")

    async def consume():
        async for _ in stats.track("grpc", _events([1, 3, 2])):
            pass

    asyncio.run(consume())
    text = render(stats.families)[0].decode()
    samples = dashboard.parse(text)
    assert samples[dashboard.key("epd_requests_total", {"front": "grpc", "status": "OK", "finish_reason": "length"})] == 1
    assert samples[dashboard.key("epd_time_to_first_token_seconds_count", {"front": "http"})] == 100
    assert samples[dashboard.key("epd_inter_token_latency_seconds_count", {"front": "grpc"})] == 5  # 6 tokens
    assert samples[dashboard.key("epd_generation_tokens_total", {"front": "grpc"})] == 6
    # Two scrapes: the quantiles of what happened between them.
    empty = dashboard.parse(render(RequestStats().families)[0].decode())
    scrapes = [{"t": 0.0, "samples": empty}, {"t": 10.0, "samples": samples}]
    q = {p: dashboard.quantile(scrapes, "epd_time_to_first_token_seconds", p, ("front",), 60)[("http",)][0][1]
         for p in (0.25, 0.5, 0.9, 0.99)}
    assert 0.001 < q[0.25] <= 0.005 and q[0.5] == pytest.approx(0.005)
    assert 0.25 < q[0.9] <= 0.5 and 2.5 < q[0.99] <= 5.0
    assert dashboard.rate(scrapes, "epd_requests_total", ("front",), 60)[("grpc",)] == [(10.0, 0.1)]
