"""The decode batch's tensors: every decoding request's state in shared slot buffers.

``DecodeBatch`` owns storage only; which request sits in which slot is ``DecodeScheduler``'s
bookkeeping, and this class does what it is told: copy a state into the next slot, move a slot
onto another, drop the trailing slots. ``TextModelRunner.decode_step`` runs one batched step over it.
"""

from __future__ import annotations

import torch

from epd.lm import HybridState, TextModelRunner


class DecodeBatch:
    """Many requests' decode state in shared buffers, one slot per request, slots 0..len-1 in use.

    Full-attention layers keep ``[capacity, kv_heads, max_len, head_dim]`` K/V buffers; a slot's
    tokens fill the front of its row and the rest is masked out. Linear-attention layers keep the
    conv and recurrent states stacked ``[capacity, ...]``, so the active slots are always the
    leading rows of every buffer (a view, never a copy). Buffers grow by doubling and are dropped
    when the batch empties.
    """

    _LEN_ALIGN = 64

    def __init__(self, runner: TextModelRunner) -> None:
        self.runner = runner
        self.lengths: list[int] = []
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.conv: list[torch.Tensor | None] = []
        self.recurrent: list[torch.Tensor | None] = []
        self._capacity = 0
        self._max_len = 0

    def __len__(self) -> int:
        return len(self.lengths)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @torch.inference_mode()
    def add(self, state: HybridState) -> int:
        """Copy ``state`` into a new slot (the next one); returns its index.

        The state is checked against the model first (``TextModelRunner.check_state``), so a
        corrupt or forged handoff is refused before any buffer is sized from it; a failed add
        leaves the batch as it was."""
        self.runner.check_state(state)
        if not self.lengths:
            self._allocate(state, capacity=4, max_len=state.num_tokens + self._LEN_ALIGN)
        slot = len(self.lengths)
        if slot == self._capacity:
            self._grow(capacity=self._capacity * 2)
        if state.num_tokens + 1 > self._max_len:
            self._grow(max_len=state.num_tokens + self._LEN_ALIGN)
        length = state.num_tokens
        for layer in range(self.runner.num_layers):
            if self.keys[layer] is not None:
                self.keys[layer][slot, :, :length] = state.keys[layer][0]
                self.values[layer][slot, :, :length] = state.values[layer][0]
            else:
                self.conv[layer][slot] = state.conv[layer][0]
                self.recurrent[layer][slot] = state.recurrent[layer][0]
        self.lengths.append(length)
        return slot

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s state over slot ``dst`` (``dst`` is being freed)."""
        for tensor in self._tensors():
            tensor[dst] = tensor[src]
        self.lengths[dst] = self.lengths[src]

    def truncate(self, size: int) -> None:
        """Keep slots ``0..size-1``; the buffers are freed when nothing is left."""
        if not 0 <= size <= len(self.lengths):
            raise IndexError(f"cannot truncate a batch of {len(self.lengths)} to {size}")
        del self.lengths[size:]
        if not self.lengths:
            self._release()

    @torch.inference_mode()
    def state_of(self, slot: int) -> HybridState:
        """A copy of one slot's state as a standalone HybridState (tests and debugging)."""
        length = self.lengths[slot]
        state = HybridState.empty(self.runner.num_layers)
        state.num_tokens = length
        for layer in range(self.runner.num_layers):
            if self.keys[layer] is not None:
                state.keys[layer] = self.keys[layer][slot : slot + 1, :, :length].clone()
                state.values[layer] = self.values[layer][slot : slot + 1, :, :length].clone()
            else:
                state.conv[layer] = self.conv[layer][slot : slot + 1].clone()
                state.recurrent[layer] = self.recurrent[layer][slot : slot + 1].clone()
        return state

    # ------------------------------------------------------------ used by decode_step (epd.lm.BatchBuffers)

    @torch.inference_mode()
    def reserve(self, extra: int) -> None:
        needed = max(self.lengths) + extra
        if needed > self._max_len:
            self._grow(max_len=needed)

    def lengths_tensor(self) -> torch.Tensor:
        return torch.tensor(self.lengths, dtype=torch.long, device=self.runner.device)

    def advance(self) -> None:
        self.lengths = [length + 1 for length in self.lengths]

    # ------------------------------------------------------------ buffers

    def _tensors(self) -> list[torch.Tensor]:
        return [t for group in (self.keys, self.values, self.conv, self.recurrent) for t in group if t is not None]

    def _allocate(self, like: HybridState, capacity: int, max_len: int) -> None:
        max_len = self._align(max_len)
        num_layers = self.runner.num_layers
        keys, values, conv, recurrent = ([None] * num_layers for _ in range(4))
        for layer in range(num_layers):
            if like.keys[layer] is not None:
                _, heads, _, dim = like.keys[layer].shape
                keys[layer] = like.keys[layer].new_zeros(capacity, heads, max_len, dim)
                values[layer] = like.values[layer].new_zeros(capacity, heads, max_len, dim)
            else:
                conv[layer] = like.conv[layer].new_zeros(capacity, *like.conv[layer].shape[1:])
                # float32 whatever the model dtype, as transformers' recurrent rule keeps it
                recurrent[layer] = like.recurrent[layer].new_zeros(
                    capacity, *like.recurrent[layer].shape[1:], dtype=torch.float32)
        self.keys, self.values, self.conv, self.recurrent = keys, values, conv, recurrent
        self._capacity, self._max_len = capacity, max_len

    def _grow(self, capacity: int | None = None, max_len: int | None = None) -> None:
        """Bigger buffers, built completely before any replaces the old ones: an allocation that
        fails part-way leaves every layer as it was."""
        new_capacity = max(capacity or 0, self._capacity)
        new_len = self._max_len
        if max_len is not None and max_len > self._max_len:
            new_len = self._align(max(max_len, self._max_len * 2))
        used = len(self.lengths)
        grown: dict[str, list[torch.Tensor | None]] = {}
        for kind in ("keys", "values"):
            grown[kind] = []
            for tensor in getattr(self, kind):
                if tensor is None:
                    grown[kind].append(None)
                    continue
                bigger = tensor.new_zeros(new_capacity, tensor.shape[1], new_len, tensor.shape[3])
                bigger[:used, :, : self._max_len] = tensor[:used]
                grown[kind].append(bigger)
        for kind in ("conv", "recurrent"):
            grown[kind] = []
            for tensor in getattr(self, kind):
                if tensor is None or new_capacity == self._capacity:
                    grown[kind].append(tensor)
                    continue
                bigger = tensor.new_zeros(new_capacity, *tensor.shape[1:])
                bigger[:used] = tensor[:used]
                grown[kind].append(bigger)
        for kind, tensors in grown.items():
            setattr(self, kind, tensors)
        self._capacity, self._max_len = new_capacity, new_len

    def _release(self) -> None:
        self.keys, self.values, self.conv, self.recurrent = [], [], [], []
        self._capacity = self._max_len = 0

    @classmethod
    def _align(cls, length: int) -> int:
        return -(-length // cls._LEN_ALIGN) * cls._LEN_ALIGN
