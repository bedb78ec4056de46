"""Prometheus metrics: each role that has some serves them on its own /metrics port.

A role hands ``serve_metrics`` a function that reads its current figures; the figures are read
when Prometheus scrapes (no counters are kept twice, no module-global registry). Port 0 means
off, which is the default.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


@dataclass
class Family:
    """One metric: ``kind`` is "counter", "gauge" or "histogram"; samples map label values to a
    number (a histogram's to a ``(cumulative bucket counts by upper bound, sum)`` pair)."""

    kind: str
    name: str
    doc: str
    label_names: tuple[str, ...] = ()
    samples: dict[tuple[str, ...], float] = field(default_factory=dict)

    def add(self, value: float, *label_values: str) -> Family:
        self.samples[tuple(label_values)] = float(value)
        return self


def counter(name: str, doc: str, *label_names: str) -> Family:
    return Family("counter", name, doc, label_names)


def gauge(name: str, doc: str, *label_names: str) -> Family:
    return Family("gauge", name, doc, label_names)


class Histogram:
    """A latency histogram a role keeps (observations by label values), read at scrape time as a
    ``Family``. ``observe`` is cheap and thread-safe."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], *label_names: str) -> None:
        self.name, self.doc, self.label_names = name, doc, label_names
        self.bounds = tuple(sorted(buckets))
        self._series: dict[tuple[str, ...], list] = {}  # labels -> [counts per bucket + overflow, sum]
        self._lock = threading.Lock()

    def observe(self, value: float, *label_values: str) -> None:
        with self._lock:
            series = self._series.setdefault(tuple(label_values), [[0] * (len(self.bounds) + 1), 0.0])
            series[0][bisect.bisect_left(self.bounds, value)] += 1
            series[1] += value

    def family(self) -> Family:
        family = Family("histogram", self.name, self.doc, self.label_names)
        with self._lock:
            for labels, (counts, total) in self._series.items():
                cumulative, running = [], 0
                for bound, count in zip((*self.bounds, float("inf")), counts):
                    running += count
                    cumulative.append((_bound(bound), running))
                family.samples[labels] = (cumulative, total)
        return family


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))


class _ReadAtScrape:
    def __init__(self, read: Callable[[], Iterable[Family]]) -> None:
        self._read = read

    def collect(self):
        for family in self._read():
            if family.kind == "histogram":
                metric = HistogramMetricFamily(family.name, family.doc, labels=list(family.label_names))
                for labels, (buckets, total) in family.samples.items():
                    metric.add_metric(list(labels), buckets, total)
                yield metric
                continue
            cls = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            metric = cls(family.name, family.doc, labels=list(family.label_names))
            for labels, value in family.samples.items():
                metric.add_metric(list(labels), value)
            yield metric


def render(read: Callable[[], Iterable[Family]]) -> tuple[bytes, str]:
    """``read()``'s families in Prometheus' text format, and its content type (for a /metrics route
    served by something else, e.g. the router's HTTP front)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReadAtScrape(read))
    return generate_latest(registry), CONTENT_TYPE_LATEST


def serve_metrics(read: Callable[[], Iterable[Family]], host: str, port: int):
    """Serve ``read()``'s families at http://host:port/metrics; returns the HTTP server, or None
    when ``port`` is 0."""
    if not port:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReadAtScrape(read))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
