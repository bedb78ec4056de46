"""The prefill worker's two caches: vision embeddings (the in-process tier in front of Redis) and
prompt prefixes (hybrid-model state snapshots at block boundaries).

Both are bounded in bytes, least recently used out first. The bookkeeping (hashing, which
boundary to snapshot, what to evict) is plain Python; the only tensors held are the values
themselves, and a snapshot is copied on the way in and on the way out so no request can change
what another one reads. Prefix snapshots share their K/V blocks (``PrefixCache``).

Prefix keys (``epd.prefix``) are a chained sha256 over fixed-size blocks of prompt tokens and the
images' content keys; the router computes the same keys to route a request to the replica holding
its prefix, from the summary each replica reports (``PrefixCache.summary``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from epd.lm import HybridState
from epd.prefix import KeyedImage, encode_summary, lookup_blocks, prefix_block_hashes  # noqa: F401 - re-exported

V = TypeVar("V")


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    num_entries: int
    num_bytes: int
    capacity_bytes: int


class ByteLRU(Generic[V]):
    """A thread-safe LRU map whose values have a size in bytes; the total never exceeds the
    capacity (a value larger than the whole capacity is not stored at all)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._num_bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable, count: bool = True) -> V | None:
        """The value (now most recently used) or None; ``count`` adds the outcome to the hit rate."""
        with self._lock:
            entry = self._entries.get(key)
            if count:
                self._hits += entry is not None
                self._misses += entry is None
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def record(self, hit: bool) -> None:
        """Count one lookup made of several uncounted ``get`` calls."""
        with self._lock:
            self._hits += hit
            self._misses += not hit

    def put(self, key: Hashable, value: V, num_bytes: int) -> bool:
        """Insert or refresh ``key``; returns False when the value can never fit."""
        if num_bytes > self.capacity_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._num_bytes -= old[1]
            while self._entries and self._num_bytes + num_bytes > self.capacity_bytes:
                _, (_, size) = self._entries.popitem(last=False)
                self._num_bytes -= size
                self._evictions += 1
            self._entries[key] = (value, num_bytes)
            self._num_bytes += num_bytes
            return True

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, self._evictions, len(self._entries), self._num_bytes,
                              self.capacity_bytes)


# ---------------------------------------------------------------- prefix keys (epd.prefix)


