"""The contract between a decode engine's step loop and prefill work that rides its steps.

Where prefill and decode share one device they can run as one engine: each step takes every
running decode row plus prefill chunks up to a token budget and runs them in one forward
(``TextModelRunner.mixed_step``), so decode steps do not wait behind whole prefill forwards in
another process and the two share one pass over the weights (vLLM's scheduler does the same
under ``max_num_batched_tokens``). The decode engine owns the loop; a ``ChunkSource`` (the
prefill engine of the same process, ``prefill_svc.engine.PrefillEngine`` without its own thread)
says what rides each step and takes the results. Neither role imports the other: both meet here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from epd.lm import HybridState, StepOutput


@dataclass
class PlannedChunks:
    """The prefill part of one step, as ``TextModelRunner.mixed_step`` takes it; ``ticket`` is the
    source's own record of what it planned (what ``ChunkSource.chunks_ran`` gets back)."""

    chunks: list[tuple[torch.Tensor, torch.Tensor, HybridState]]
    sample_chunks: frozenset[int]  # chunks whose prompt ends with them: their last row's logits are wanted
    every_row: frozenset[int]  # chunks whose every row's hidden state is wanted (prompt logprobs)
    ticket: object
    splits: dict[int, list[int]] = field(default_factory=dict)  # chunk -> offsets whose state is wanted (snapshots)

    @property
    def num_tokens(self) -> int:
        return sum(embeds.shape[0] for embeds, _, _ in self.chunks)


class ChunkSource(Protocol):
    def attach(self, wake: Callable[[], None]) -> None:
        """``wake()`` is to be called (holding none of the source's locks) when work arrives."""

    def has_chunks(self) -> bool:
        """Whether a prompt waits for a chunk (the loop does not sleep while one does)."""

    def take_chunks(self, num_decode_rows: int) -> PlannedChunks | None:
        """The chunks of the next step, which also carries ``num_decode_rows`` decode rows (the
        source sizes its chunks to its token budget less those); None when nothing rides it."""

    def chunks_ran(self, planned: PlannedChunks, out: StepOutput | None, error: BaseException | None) -> None:
        """The step ran (``out``), or failed (``error``: the planned prompts fail with it)."""
