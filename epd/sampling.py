"""Token sampling: greedy, or seeded temperature / top-k / top-p, with optional logprobs.

Seeded sampling draws step ``i`` from a generator seeded by ``(seed, i)``: the same seed gives the
same tokens whichever process samples a step, so nothing about the random stream has to travel
with the prefill -> decode handoff.

Before the choice the logits are processed in vLLM's order (v1 ``Sampler``): ``min_tokens`` (EOS
and ``stop_token_ids`` masked while fewer tokens were generated), ``logit_bias``, then the
penalties (``repetition_penalty`` over the prompt's and the answer's tokens, as vLLM and
transformers; ``frequency_penalty`` and ``presence_penalty`` over the answer's, as OpenAI). Greedy
takes the argmax of that; sampling then divides by the temperature and applies ``min_p``,
``top_k`` and ``top_p``. A structured output's grammar (``epd.grammar``) sets every token it does
not allow next to -inf (every mask is -inf, so the order of these steps does not matter, except
that ``min_tokens`` yields where the grammar allows only the end). What the penalties read
(``TokenHistory``) is a function of the request's
prompt and its tokens so far, so a request resumed elsewhere samples exactly as it would have.
Logprobs are those of the raw logits (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
MAX_TOKEN_LIST = 1024  # entries of stop_token_ids, and of logit_bias: each is work on every step
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty / frequency_penalty: [-2, 2]
MAX_REPETITION_PENALTY = 2.0
MAX_GRAMMAR_CHARS = 256 * 1024  # epd.grammar's bound on what a client sends
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
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct, sorted
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    grammar: str = ""  # structured output: an llguidance grammar (epd.grammar), "" for none

    def __post_init__(self) -> None:
        validate(self.max_tokens, self.temperature, self.top_p, self.top_k, self.logprobs)
        validate_processing(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """A penalty reads the answer's tokens so far (``TokenHistory.generated``)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_prompt(self) -> bool:
        """The penalty reads the prompt's token set too (``TokenHistory.prompt``)."""
        return self.repetition_penalty != 1.0

    @property
    def processes(self) -> bool:
        """Anything changes the logits before the choice (the fast path skips it all otherwise)."""
        return bool(self.min_tokens or self.logit_bias or self.needs_history or self.grammar)

    @property
    def plain_greedy(self) -> bool:
        """The choice is the logits' argmax as they are (greedy, nothing processes them, no
        logprobs): what ``sample`` returns then, so a batch may take it in one argmax."""
        return self.greedy and not self.processes and not self.logprobs

    @property
    def needs_answer(self) -> bool:
        """Sampling reads the answer so far (a penalty's history, or a grammar's state): a handoff
        carries its tokens."""
        return self.needs_history or bool(self.grammar)


