"""The decode batch's tensors: paged K/V and per-slot linear-attention state, allocated once.

``DecodeBatch`` owns storage only; which request sits in which slot, and which K/V blocks it
holds, is ``DecodeScheduler``'s bookkeeping (with a ``BlockPool``), and this class does what it is
told: copy a state into the next slot and its blocks, move a slot onto another, drop the trailing
slots. ``TextModelRunner.decode_step`` runs one batched step over it.

Memory (docs/ARCHITECTURE.md, "The memory model"):
- full-attention K/V: per layer one pool ``[num_blocks * block_size, kv_heads, head_dim]`` of
  token rows; a slot's block table maps its token ``t`` to row ``table[t // block_size] *
  block_size + t % block_size``. Nothing here is sized by the longest request: a 100k-token
  request holds 100k tokens' rows, the others their own.
- Gated DeltaNet conv and recurrent state: fixed-size per request, so per layer one buffer
  ``[max_slots, ...]``; the active slots are the leading rows (a view, never a copy).
Both are allocated with ``torch.empty`` (pages are touched as they are first written), so the
process grows to the budget with use, never past it. Attention reads exactly a slot's own rows
(``attend``): one view of the pool when its table is one run of consecutive blocks (what
``BlockPool`` placement aims for), the runs joined (a copy of that slot's rows) otherwise; no
row past a slot's length is ever read, so blocks need no clearing.
"""

from __future__ import annotations

import torch

from decode_svc.blocks import BlockPool
from epd import kernels
from epd.lm import HybridState, TextModelRunner


