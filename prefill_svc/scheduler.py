"""Which waiting prompt runs its next chunk, and how long that chunk is: bookkeeping only.

Prompts are prefilled in chunks of at most ``chunk_tokens``. Between chunks the prompt with the
fewest tokens left goes next (shortest remaining first; arrival order breaks ties), so a short
prompt that arrives while a long one is running waits for at most one chunk instead of the whole
long prompt. A chunk also ends at each of the prompt's snapshot points, where the engine copies
the state into the prefix cache. The engine owns the tensors; this only counts tokens.
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

    @property
    def remaining(self) -> int:
        return self.prompt_len - self.cursor

    @property
    def done(self) -> bool:
        return self.cursor >= self.prompt_len


class PrefillScheduler:
    def __init__(self, chunk_tokens: int) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self._waiting: list[PromptProgress] = []
        self._arrivals = itertools.count()

    def add(self, progress: PromptProgress) -> None:
        if progress.done:
            raise ValueError("a prompt with nothing left to compute cannot be scheduled")
        progress.arrival = next(self._arrivals)
        self._waiting.append(progress)

    def remove(self, progress: PromptProgress) -> None:
        if progress in self._waiting:
            self._waiting.remove(progress)

    def __len__(self) -> int:
        return len(self._waiting)

    def next_chunk(self) -> tuple[PromptProgress, int] | None:
        """The prompt to run next and the end (exclusive token index) of its chunk."""
        if not self._waiting:
            return None
        progress = min(self._waiting, key=lambda p: (p.remaining, p.arrival))
        end = min(progress.cursor + self.chunk_tokens, progress.prompt_len)
        for stop in progress.stops:
            if progress.cursor < stop < end:
                end = stop
                break
        return progress, end

    def advance(self, progress: PromptProgress, end: int) -> None:
        """Record that the chunk up to ``end`` ran; a finished prompt leaves the queue."""
        if not progress.cursor < end <= progress.prompt_len:
            raise ValueError(f"chunk end {end} outside ({progress.cursor}, {progress.prompt_len}]")
        progress.cursor = end
        if progress.done:
            self.remove(progress)
