"""Per-request measurements and the run's figures (percentiles, throughput, goodput, stage ratios).

Times are the client's (``time.perf_counter``): TTFT is send -> first chunk carrying tokens, ITL
the gaps between successive token-carrying chunks, TPOT ``(e2e - ttft) / (output_tokens - 1)``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_ERRORS_REPORTED = 5
LATENCY_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


@dataclass
class RequestRecord:
    """One request as the client saw it, plus what its Summary said (epd only)."""

    conversation: int
    turn: int
    error: str = ""
    sent_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)  # arrival of each token-carrying chunk
    output_tokens: int = 0
    done_s: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)  # Summary.timings, by field name
    prompt_tokens: int = 0
    cached_tokens: int = 0
    images_encoded: int = 0
    images_cached: int = 0
    video_frames: int = 0  # frames the server samples from the request's distinct clips (from the workload)
    videos: int = 0  # the Summary's video figures
    video_tokens: int = 0
    video_chunks: int = 0
    video_chunks_encoded: int = 0

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.sent_s if self.token_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return {"conversation": self.conversation, "turn": self.turn, "error": self.error,
                "sent_s": self.sent_s,  # the client's perf_counter clock: compare within one run only
                "ttft_s": self.ttft_s,
                "tpot_s": self.tpot_s, "e2e_s": self.e2e_s, "output_tokens": self.output_tokens,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "images_encoded": self.images_encoded, "images_cached": self.images_cached,
                "videos": self.videos, "video_tokens": self.video_tokens, "video_frames": self.video_frames,
                "video_chunks": self.video_chunks, "video_chunks_encoded": self.video_chunks_encoded,
                "stages": self.stages}


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_s is not None and (record.ttft_s is None or record.ttft_s > self.ttft_s):
            return False
        if self.tpot_s is not None and record.tpot_s is not None and record.tpot_s > self.tpot_s:
            return False
        return True


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation between samples); None for each when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    data = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return {"mean": float(data.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """The raw samples behind each latency figure (successful requests only)."""
    done = [r for r in records if r.ok]
    return {
        "ttft_s": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot_s": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl_s": [gap for r in done for gap in r.itl_s],
        "e2e_s": [r.e2e_s for r in done],
    }


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo) -> dict:
    """The figures of one system's run (epd or the baseline) over ``duration_s`` of wall time."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    samples = latency_samples(records)
    figures: dict = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(failed),
        "errors": [f"conversation {r.conversation} turn {r.turn}: {r.error}" for r in failed[:MAX_ERRORS_REPORTED]],
        "duration_s": duration_s,
        "output_tokens_total": output_tokens,
        "prompt_tokens_total": sum(r.prompt_tokens for r in done),
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "throughput_tok_s": output_tokens / duration_s if duration_s > 0 else 0.0,
        "goodput": sum(slo.met(r) for r in done) / duration_s if duration_s > 0 else 0.0,
    }
    figures.update({key: percentiles(samples[key]) for key in LATENCY_KEYS})
    figures["requests"] = [r.to_json() for r in sorted(records, key=lambda r: (r.conversation, r.turn))]
    return figures


def stage_figures(records: Sequence[RequestRecord]) -> dict:
    """What the Summaries say about where the time went and what the caches saved (epd only)."""
    done = [r for r in records if r.ok]
    store = [(r.stages.get("store_write_s", 0.0) + r.stages.get("store_read_s", 0.0)) / r.stages["encode_s"]
             for r in done if r.images_encoded > 0 and r.stages.get("encode_s", 0.0) > 0]
    handoff = [r.stages["handoff_s"] / r.stages["prefill_s"]
               for r in done if r.stages.get("handoff_bytes", 0) > 0 and r.stages.get("prefill_s", 0.0) > 0]
    figures = {
        "store_overhead_ratio": _median_or_none(store),
        "handoff_overhead_ratio": _median_or_none(handoff),
        "cached_tokens": sum(r.cached_tokens for r in done),
        "images_encoded": sum(r.images_encoded for r in done),
        "images_cached": sum(r.images_cached for r in done),
        "stage_s": {name: percentiles([r.stages[name] for r in done if name in r.stages])
                    for name in ("encode_s", "store_write_s", "store_read_s", "prefill_s", "handoff_s", "queue_s")},
    }
    if any(r.videos for r in done):
        figures["video"] = video_figures(done)
    return figures


def video_figures(done: Sequence[RequestRecord]) -> dict:
    """Clips: chunks encoded and served from the store, tokens, the encode time per sampled frame
    (``encode_s`` is the sum of the chunks' encode times, their decoding and preprocessing
    included, so it is per-frame work, not wall time), and TTFT of requests whose clips were all
    encoded beside those whose clips all came from the store."""
    clips = [r for r in done if r.videos]
    # Only where every chunk was encoded for this request and no image was: encode_s is then the clips'.
    fresh = [r for r in clips if r.video_chunks_encoded == r.video_chunks > 0 and not r.images_encoded]
    cached = [r for r in clips if r.video_chunks and not r.video_chunks_encoded and not r.images_encoded]
    return {
        "videos": sum(r.videos for r in clips),
        "video_tokens": sum(r.video_tokens for r in clips),
        "chunks": sum(r.video_chunks for r in clips),
        "chunks_encoded": sum(r.video_chunks_encoded for r in clips),
        "encode_ms_per_frame": percentiles([1000 * r.stages.get("encode_s", 0.0) / r.video_frames
                                            for r in fresh if r.video_frames]),
        "ttft_s_clips_encoded": percentiles([r.ttft_s for r in fresh if r.ttft_s is not None]),
        "ttft_s_clips_from_store": percentiles([r.ttft_s for r in cached if r.ttft_s is not None]),
    }


def median_seconds(fn: Callable[[], object], repeats: int, warmups: int = 1) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` after ``warmups`` untimed ones: the
    in-process benchmarks' timing loop."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)