class DecodeBatch:
    """Many requests' decode state, one slot per request, slots ``0..len-1`` in use."""

    def __init__(self, runner: TextModelRunner, max_slots: int = 32, pool: BlockPool | None = None,
                 kv_tokens: int = 0, block_size: int = 16) -> None:
        """``pool``: the allocator whose ids index this batch's K/V (the scheduler shares it);
        without one, a private pool of ``kv_tokens`` tokens (default: 2048 per slot), which
        ``add`` and ``reserve`` draw on themselves (tests and benchmarks)."""
        self.runner = runner
        self.max_slots = max_slots
        self.pool = pool or BlockPool(-(-(kv_tokens or 2048 * max_slots) // block_size), block_size)
        self._own_pool = pool is None
        self.block_size = self.pool.block_size
        self.lengths: list[int] = []
        self.tables: list[list[int]] = []  # slot -> block ids (the scheduler's lists, shared)
        rows = self.pool.num_blocks * self.block_size
        self.keys: list[torch.Tensor | None] = [None] * runner.num_layers  # [rows, kv_heads, head_dim]
        self.values: list[torch.Tensor | None] = [None] * runner.num_layers
        # [max_slots, kernel, conv_dim]: time-major (kernels.causal_conv1d_step), a state's [1, conv_dim, kernel]
        # transposed on the way in and out
        self.conv: list[torch.Tensor | None] = [None] * runner.num_layers
        self.recurrent: list[torch.Tensor | None] = [None] * runner.num_layers  # [max_slots, v_heads, k, v] float32
        device = runner.device
        for name, shape in runner.state_shapes(1).items():
            kind, layer = name.split(".")
            layer = int(layer)
            dtype = runner.state_dtype(name)
            if kind in ("keys", "values"):
                _, heads, _, dim = shape
                getattr(self, kind)[layer] = torch.empty(rows, heads, dim, dtype=dtype, device=device)
            elif kind == "conv":
                _, channels, kernel = shape
                self.conv[layer] = torch.empty(max_slots, kernel, channels, dtype=dtype, device=device)
            else:
                getattr(self, kind)[layer] = torch.empty(max_slots, *shape[1:], dtype=dtype, device=device)
        self._step: _StepIndex | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.recurrent) if t is not None)

    def nbytes(self) -> int:
        return self.kv_bytes() + self.slot_bytes()

    @torch.inference_mode()
    def add(self, state: HybridState, blocks: list[int] | None = None) -> int:
        """Copy ``state`` into the next slot; its K/V goes into ``blocks`` (which must hold the
        state's tokens; with a private pool they are taken here). Returns the slot.

        The state is checked against the model first (``TextModelRunner.check_state``), so a
        corrupt or forged handoff is refused before anything is written; a failed add leaves the
        batch as it was."""
        self.runner.check_state(state)
        if len(self.lengths) >= self.max_slots:
            raise ValueError(f"the decode batch has all {self.max_slots} slots in use")
        length = state.num_tokens
        if blocks is None:
            blocks = self.pool.allocate(self.pool.blocks_for(length + 1))
        if len(blocks) * self.block_size < length:
            raise ValueError(f"{len(blocks)} K/V blocks cannot hold a {length}-token state")
        self._step = None
        slot = len(self.lengths)
        rows = self._rows(blocks, 0, length)
        for layer in range(self.runner.num_layers):
            if self.keys[layer] is not None:
                for pool, src in ((self.keys[layer], state.keys[layer]), (self.values[layer], state.values[layer])):
                    pool.index_copy_(0, rows, src[0].transpose(0, 1))
            else:
                self.conv[layer][slot] = state.conv[layer][0].t()
                self.recurrent[layer][slot] = state.recurrent[layer][0]
        self.lengths.append(length)
        self.tables.append(blocks)
        return slot

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Slot ``src``'s request takes slot ``dst`` (being freed): its linear state is copied, its
        K/V stays where it is (only the block table moves)."""
        self._step = None
        for group in (self.conv, self.recurrent):
            for tensor in group:
                if tensor is not None:
                    tensor[dst] = tensor[src]
        if self._own_pool:
            self.pool.free(self.tables[dst])
        self.lengths[dst] = self.lengths[src]
        self.tables[dst], self.tables[src] = self.tables[src], []

    def truncate(self, size: int) -> None:
        """Keep slots ``0..size-1``. With a private pool the dropped slots' blocks go back to it."""
        if not 0 <= size <= len(self.lengths):
            raise IndexError(f"cannot truncate a batch of {len(self.lengths)} to {size}")
        self._step = None
        if self._own_pool:
            for table in self.tables[size:]:
                self.pool.free(table)
        del self.lengths[size:]
        del self.tables[size:]

    @torch.inference_mode()
    def state_of(self, slot: int, blocks: list[int] | None = None, length: int | None = None) -> HybridState:
        """A copy of one slot's state as a standalone HybridState: what a swapped-out request keeps
        (then ``blocks`` and ``length`` are what it held: its table is already back in the pool)."""
        length = self.lengths[slot] if length is None else length
        rows = self._rows(self.tables[slot] if blocks is None else blocks, 0, length)
        state = HybridState.empty(self.runner.num_layers)
        state.num_tokens = length
        for layer in range(self.runner.num_layers):
            if self.keys[layer] is not None:
                state.keys[layer] = self.keys[layer].index_select(0, rows).transpose(0, 1).unsqueeze(0).contiguous()
                state.values[layer] = self.values[layer].index_select(0, rows).transpose(0, 1).unsqueeze(0).contiguous()
            else:
                state.conv[layer] = self.conv[layer][slot].t().unsqueeze(0).contiguous()
                state.recurrent[layer] = self.recurrent[layer][slot : slot + 1].clone()
        return state

    # ------------------------------------------------------------ used by decode_step (epd.lm.BatchBuffers)

    def reserve(self, extra: int) -> None:
        """Make sure every slot's table holds its next ``extra`` tokens. The scheduler gives each
        running request the block its next token needs before a step; with a private pool the
        batch takes it here."""
        for slot, length in enumerate(self.lengths):
            table = self.tables[slot]
            need = self.pool.blocks_for(length + extra)
            if need > len(table):
                if not self._own_pool:
                    raise RuntimeError(f"slot {slot} holds {len(table)} K/V blocks; its next token needs {need}")
                table.extend(self.pool.allocate(need - len(table), after=table[-1] if table else None))
                self._step = None

    def lengths_tensor(self) -> torch.Tensor:
        return torch.tensor(self.lengths, dtype=torch.long, device=self.runner.device)

    def advance(self) -> None:
        self.lengths = [length + 1 for length in self.lengths]
        self._step = None

    @torch.inference_mode()
    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """One decode step of full-attention layer ``layer``: store each slot's new ``key``/``value``
        (``[slots, kv_heads, 1, head_dim]``) at its length, then attend each slot's ``query``
        (``[slots, heads, 1, head_dim]``, rotated) over its own tokens. Returns ``[slots, heads, 1,
        head_dim]``."""
        step = self._step_index()
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(0, step.write, key[:, :, 0])
        values.index_copy_(0, step.write, value[:, :, 0])
        if kernels.can_attend_paged(query, keys):  # every slot in one C++ call, reading the pool in place
            return kernels.paged_decode_attention(query, keys, values, step.flat_runs(), step.offsets(), scale)
        outs = [kernels.decode_attention(query[slot : slot + 1], _rows_of(keys, runs), _rows_of(values, runs), scale)
                for slot, runs in enumerate(step.runs)]
        return torch.cat(outs)

    def paged(self, layer: int) -> tuple[torch.Tensor, ...]:
        """What a fused kernel needs to store this step's K/V of full-attention layer ``layer`` and
        attend in place (``kernels.attention_decode_inputs``, ``kernels.paged_decode_attention``):
        the pools ``keys``, ``values`` ``[rows, kv_heads, dim]``, the row each slot writes
        ``[slots]``, every slot's row runs ``[R, 2]`` (its tokens and the new one) and their offsets
        ``[slots + 1]``."""
        step = self._step_index()
        return self.keys[layer], self.values[layer], step.write, step.flat_runs(), step.offsets()

    # ------------------------------------------------------------ rows

    def _step_index(self) -> _StepIndex:
        """The rows this step writes, and the runs of rows each slot reads (its tokens and the new
        one), computed once per step (shared by every layer)."""
        if self._step is not None:
            return self._step
        bs, write, runs = self.block_size, [], []
        for blocks, length in zip(self.tables, self.lengths):
            write.append(blocks[length // bs] * bs + length % bs)
            slot_runs: list[tuple[int, int]] = []
            for block in blocks[: length // bs + 1]:
                if slot_runs and slot_runs[-1][1] == block * bs:
                    slot_runs[-1] = (slot_runs[-1][0], (block + 1) * bs)
                else:
                    slot_runs.append((block * bs, (block + 1) * bs))
            start, stop = slot_runs[-1]
            slot_runs[-1] = (start, stop - bs + length % bs + 1)  # the last block up to the new token
            runs.append(slot_runs)
        self._step = _StepIndex(torch.tensor(write, dtype=torch.long, device=self.runner.device), runs)
        return self._step

    def _rows(self, blocks: list[int], start: int, stop: int) -> torch.Tensor:
        """Pool rows of tokens ``start..stop-1`` of a slot holding ``blocks``."""
        bs = self.block_size
        table = torch.tensor(blocks[: -(-stop // bs)], dtype=torch.long)
        rows = (table[:, None] * bs + torch.arange(bs)).flatten()[start:stop]
        return rows.to(self.runner.device)


def _rows_of(pool: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """``pool``'s rows over ``runs``: a view for one run, a copy joining them otherwise."""
    if len(runs) == 1:
        start, stop = runs[0]
        return pool[start:stop]
    return torch.cat([pool[start:stop] for start, stop in runs])


class _StepIndex:
    __slots__ = ("write", "runs", "_flat")

    def __init__(self, write: torch.Tensor, runs: list[list[tuple[int, int]]]) -> None:
        self.write, self.runs = write, runs
        self._flat: tuple[torch.Tensor, torch.Tensor] | None = None

    def flat_runs(self) -> torch.Tensor:
        """Every slot's runs as one ``[R, 2]`` int64 tensor of (start, stop) pool rows, in slot order."""
        return self._tensors()[0]

    def offsets(self) -> torch.Tensor:
        """``[slots + 1]``: slot ``s`` owns ``flat_runs()[offsets[s]:offsets[s + 1]]``."""
        return self._tensors()[1]

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._flat is None:
            counts = [0] + [len(runs) for runs in self.runs]
            self._flat = (torch.tensor([run for runs in self.runs for run in runs], dtype=torch.long),
                          torch.tensor(counts, dtype=torch.long).cumsum(0))
        return self._flat
