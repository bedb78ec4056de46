"""The prefill worker's two caches: vision embeddings (the in-process tier in front of Redis) and
prompt prefixes (hybrid-model state snapshots at block boundaries).

Both are ``ByteLRU``s: bounded in bytes, least recently used out first. The bookkeeping (hashing,
which boundary to snapshot, what to evict) is plain Python; the only tensors held are the
values themselves, and a snapshot is copied on the way in and on the way out so no request can
change what another one reads.

Prefix keys are a chained sha256 over fixed-size blocks of prompt tokens. The root carries the
model fingerprint, the block size and the request's cache salt (if any); each block adds its token ids and, for every image
overlapping the block, that image's store key (which already hashes the image bytes, the
processor settings and the model) with its start index. Image placeholder tokens are the same
for every image, so keying on tokens alone would serve one image's state to another.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from epd.lm import HybridState
from epd.positions import ImageSpan

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


# ---------------------------------------------------------------- prefix keys


@dataclass(frozen=True)
class KeyedImage:
    """An image's place in the prompt and the store key that names its content."""

    span: ImageSpan
    store_key: str


def prefix_block_hashes(token_ids: Sequence[int], images: Sequence[KeyedImage], block_size: int,
                        model_fingerprint: str, salt: str = "") -> list[bytes]:
    """One chained hash per *full* block: ``hashes[i]`` names the prefix ``token_ids[:(i+1)*block_size]``.
    A ``salt`` (the request's ``cache_salt``) goes into the root: only requests with the same salt
    share entries."""
    root = f"epd-prefix-v1\0{model_fingerprint}\0{block_size}"
    if salt:
        root += f"\0salt\0{len(salt)}\0{salt}"
    digest = hashlib.sha256(root.encode()).digest()
    hashes: list[bytes] = []
    for block in range(len(token_ids) // block_size):
        start, end = block * block_size, (block + 1) * block_size
        h = hashlib.sha256(digest)
        h.update(struct.pack(f"<{block_size}i", *token_ids[start:end]))
        for image in images:
            if image.span.start < end and image.span.end > start:
                h.update(f"\0img\0{image.span.start}\0{image.store_key}".encode())
        digest = h.digest()
        hashes.append(digest)
    return hashes


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
    """Prompt-prefix snapshots keyed by chained block hash, bounded in bytes, LRU."""

    def __init__(self, capacity_bytes: int, block_size: int, every_blocks: int) -> None:
        self.block_size = block_size
        self.every_blocks = every_blocks
        self._lru: ByteLRU[HybridState] = ByteLRU(capacity_bytes)
        self._lookup_tokens = 0
        self._hit_tokens = 0
        self._lock = threading.Lock()

    def lookup(self, hashes: Sequence[bytes], prompt_len: int) -> tuple[int, HybridState | None]:
        """The longest cached prefix that leaves at least one token to compute (the first token's
        logits need one): ``(num_tokens, a private copy of its state)`` or ``(0, None)``."""
        found_len, found = 0, None
        for block in range(min(len(hashes), (prompt_len - 1) // self.block_size), 0, -1):
            state = self._lru.get(hashes[block - 1], count=False)
            if state is not None:
                found_len, found = block * self.block_size, state.clone()
                break
        self._lru.record(hit=found is not None)
        with self._lock:
            self._lookup_tokens += prompt_len
            self._hit_tokens += found_len
        return found_len, found

    def insert(self, block_hash: bytes, state: HybridState) -> None:
        if block_hash in self._lru:
            self._lru.get(block_hash, count=False)  # refresh its place in the LRU order
            return
        self._lru.put(block_hash, state.clone(), state.nbytes())

    def wants(self, block_hash: bytes) -> bool:
        return self._lru.capacity_bytes > 0 and block_hash not in self._lru

    def stats(self) -> CacheStats:
        return self._lru.stats()

    def token_counts(self) -> tuple[int, int]:
        """(prompt tokens looked up, of those served from the cache) since start."""
        with self._lock:
            return self._lookup_tokens, self._hit_tokens