def snapshot_points(prompt_len: int, block_size: int, every_blocks: int, last_turn_start: int | None = None) -> list[int]:
    """Where a prompt's state is kept, as token counts (sorted, unique, > 0): every
    ``every_blocks`` blocks, the last full block, and the last block edge at or before
    ``last_turn_start`` (where the assistant's generation prompt begins: a follow-up turn of the
    conversation repeats everything before it, but renders the generation prompt differently)."""
    last = prompt_len // block_size * block_size
    points = set(range(every_blocks * block_size, last + 1, every_blocks * block_size)) if every_blocks else set()
    points.add(last)
    if last_turn_start is not None:
        points.add(min(last_turn_start, prompt_len) // block_size * block_size)
    points.discard(0)
    return sorted(points)


# ---------------------------------------------------------------- state snapshots


class PrefixCache:
    """Prompt-prefix snapshots keyed by chained block hash, bounded in bytes, LRU, sharing blocks.

    A snapshot at ``n`` blocks is the full-attention K/V of those blocks plus the linear-attention
    state (conv window, recurrent state) at the boundary. The K/V is kept per block, by block hash,
    with a count of the snapshots that use it: the snapshots of one conversation (every few blocks,
    each turn's end) share every block they have in common, so a conversation costs its K/V once
    plus one linear state per snapshot. The byte bound covers blocks and linear states together; an
    insert first works out what it would add (only its blocks not held yet) and evicts least
    recently used snapshots until that fits, and copies nothing when it cannot fit at all."""

    def __init__(self, capacity_bytes: int, block_size: int, every_blocks: int) -> None:
        self.block_size = block_size
        self.every_blocks = every_blocks
        self.capacity_bytes = capacity_bytes
        self._snapshots: OrderedDict[bytes, _Snapshot] = OrderedDict()  # by the last block's hash, LRU first
        self._blocks: dict[bytes, _Block] = {}
        self._num_bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._lookup_tokens = 0
        self._hit_tokens = 0
        self._lock = threading.Lock()

    def lookup(self, hashes: Sequence[bytes], prompt_len: int) -> tuple[int, HybridState | None]:
        """The longest cached prefix that leaves at least one token to compute (the first token's
        logits need one): ``(num_tokens, a private copy of its state)`` or ``(0, None)``."""
        with self._lock:
            found_len, parts = 0, None
            for block in lookup_blocks(len(hashes), prompt_len, self.block_size):
                snapshot = self._snapshots.get(hashes[block - 1])
                if snapshot is not None:
                    self._snapshots.move_to_end(hashes[block - 1])
                    found_len = block * self.block_size
                    parts = (snapshot, [self._blocks[h] for h in hashes[:block]])
                    break
            self._hits += parts is not None
            self._misses += parts is None
            self._lookup_tokens += prompt_len
            self._hit_tokens += found_len
        if parts is None:
            return 0, None
        return found_len, _assemble(*parts, found_len)  # tensors are never changed once held: no lock needed

    def insert(self, block_hashes: Sequence[bytes], state: HybridState) -> bool:
        """Keep ``state`` (holding ``len(block_hashes)`` whole blocks) as the snapshot named by
        its last block's hash. Returns whether it is held now."""
        if not block_hashes or state.num_tokens != len(block_hashes) * self.block_size:
            raise ValueError(f"a snapshot of {state.num_tokens} tokens is not {len(block_hashes)} whole blocks "
                             f"of {self.block_size}")
        key = block_hashes[-1]
        block_bytes = _kv_bytes(state) // len(block_hashes)
        linear_bytes = _linear_bytes(state)
        with self._lock:
            if key in self._snapshots:
                self._snapshots.move_to_end(key)
                return True
            while True:
                new = [h for h in block_hashes if h not in self._blocks]
                cost = linear_bytes + len(new) * block_bytes
                if self._num_bytes + cost <= self.capacity_bytes:
                    break
                if not self._snapshots:
                    return False  # bigger than the whole cache: nothing was copied
                self._evict_oldest()
            # Only now, with room made, copy what is new: the linear state and the new blocks.
            new_set = set(new)
            for index, block_hash in enumerate(block_hashes):
                if block_hash in new_set:
                    self._blocks[block_hash] = _Block(_slice_block(state, index, self.block_size), block_bytes)
                    new_set.discard(block_hash)
                self._blocks[block_hash].users += 1
            self._snapshots[key] = _Snapshot(list(block_hashes), _linear_copy(state), linear_bytes, len(state.keys))
            self._num_bytes += cost
            return True

    def summary(self) -> bytes:
        """What this cache holds, compactly (``epd.prefix.encode_summary``): its snapshots' keys,
        most recently used first; the router routes on it."""
        with self._lock:
            keys = list(reversed(self._snapshots))
        return encode_summary(keys)

    def wants(self, block_hash: bytes) -> bool:
        with self._lock:
            return self.capacity_bytes > 0 and block_hash not in self._snapshots

    def _evict_oldest(self) -> None:
        _, snapshot = self._snapshots.popitem(last=False)
        self._evictions += 1
        self._num_bytes -= snapshot.linear_bytes
        for block_hash in snapshot.block_hashes:
            block = self._blocks[block_hash]
            block.users -= 1
            if block.users == 0:
                del self._blocks[block_hash]
                self._num_bytes -= block.num_bytes

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, self._evictions, len(self._snapshots), self._num_bytes,
                              self.capacity_bytes)

    def num_blocks(self) -> int:
        """K/V blocks held (each shared by every snapshot that covers it)."""
        with self._lock:
            return len(self._blocks)

    def token_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up, of those served from the cache) since start."""
        with self._lock:
            return self._lookup_tokens, self._hit_tokens


@dataclass
class _Block:
    """One block's full-attention K/V: ``(layer, keys, values)`` for each full-attention layer,
    ``[1, kv_heads, block_size, head_dim]``."""

    kv: list[tuple[int, object, object]]
    num_bytes: int
    users: int = 0


@dataclass
class _Snapshot:
    block_hashes: list[bytes]
    linear: dict[str, object]  # "conv.L" / "recurrent.L" -> tensor at the boundary
    linear_bytes: int
    num_layers: int


def _kv_bytes(state: HybridState) -> int:
    return sum(t.numel() * t.element_size() for t in (*state.keys, *state.values) if t is not None)


def _linear_bytes(state: HybridState) -> int:
    return sum(t.numel() * t.element_size() for t in (*state.conv, *state.recurrent) if t is not None)


def _slice_block(state: HybridState, index: int, block_size: int) -> list:
    part = slice(index * block_size, (index + 1) * block_size)
    return [(layer, keys[:, :, part].clone(), state.values[layer][:, :, part].clone())
            for layer, keys in enumerate(state.keys) if keys is not None]


def _linear_copy(state: HybridState) -> dict[str, object]:
    return {name: tensor.clone() for name, tensor in state.named_tensors() if name.startswith(("conv.", "recurrent."))}


def _assemble(snapshot: _Snapshot, blocks: list[_Block], num_tokens: int) -> HybridState:
    """A new state (tensors of its own) from a snapshot's blocks and linear state."""
    tensors = {name: tensor.clone() for name, tensor in snapshot.linear.items()}
    for position, (layer, _, _) in enumerate(blocks[0].kv):
        tensors[f"keys.{layer}"] = torch.cat([block.kv[position][1] for block in blocks], dim=2)
        tensors[f"values.{layer}"] = torch.cat([block.kv[position][2] for block in blocks], dim=2)
    return HybridState.from_named_tensors(snapshot.num_layers, num_tokens, tensors)
