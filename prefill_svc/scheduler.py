"""Which waiting prompts run their next chunk in the next forward, and how long each chunk is:
bookkeeping only.

Every forward takes up to ``batch_tokens`` prompt tokens, as chunks of at most ``chunk_tokens``
from one or several prompts (so short prompts share a forward, like vLLM's token budget). Prompts
are taken shortest remaining first (a short prompt that arrives while a long one runs waits for at
most one forward), arrival order breaking ties; but a prompt that arrived ``max_wait_s`` or more
ago goes first, oldest first (aging: a steady stream of short prompts never starves a long one,
and a burst of long prompts finishes in arrival order rather than taking turns). Where
the runner cannot hand out a prompt's state in the middle of a chunk (``cut_at_stops``: a
tensor-parallel one), a chunk also ends at each of the prompt's snapshot points, where the engine
copies the state into the prefix cache; otherwise the forward cuts its mixing cores there itself
(``TextModelRunner.mixed_step``'s splits) and a prompt is not held back a forward for them. The
engine owns the tensors; this only counts tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class PromptProgress:
    """One prompt's place in the prefill: tokens ``[cursor, prompt_len)`` are still to run."""

    prompt_len: int
    cursor: int = 0  # first token not yet computed (a prefix-cache hit starts past 0)
    stops: Sequence[int] = ()  # token counts after which a chunk must end (snapshot points)
    arrival: int = field(default=0)
    arrived: float = 0.0  # when it joined the queue

    @property
    def remaining(self) -> int:
        return self.prompt_len - self.cursor

    @property
    def done(self) -> bool:
        return self.cursor >= self.prompt_len


class PrefillScheduler:
    def __init__(self, chunk_tokens: int, batch_tokens: int = 0, max_wait_s: float = float("inf"),
                 cut_at_stops: bool = True) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.cut_at_stops = cut_at_stops
        self.batch_tokens = max(batch_tokens, chunk_tokens)
        self.max_wait_s = max_wait_s
        self._waiting: list[PromptProgress] = []
        self._arrivals = itertools.count()

    def add(self, progress: PromptProgress, now: float = 0.0) -> None:
        if progress.done:
            raise ValueError("a prompt with nothing left to compute cannot be scheduled")
        progress.arrival = next(self._arrivals)
        progress.arrived = now
        self._waiting.append(progress)

    def remove(self, progress: PromptProgress) -> None:
        if progress in self._waiting:
            self._waiting.remove(progress)

    def __len__(self) -> int:
        return len(self._waiting)

    def remaining_tokens(self) -> int:
        """Prompt tokens still to compute, over every prompt waiting or part-way through."""
        return sum(p.remaining for p in self._waiting)

    def next_batch(self, now: float = 0.0, budget: int | None = None) -> list[tuple[PromptProgress, int]]:
        """The chunks of the next forward: (prompt, end of its chunk, exclusive), in run order.
        ``budget``: prompt tokens this forward has room for, when less than ``batch_tokens`` (an
        aggregated step's decode rows take their share of it); none at 0."""
        # Aged by arrival, not by when a chunk last ran: with forwards longer than max_wait_s,
        # waiting since the last chunk put every prompt that had not just run ahead of those that
        # had, so a burst of long prompts took turns chunk by chunk and all their first tokens
        # came at the end of the burst.
        starving = sorted((p for p in self._waiting if now - p.arrived >= self.max_wait_s), key=lambda p: p.arrival)
        rest = sorted((p for p in self._waiting if now - p.arrived < self.max_wait_s),
                      key=lambda p: (p.remaining, p.arrival))
        batch, budget = [], self.batch_tokens if budget is None else min(budget, self.batch_tokens)
        for progress in starving + rest:
            if budget <= 0:
                break
            end = self._chunk_end(progress, min(self.chunk_tokens, budget), self.cut_at_stops)
            batch.append((progress, end))
            budget -= end - progress.cursor
        return batch

    def next_chunk(self) -> tuple[PromptProgress, int] | None:
        """The first chunk of the next forward (a forward of one chunk)."""
        batch = self.next_batch()
        return batch[0] if batch else None

    @staticmethod
    def _chunk_end(progress: PromptProgress, tokens: int, cut_at_stops: bool = True) -> int:
        end = min(progress.cursor + tokens, progress.prompt_len)
        for stop in progress.stops if cut_at_stops else ():
            if progress.cursor < stop < end:
                return stop
        return end

    def advance(self, progress: PromptProgress, end: int) -> None:
        """Record that the chunk up to ``end`` ran; a finished prompt leaves the queue."""
        if not progress.cursor < end <= progress.prompt_len:
            raise ValueError(f"chunk end {end} outside ({progress.cursor}, {progress.prompt_len}]")
        progress.cursor = end
        if progress.done:
            self.remove(progress)
