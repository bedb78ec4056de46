"""Prometheus metrics: each role that has some serves them on its own /metrics port.

A role hands ``serve_metrics`` a function that reads its current figures; the figures are read
when Prometheus scrapes (no counters are kept twice, no module-global registry). Port 0 means
off, which is the default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


@dataclass
class Family:
    """One metric: ``kind`` is "counter" or "gauge"; samples map label values to a number."""

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


class _ReadAtScrape:
    def __init__(self, read: Callable[[], Iterable[Family]]) -> None:
        self._read = read

    def collect(self):
        for family in self._read():
            cls = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            metric = cls(family.name, family.doc, labels=list(family.label_names))
            for labels, value in family.samples.items():
                metric.add_metric(list(labels), value)
            yield metric


def serve_metrics(read: Callable[[], Iterable[Family]], host: str, port: int):
    """Serve ``read()``'s families at http://host:port/metrics; returns the HTTP server, or None
    when ``port`` is 0."""
    if not port:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReadAtScrape(read))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