def validate_processing(config: SamplingConfig) -> None:
    """Raise ValueError naming the first out-of-range logits-processing value."""
    if len(config.stop_token_ids) > MAX_TOKEN_LIST:
        raise ValueError(f"stop_token_ids may list at most {MAX_TOKEN_LIST} ids, got {len(config.stop_token_ids)}")
    if any(t < 0 for t in config.stop_token_ids):
        raise ValueError("stop_token_ids must be token ids >= 0")
    if len(config.grammar) > 4 * MAX_GRAMMAR_CHARS:
        raise ValueError("the grammar is too large")
    if config.grammar and config.ignore_eos:
        raise ValueError("ignore_eos cannot be combined with a structured output (the grammar ends the answer)")
    if config.min_tokens < 0 or config.min_tokens > config.max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens={config.max_tokens}], got {config.min_tokens}")
    if len(config.logit_bias) > MAX_TOKEN_LIST:
        raise ValueError(f"logit_bias may hold at most {MAX_TOKEN_LIST} tokens, got {len(config.logit_bias)}")
    for token, bias in config.logit_bias:
        if token < 0:
            raise ValueError(f"logit_bias: token id {token} must be >= 0")
        if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}")
    if len({token for token, _ in config.logit_bias}) != len(config.logit_bias):
        raise ValueError("logit_bias lists a token id twice")
    if not math.isfinite(config.min_p) or not 0.0 <= config.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {config.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(config, name)
        if not math.isfinite(value) or abs(value) > MAX_PENALTY:
            raise ValueError(f"{name} must be in [-2, 2], got {value}")
    if not math.isfinite(config.repetition_penalty) or not 0.0 < config.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise ValueError(f"repetition_penalty must be in (0, 2] (1: off), got {config.repetition_penalty}")


def check_vocab(config: SamplingConfig, vocab_size: int) -> None:
    """Raise ValueError when a token id the request names lies outside a ``vocab_size`` vocabulary."""
    for name, ids in (("stop_token_ids", config.stop_token_ids), ("logit_bias", [t for t, _ in config.logit_bias])):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary of {vocab_size} tokens")


class TokenHistory:
    """What the penalties read for one request: the prompt's distinct token ids (only with a
    repetition penalty) and every token generated so far, in order. Built from the request alone
    (a resumed request's prompt and the answer it replays), so it is the same on any worker."""

    def __init__(self, prompt_ids=(), generated=()) -> None:
        self.prompt = torch.tensor(sorted(set(prompt_ids)), dtype=torch.long)
        self.generated: list[int] = list(generated)

    def append(self, token: int) -> None:
        self.generated.append(token)


def history_for(config: SamplingConfig, prompt_ids, generated) -> TokenHistory | None:
    """The history a request with ``config`` needs, or None when no penalty reads one."""
    if not config.needs_history:
        return None
    return TokenHistory(prompt_ids if config.needs_prompt else (), generated)


def process(logits: torch.Tensor, config: SamplingConfig, step: int, history: TokenHistory | None = None,
            eos_token_ids=frozenset(), grammar=None) -> torch.Tensor:
    """The logits the choice is made from (a float32 copy, or ``logits`` itself when nothing
    applies): ``step`` is the number of tokens generated before this one; ``grammar`` the
    request's ``epd.grammar.GrammarState`` (needed when ``config.grammar`` is set)."""
    if not config.processes:
        return logits
    scores = _copy(logits)
    vocab = scores.numel()
    if config.logit_bias:
        ids = torch.tensor([t for t, _ in config.logit_bias], dtype=torch.long, device=scores.device)
        bias = torch.tensor([b for _, b in config.logit_bias], dtype=torch.float32, device=scores.device)
        scores[ids] += bias
    if config.needs_history:
        if history is None:
            raise ValueError("a penalty needs the request's token history")
        generated = torch.tensor(history.generated, dtype=torch.long, device=scores.device)
        if config.repetition_penalty != 1.0:
            seen = torch.unique(torch.cat([history.prompt.to(scores.device), generated]))
            picked = scores[seen]
            scores[seen] = torch.where(picked > 0, picked / config.repetition_penalty,
                                       picked * config.repetition_penalty)
        if generated.numel() and (config.frequency_penalty or config.presence_penalty):
            ids, counts = torch.unique(generated, return_counts=True)
            scores[ids] -= config.frequency_penalty * counts.float() + config.presence_penalty
    if config.grammar:
        if grammar is None:
            raise ValueError("a structured output needs the request's grammar state")
        grammar.apply(scores)
    if step < config.min_tokens:
        # -inf commutes with every step above (vLLM masks first). Under a grammar that allows
        # nothing but the end here, the end wins over min_tokens.
        banned = set(config.stop_token_ids) | (set() if config.ignore_eos else set(eos_token_ids))
        banned = sorted(t for t in banned if t < vocab)
        if banned:
            index = torch.tensor(banned, dtype=torch.long, device=scores.device)
            kept = scores.index_fill(0, index, -math.inf)
            if not config.grammar or bool(torch.isfinite(kept).any()):
                scores = kept
    return scores


def _copy(logits: torch.Tensor) -> torch.Tensor:
    """A float32 copy of the logits. On the CPU through numpy: one single-threaded memcpy (torch's
    clone of a 250k row went through its thread pool and took 10-100x longer on the loaded 2-core
    machine; docs/BENCHMARKS.md "Structured outputs")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().copy())
    return logits.float().clone()


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


def sample(logits: torch.Tensor, config: SamplingConfig, step: int, history: TokenHistory | None = None,
           eos_token_ids=frozenset(), grammar=None) -> tuple[int, TokenLogprobs | None]:
    """Pick the token for decode step ``step`` from float32 ``logits [vocab]`` (processed first,
    see ``process``; ``eos_token_ids`` are what ``min_tokens`` masks besides ``stop_token_ids``).
    With a ``grammar`` state the token is also fed to it (``GrammarState.accept``)."""
    scores = process(logits, config, step, history, eos_token_ids, grammar)
    if config.greedy:
        token = int(torch.argmax(scores))
    else:
        token = _sample_random(scores, config, step)
    if grammar is not None:
        grammar.accept(token)
    return token, (_logprobs(logits, token, config.logprobs) if config.logprobs else None)


def stops_on(config: SamplingConfig, token: int) -> bool:
    """``token`` is one of the request's ``stop_token_ids`` (``min_tokens`` keeps them from being
    sampled earlier)."""
    return token in config.stop_token_ids


def _sample_random(logits: torch.Tensor, config: SamplingConfig, step: int) -> int:
    scores = warp(logits, config)
    generator = torch.Generator(device="cpu").manual_seed((config.seed + step * _GOLDEN) & _MASK63)
    probs = torch.softmax(scores.float().cpu(), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def warp(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The scores a random choice draws from (softmax of them): temperature, min_p, top_k, top_p."""
    # Shift before scaling: a tiny temperature must sharpen towards greedy, not overflow to inf.
    scores = (logits - logits.max()) / config.temperature
    if config.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < probs.max() * config.min_p, -math.inf)
    if config.top_k and config.top_k < scores.numel():
        kth = torch.topk(scores, config.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if config.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the best token always stays.
        drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= config.top_p
        scores = scores.scatter(0, order[drop], -math.inf)
    return scores


def _logprobs(logits: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logprobs, num_top)
    return TokenLogprobs(float(logprobs[token]), list(zip(ids.tolist(), values.tolist())))


@dataclass(frozen=True)
class PromptLogprob:
    """vLLM's prompt logprob of one prompt token: its logprob and rank given the tokens before it."""

    token_id: int
    logprob: float
    rank: int  # 1: the model's most likely token there
    top: list[tuple[int, float]]  # (token id, logprob), best first


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> list[PromptLogprob]:
    """``logits [T, vocab]`` of T prompt rows and ``targets [T]`` (the prompt token each row
    predicts: the next one) -> each target's raw logprob, rank and the ``num_top`` best tokens.
    The rank counts the tokens strictly more likely (vLLM's: ties share the better rank)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.view(-1, 1))  # [T, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1
    values, ids = torch.topk(logprobs, num_top, dim=1) if num_top else (None, None)
    out = []
    for row, token in enumerate(targets.tolist()):
        top = list(zip(ids[row].tolist(), values[row].tolist())) if num_top else []
        out.append(PromptLogprob(token, float(chosen[row, 0]), int(ranks[row]), top))
    return out
