"""What operators watch per public front (gRPC, HTTP): time to first token, inter-token latency,
time per output token and end-to-end latency histograms, requests by status and finish reason,
requests running, prompt and generated tokens. Names follow vLLM's where vLLM has one
(``vllm:time_to_first_token_seconds`` -> ``epd_time_to_first_token_seconds``; the mapping is in
``docs/OPERATIONS.md``), with a ``front`` label.

Times are the router's, from the moment the front hands the request to ``RouterCore`` to each
message that carries tokens; decode may put several tokens in one message, and that message's gap
is shared among its tokens for the inter-token figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator

from epd import logs, rpc
from epd.metrics import Family, Histogram, counter, gauge
from epd.v1 import epd_pb2

FRONTS = ("grpc", "http")
access = logging.getLogger("epd.access")
# vLLM's buckets, with finer ones at the low end (small models on one machine answer in milliseconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def access_line(front: str, status: str, finish: str, summary: epd_pb2.Summary | None, ttft_s: float | None,
                e2e_s: float, reason: str = "") -> None:
    """The one INFO line per finished request (``epd.access``): its id (the log context's), front,
    status, finish reason, prompt / output / cached tokens, images, TTFT and end-to-end seconds,
    and for a failure its message. A request a client got wrong is an answer, not a fault: INFO
    like the rest, never a traceback."""
    fields = {"front": front, "status": status, "finish_reason": finish,
              "prompt_tokens": summary.prompt_tokens if summary else 0,
              "output_tokens": summary.completion_tokens if summary else 0,
              "cached_tokens": summary.cached_tokens if summary else 0,
              "images": summary.images if summary else 0,
              "ttft_s": None if ttft_s is None else round(ttft_s, 6), "e2e_s": round(e2e_s, 6)}
    if reason:
        fields["error"] = reason
    access.info("request finished", extra={logs.FIELDS: fields})


class RequestStats:
    """One per router replica, shared by its fronts. ``track`` wraps a request's event stream."""

    def __init__(self) -> None:
        self.ttft = Histogram("epd_time_to_first_token_seconds", "Time to the first generated token, by front",
                              TTFT_BUCKETS, "front")
        self.itl = Histogram("epd_inter_token_latency_seconds", "Time between two generated tokens, by front",
                             TOKEN_BUCKETS, "front")
        self.tpot = Histogram("epd_request_time_per_output_token_seconds", "Per request: (end-to-end - TTFT) / "
                              "(generated tokens - 1), by front", TOKEN_BUCKETS, "front")
        self.e2e = Histogram("epd_e2e_request_latency_seconds", "End-to-end latency of requests that finished, "
                             "by front", E2E_BUCKETS, "front")
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str, str]] = Counter()  # (front, status, finish reason)
        self._running: Counter[str] = Counter()
        self._tokens: Counter[tuple[str, str]] = Counter()  # (front, "prompt" | "generation" | "cached")

    async def track(self, front: str, events: AsyncIterator[epd_pb2.GenerateResponse]
                    ) -> AsyncIterator[epd_pb2.GenerateResponse]:
        """Pass ``events`` through, measuring them; closes ``events`` when the consumer stops early."""
        start = time.perf_counter()
        first = last = None
        status, finish = "OK", ""
        summary, reason = None, ""
        with self._lock:
            self._running[front] += 1
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if event.WhichOneof("event") == "summary":
                        summary = event.summary
                        finish = summary.finish_reason
                        with self._lock:
                            self._tokens[(front, "prompt")] += summary.prompt_tokens
                            self._tokens[(front, "generation")] += summary.completion_tokens
                            self._tokens[(front, "cached")] += summary.cached_tokens
                        if first is not None and summary.completion_tokens > 1:
                            self.tpot.observe((last - first) / (summary.completion_tokens - 1), front)
                    elif event.chunk.token_ids:
                        now = time.perf_counter()
                        if first is None:
                            first = now
                            self.ttft.observe(now - start, front)
                            more = len(event.chunk.token_ids) - 1
                        else:
                            more = len(event.chunk.token_ids)
                        for _ in range(more):
                            self.itl.observe((now - last) / len(event.chunk.token_ids), front)
                        last = now
                    yield event
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        except BaseException as error:
            code, reason = rpc.status_of(error)
            status = code.name
            raise
        finally:
            e2e = time.perf_counter() - start
            with self._lock:
                self._running[front] -= 1
                self._requests[(front, status, finish)] += 1
            if status == "OK":
                self.e2e.observe(e2e, front)
            access_line(front, status, finish, summary, None if first is None else first - start, e2e, reason)

    def running(self, front: str) -> int:
        with self._lock:
            return self._running[front]

    def refused(self, front: str, status: str, reason: str = "") -> None:
        """A request the front refused before it reached the request path (its own checks)."""
        with self._lock:
            self._requests[(front, status, "")] += 1
        access_line(front, status, "", None, None, 0.0, reason)

    def families(self) -> list[Family]:
        with self._lock:
            requests, running, tokens = dict(self._requests), dict(self._running), dict(self._tokens)
        total = counter("epd_requests_total", "Requests by front, final status (OK or the gRPC status name; "
                        "CANCELLED: the client left) and finish reason (eos, stop, length; empty when it failed)",
                        "front", "status", "finish_reason")
        for labels, count in requests.items():
            total.add(count, *labels)
        in_flight = gauge("epd_num_requests_running", "Requests this router is carrying now, by front", "front")
        for front in FRONTS:
            in_flight.add(running.get(front, 0), front)
        prompt = counter("epd_prompt_tokens_total", "Prompt tokens of finished requests, by front", "front")
        generation = counter("epd_generation_tokens_total", "Generated tokens of finished requests, by front", "front")
        cached = counter("epd_prompt_tokens_cached_total", "Prompt tokens prefill took from its prefix cache, by "
                         "front", "front")
        for front in FRONTS:
            prompt.add(tokens.get((front, "prompt"), 0), front)
            generation.add(tokens.get((front, "generation"), 0), front)
            cached.add(tokens.get((front, "cached"), 0), front)
        return [total, in_flight, prompt, generation, cached,
                self.ttft.family(), self.itl.family(), self.tpot.family(), self.e2e.family()]
