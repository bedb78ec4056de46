"""The embedding store: vision embeddings in Redis, keyed by image content and model. A cache,
never a single point of failure.

Key: ``epd:emb:v1:<model-fingerprint>:<image-key>`` where the image key is a sha256 over the image
bytes and every processor setting that changes the pixels (``epd.imaging.image_key``). Value: a
small binary header (magic, version, JSON with the key it was written under, dtype, shape and
grid) followed by the raw tensor bytes. Never pickle. A value that fails its header check, or was
written under another key (another model, a forged or misplaced value), reads as a miss: the image
is encoded again and its key overwritten, so a bad value never fails a request.

Redis is reached through a circuit breaker: while it is unreachable (a dead embedded server, a
network fault) calls fail at once with ``StoreUnavailable`` instead of each waiting for a
connection timeout, one trial call per back-off tests whether it is back, and each transition is
logged once. Callers then move embeddings inline in their gRPC calls instead (``docs/RELIABILITY.md``).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis
import torch

from epd import errors, tensors
from epd.breaker import Breaker
from epd.config import StoreConfig

log = logging.getLogger(__name__)

MAGIC = b"EPDE"
VERSION = 2
_HEADER = struct.Struct("<4sHI")  # magic, version, JSON length
T = TypeVar("T")


class StoreUnavailable(errors.Unavailable):
    """Redis cannot be reached now; the embedding must travel another way."""


@dataclass(frozen=True)
class Embedding:
    """One image's merged vision embeddings ``[num_tokens, hidden]`` and its patch grid."""

    tensor: torch.Tensor
    grid_thw: tuple[int, int, int]


def store_key(model_fingerprint: str, image_key: str) -> str:
    return f"epd:emb:v1:{model_fingerprint}:{image_key}"


def encode_value(key: str, embedding: Embedding) -> bytes:
    """The stored (and inline) form of an embedding: it names the key it belongs to."""
    meta = {
        "key": key,
        "dtype": tensors.dtype_name(embedding.tensor.dtype),
        "shape": list(embedding.tensor.shape),
        "grid_thw": list(embedding.grid_thw),
    }
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    return _HEADER.pack(MAGIC, VERSION, len(meta_bytes)) + meta_bytes + tensors.to_bytes(embedding.tensor)


def decode_value(key: str, value: bytes) -> Embedding:
    """Raises ValueError naming what is wrong when ``value`` is not a valid embedding of ``key``."""
    if len(value) < _HEADER.size:
        raise ValueError("embedding value is shorter than its header")
    magic, version, meta_len = _HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"embedding value has magic {magic!r} version {version}; expected {MAGIC!r} {VERSION}")
    if _HEADER.size + meta_len > len(value):
        raise ValueError(f"embedding value ends inside its {meta_len}-byte header")
    try:
        meta = json.loads(value[_HEADER.size : _HEADER.size + meta_len])
        written_for, dtype, shape, grid = meta["key"], meta["dtype"], meta["shape"], meta["grid_thw"]
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise ValueError(f"embedding value has an unreadable header: {type(error).__name__}: {error}") from None
    if written_for != key:
        raise ValueError(f"embedding value was written for another key ({str(written_for)[:80]})")
    if not (_sizes(shape, 2) and _sizes(grid, 3) and isinstance(dtype, str) and dtype in tensors.DTYPES):
        raise ValueError(f"embedding value has dtype {str(dtype)[:20]}, shape {str(shape)[:40]} and grid "
                         f"{str(grid)[:40]}; expected a dtype name, 2 and 3 sizes")
    data = memoryview(value)[_HEADER.size + meta_len :]
    return Embedding(tensor=tensors.from_bytes(data, dtype, shape), grid_thw=tuple(grid))


def _sizes(value, count: int) -> bool:
    """``value`` is a list of ``count`` non-negative ints (JSON from a stored value is not trusted)."""
    return (isinstance(value, list) and len(value) == count
            and all(type(size) is int and 0 <= size < 1 << 40 for size in value))


