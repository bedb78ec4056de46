"""The embedding store: vision embeddings in Redis, keyed by image content and model.

Key: ``epd:emb:v1:<model-fingerprint>:<image-key>`` where the image key is a sha256 over the image
bytes and every processor setting that changes the pixels (``epd.imaging.image_key``). Value: a
small binary header (magic, version, JSON with dtype, shape and grid) followed by the raw tensor
bytes. Never pickle: a value written by one version is readable, or cleanly refused, by another.
Entries carry a TTL; the Redis server's memory cap with LRU eviction bounds the whole store.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import redis
import torch

from epd import tensors

MAGIC = b"EPDE"
VERSION = 1
_HEADER = struct.Struct("<4sHI")  # magic, version, JSON length


@dataclass(frozen=True)
class Embedding:
    """One image's merged vision embeddings ``[num_tokens, hidden]`` and its patch grid."""

    tensor: torch.Tensor
    grid_thw: tuple[int, int, int]


def store_key(model_fingerprint: str, image_key: str) -> str:
    return f"epd:emb:v1:{model_fingerprint}:{image_key}"


def encode_value(embedding: Embedding) -> bytes:
    meta = {
        "dtype": tensors.dtype_name(embedding.tensor.dtype),
        "shape": list(embedding.tensor.shape),
        "grid_thw": list(embedding.grid_thw),
    }
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    return _HEADER.pack(MAGIC, VERSION, len(meta_bytes)) + meta_bytes + tensors.to_bytes(embedding.tensor)


def decode_value(value: bytes) -> Embedding:
    if len(value) < _HEADER.size:
        raise ValueError("embedding value is shorter than its header")
    magic, version, meta_len = _HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"embedding value has magic {magic!r} version {version}; expected {MAGIC!r} {VERSION}")
    meta = json.loads(value[_HEADER.size : _HEADER.size + meta_len])
    data = memoryview(value)[_HEADER.size + meta_len :]
    tensor = tensors.from_bytes(data, meta["dtype"], meta["shape"])
    return Embedding(tensor=tensor, grid_thw=tuple(meta["grid_thw"]))


class EmbeddingStore:
    """Thin typed layer over redis-py: batched existence checks, puts with TTL, batched gets."""

    def __init__(self, url: str, ttl_s: int = 3600) -> None:
        self.url = url
        self.ttl_s = ttl_s
        self._redis = redis.Redis.from_url(url)

    def ping(self) -> bool:
        return bool(self._redis.ping())

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """One pipelined round trip for all keys."""
        if not keys:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def put(self, key: str, embedding: Embedding) -> int:
        """Store one embedding; returns the value's size in bytes."""
        value = encode_value(embedding)
        self._redis.set(key, value, ex=self.ttl_s)
        return len(value)

    def get_many(self, keys: Sequence[str]) -> list[Embedding | None]:
        """Fetch several embeddings in one round trip; a missing (expired, evicted) key gives None."""
        if not keys:
            return []
        return [None if value is None else decode_value(value) for value in self._redis.mget(list(keys))]

    def memory_stats(self) -> dict[str, int]:
        """The server's ``used_memory``, ``maxmemory`` (0: none), ``evicted_keys`` and key count."""
        memory, stats = self._redis.info("memory"), self._redis.info("stats")
        return {"used_memory": int(memory["used_memory"]), "maxmemory": int(memory.get("maxmemory", 0)),
                "evicted_keys": int(stats.get("evicted_keys", 0)), "keys": int(self._redis.dbsize())}

    def delete(self, keys: Sequence[str]) -> int:
        return int(self._redis.delete(*keys)) if keys else 0

    def close(self) -> None:
        self._redis.close()
