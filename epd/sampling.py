"""Token sampling: greedy, or seeded temperature / top-k / top-p, with optional logprobs.

Seeded sampling draws step ``i`` from a generator seeded by ``(seed, i)``: the same seed gives the
same tokens whichever process samples a step, so nothing about the random stream has to travel
with the prefill -> decode handoff.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive steps far apart in seed space
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class SamplingConfig:
    """Resolved sampling parameters of one request (validated by the router)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    logprobs: int = 0

    def __post_init__(self) -> None:
        validate(self.max_tokens, self.temperature, self.top_p, self.top_k, self.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate(max_tokens: int, temperature: float, top_p: float, top_k: int, logprobs: int) -> None:
    """Raise ValueError naming the first out-of-range sampling value."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0 <= logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


def sample(logits: torch.Tensor, config: SamplingConfig, step: int) -> tuple[int, TokenLogprobs | None]:
    """Pick the token for decode step ``step`` from float32 ``logits [vocab]``."""
    if config.greedy:
        token = int(torch.argmax(logits))
    else:
        token = _sample_random(logits, config, step)
    return token, (_logprobs(logits, token, config.logprobs) if config.logprobs else None)


def _sample_random(logits: torch.Tensor, config: SamplingConfig, step: int) -> int:
    # Shift before scaling: a tiny temperature must sharpen towards greedy, not overflow to inf.
    scores = (logits - logits.max()) / config.temperature
    if config.top_k and config.top_k < scores.numel():
        kth = torch.topk(scores, config.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if config.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the best token always stays.
        drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= config.top_p
        scores = scores.scatter(0, order[drop], -math.inf)
    generator = torch.Generator(device="cpu").manual_seed((config.seed + step * _GOLDEN) & _MASK63)
    probs = torch.softmax(scores.float().cpu(), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _logprobs(logits: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, num_top)
    return TokenLogprobs(float(logprobs[token]), list(zip(ids.tolist(), values.tolist())))
