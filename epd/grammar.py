"""Structured outputs: a request's grammar (JSON schema, any JSON object, regex, Lark, a choice)
compiled once by the router, and the per-request matcher that masks the logits where tokens are
sampled (prefill's first token, every decode step).

The engine is llguidance (docs/ARCHITECTURE.md, "Structured outputs", says why it was picked):
the router turns the request's ``StructuredOutput`` into one llguidance grammar (a JSON text),
checks it against the checkpoint's tokenizer (an invalid schema or regex is INVALID_ARGUMENT
naming the problem) and sends it in ``ResolvedSampling.grammar``. Prefill and decode build a
``GrammarState`` from it and the answer so far: the matcher's state is a function of the grammar
and the tokens it consumed, so a request resumed on another worker (or replayed after a
preemption) masks its next token exactly as it would have where it began.

The mask is applied to the processed scores last (after ``logit_bias`` and the penalties, before
temperature / top-k / top-p), as vLLM's structured-output bitmask is; logprobs stay those of the
raw logits. Once the grammar is complete only an end-of-sequence token is allowed.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import torch

MAX_GRAMMAR_CHARS = 256 * 1024  # a schema, regex or grammar the client sends; and the compiled grammar
MAX_CHOICES = 1024


def _llg():
    import llguidance

    return llguidance


@functools.lru_cache(maxsize=4)
def tokenizer(model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """The checkpoint's tokenizer as llguidance reads it (built once per process: ~0.3 s for a
    250k vocabulary). ``vocab_size`` is the language model's (its logits' width), which may be
    larger than the tokenizer's; ids past the tokenizer's are never allowed."""
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        spec = json.load(f)
    return _llg().LLTokenizer(json.dumps(_without_text_tokens(spec)), n_vocab=vocab_size or None,
                              eos_token=list(eos_token_ids) or None)


def _without_text_tokens(spec: dict) -> dict:
    """The tokenizer as llguidance should read it. llguidance 1.9.1 takes every added token for a
    special one (allowed only by id), yet when a grammar forces text such as ``<tool_call>`` it
    tokenizes that text into the added token and then refuses the very token it allowed. So each
    non-special added token (Qwen's ``<think>``, ``</think>``, the tool-call markers) keeps its id
    under a name no text can produce: under a grammar the model writes those markers as ordinary
    text tokens (the same characters), and mask and matcher agree on every token."""
    for token in spec.get("added_tokens") or []:
        if not token.get("special"):
            token["content"] = f"<|\u0000epd-text-token-{token['id']}|>"
            token["special"] = True
    return spec


def tokenizer_for(info) -> object:
    """``tokenizer`` for a ``ModelInfo``."""
    return tokenizer(info.model_dir, info.vocab_size, tuple(sorted(info.eos_token_ids)))


def compile_structured(spec, llg_tokenizer) -> str:
    """A ``StructuredOutput`` message (epd.v1) as one llguidance grammar; "" when it sets nothing.
    Raises ValueError naming the problem (an invalid schema, regex or grammar)."""
    llg = _llg()
    matcher = llg.LLMatcher
    kind = spec.WhichOneof("kind")
    if kind is None:
        return ""
    if kind == "choice":
        values = list(spec.choice.values)
        if not values or len(values) > MAX_CHOICES:
            raise ValueError(f"structured output: choice must list 1 to {MAX_CHOICES} strings, got {len(values)}")
        if sum(len(v) for v in values) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured output: the choices are longer than {MAX_GRAMMAR_CHARS} characters")
        # One Lark alternative per choice, each a JSON string literal (Lark's string syntax).
        grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in values))
    else:
        text = getattr(spec, kind) if kind != "json_object" else ""
        if len(text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured output: the {kind} is {len(text)} characters, more than "
                             f"{MAX_GRAMMAR_CHARS}")
        if kind == "json_object":
            schema = {"type": "object"}
        elif kind == "json_schema":
            try:
                schema = json.loads(text)
            except ValueError as error:
                raise ValueError(f"structured output: json_schema is not valid JSON: {error}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured output: json_schema must be a JSON object (a JSON Schema)")
        if kind in ("json_object", "json_schema"):
            try:
                # Compact JSON (no free whitespace between tokens), as vLLM's disable-any-whitespace
                # option: a model cannot pad the answer with endless blanks.
                grammar = matcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
            except (ValueError, TypeError) as error:
                raise ValueError(f"structured output: invalid json_schema: {error}") from None
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(text)
        elif kind == "grammar":
            grammar = matcher.grammar_from_lark(text)
        else:  # a field this code does not know (a newer client)
            raise ValueError(f"structured output: {kind} is not supported by this server")
    error = matcher.validate_grammar(grammar, llg_tokenizer)
    if error:
        raise ValueError(f"structured output: invalid {kind.replace('_', ' ')}: {_short(error)}")
    if len(grammar) > 4 * MAX_GRAMMAR_CHARS:
        raise ValueError("structured output: the compiled grammar is too large")
    return grammar


def _short(message: str, limit: int = 500) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."


class GrammarState:
    """One request's matcher: which tokens may come next, given the grammar and the answer so far."""

    def __init__(self, llg_tokenizer, grammar: str, generated=()) -> None:
        """``generated``: the answer's tokens so far (a resumed request's), consumed in order.
        Raises ValueError when the grammar does not compile or those tokens do not match it."""
        llg = _llg()
        self.vocab_size = llg_tokenizer.vocab_size
        self._matcher = llg.LLMatcher(llg_tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"grammar: {_short(self._matcher.get_error())}")
        self._words = (self.vocab_size + 31) // 32
        self._bits = np.empty(self._words, dtype=np.int32)
        self.consumed = 0
        for token in generated:
            self.accept(token)

    def _compute(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._words * 4)

    def allowed(self) -> torch.Tensor:
        """A bool tensor ``[vocab_size]``: the tokens the grammar allows next."""
        self._compute()
        mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(mask.view(np.bool_))

    def apply(self, scores: torch.Tensor) -> None:
        """Set the scores of every token the grammar does not allow next to -inf, in place.

        On the CPU through numpy: one pass, single-threaded (torch's masked_fill over a 250k
        vocabulary took 10x longer on the 2-core machine, its thread pool contending with the
        forwards; docs/BENCHMARKS.md "Structured outputs")."""
        self._compute()
        width = min(scores.numel(), self.vocab_size)
        if scores.numel() > width:
            scores[width:] = float("-inf")
        if scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.is_contiguous():
            forbidden = np.unpackbits(np.invert(self._bits).view(np.uint8), bitorder="little")[:width]
            np.copyto(scores.numpy()[:width], -np.inf, where=forbidden.view(np.bool_))
            return
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:width].view(np.bool_)
        scores[:width].masked_fill_(~torch.from_numpy(allowed).to(scores.device), float("-inf"))

    def accept(self, token: int) -> None:
        """The sampled (or replayed) token; ValueError if the grammar does not allow it."""
        if self._matcher.is_stopped():  # complete and its end-of-sequence consumed: nothing more is checked
            self.consumed += 1
            return
        if not self._matcher.consume_token(int(token)):
            raise ValueError(f"grammar: token {token} at answer position {self.consumed} does not match the grammar"
                             f" ({_short(self._matcher.get_error())})")
        self.consumed += 1

    def is_complete(self) -> bool:
        return self._matcher.is_accepting()