class EmbeddingStore:
    """Thin typed layer over redis-py: batched existence checks, puts with TTL, batched gets, all
    behind one circuit breaker."""

    def __init__(self, url: str, ttl_s: int = StoreConfig.ttl_s, timeout_s: float = StoreConfig.timeout_s,
                 breaker_base_s: float = StoreConfig.breaker_base_s,
                 breaker_max_s: float = StoreConfig.breaker_max_s) -> None:
        self.url = url
        self.ttl_s = ttl_s
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._breaker = Breaker(base_s=breaker_base_s, max_s=breaker_max_s)
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: StoreConfig) -> EmbeddingStore:
        """The store a role uses: ``config.redis_url`` (filled in by the launcher), its TTL,
        timeout and breaker."""
        return cls(config.redis_url, ttl_s=config.ttl_s, timeout_s=config.timeout_s,
                   breaker_base_s=config.breaker_base_s, breaker_max_s=config.breaker_max_s)

    @property
    def reachable(self) -> bool:
        """False while the breaker is open (the last call to Redis failed)."""
        with self._lock:
            return self._breaker.closed

    def ping(self) -> bool:
        return bool(self._call(self._redis.ping))

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """One pipelined round trip for all keys."""
        if not keys:
            return []

        def run():
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return pipe.execute()

        return [bool(n) for n in self._call(run)]

    def put(self, key: str, embedding: Embedding) -> int:
        """Store one embedding; returns the value's size in bytes."""
        value = encode_value(key, embedding)
        self._call(lambda: self._redis.set(key, value, ex=self.ttl_s))
        return len(value)

    def get_many(self, keys: Sequence[str]) -> list[Embedding | None]:
        """Several embeddings in one round trip; a missing (expired, evicted) or invalid value is None."""
        if not keys:
            return []
        values = self._call(lambda: self._redis.mget(list(keys)))
        return [None if value is None else self._decode_or_none(key, value) for key, value in zip(keys, values)]

    def memory_stats(self) -> dict[str, int]:
        """The server's ``used_memory``, ``maxmemory`` (0: none), ``evicted_keys`` and key count."""
        memory, stats, keys = self._call(lambda: (self._redis.info("memory"), self._redis.info("stats"),
                                                  self._redis.dbsize()))
        return {"used_memory": int(memory["used_memory"]), "maxmemory": int(memory.get("maxmemory", 0)),
                "evicted_keys": int(stats.get("evicted_keys", 0)), "keys": int(keys)}

    # ---------------------------------------------------------------- encode leases

    _RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
    _RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) "
              "else return 0 end")

    @staticmethod
    def lease_key(key: str) -> str:
        return f"{key}:lease"

    def take_lease(self, key: str, holder: str, ttl_s: float) -> bool:
        """One encode of ``key`` across the deployment: True when ``holder`` now holds the lease
        (``SET NX`` with an expiry, so a holder that dies cannot keep it past ``ttl_s``)."""
        return bool(self._call(lambda: self._redis.set(self.lease_key(key), holder, nx=True,
                                                       px=max(1, int(ttl_s * 1000)))))

    def renew_lease(self, key: str, holder: str, ttl_s: float) -> bool:
        """Push the lease's expiry ``ttl_s`` ahead, if ``holder`` still holds it."""
        return bool(self._call(lambda: self._redis.eval(self._RENEW, 1, self.lease_key(key), holder,
                                                        max(1, int(ttl_s * 1000)))))

    def release_lease(self, key: str, holder: str) -> None:
        """Give the lease back, if ``holder`` still holds it (never another holder's)."""
        self._call(lambda: self._redis.eval(self._RELEASE, 1, self.lease_key(key), holder))

    def lease_held(self, key: str) -> bool:
        return bool(self._call(lambda: self._redis.exists(self.lease_key(key))))

    def delete(self, keys: Sequence[str]) -> int:
        return int(self._call(lambda: self._redis.delete(*keys))) if keys else 0

    def close(self) -> None:
        self._redis.close()

    @staticmethod
    def _decode_or_none(key: str, value: bytes) -> Embedding | None:
        try:
            return decode_value(key, value)
        except ValueError as error:
            log.warning("store: ignoring the value under %s: %s", key[-16:], error)
            return None

    def _call(self, run: Callable[[], T]) -> T:
        now = time.monotonic()
        with self._lock:
            if not self._breaker.allows(now):
                raise StoreUnavailable(f"store: Redis is unreachable (next try in "
                                       f"{self._breaker.retry_at - now:.1f} s)", downstream=True)
            self._breaker.begin()
            was_down = not self._breaker.closed
        try:
            result = run()
        except redis.RedisError as error:
            with self._lock:
                if self._breaker.closed:
                    log.warning("store: Redis unreachable (%s: %s); embeddings travel inline until it is back",
                                type(error).__name__, error)
                self._breaker.end(False, time.monotonic())
            raise StoreUnavailable(f"store: {type(error).__name__}: {error}", downstream=True) from None
        with self._lock:
            self._breaker.end(True, time.monotonic())
        if was_down:
            log.warning("store: Redis reachable again")
        return result
