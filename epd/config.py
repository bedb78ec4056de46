"""One typed config per role, composed into ``ServeConfig``; every field bounded and checked.

A bad value fails at start-up with a ``ConfigError`` that names the field, not later in a worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value out of its bounds; the message names the field."""


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {message}")


DTYPE_CHOICES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class StoreConfig:
    redis_url: str | None = None
    """External Redis URL (``redis://host:port/db``); None starts an embedded redis-server."""
    ttl_s: int = 3600
    """Seconds an embedding stays in the store after it is written."""
    max_memory_mb: int = 1024
    """Memory cap of the embedded Redis, evicting least-recently-used entries past it (an external
    Redis keeps its own ``maxmemory``; set ``maxmemory-policy allkeys-lru`` there)."""

    def __post_init__(self) -> None:
        _check(self.redis_url is None or self.redis_url.startswith(("redis://", "rediss://", "unix://")),
               "store.redis_url", f"must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        _check(1 <= self.ttl_s <= 30 * 86400, "store.ttl_s", f"must be in [1, 2592000], got {self.ttl_s}")
        _check(16 <= self.max_memory_mb <= 1 << 20, "store.max_memory_mb", f"must be in [16, 1048576], got {self.max_memory_mb}")


@dataclass(frozen=True)
class EncodeConfig:
    num_replicas: int = 1
    """Encoder replicas (Ray actors), each with its own copy of the vision tower."""
    max_decoded_pixels: int = 64 * 1024 * 1024
    """Ceiling on an image's own pixel count before resizing: a decompression-bomb guard."""
    num_threads: int = 0
    """torch threads per replica; 0 lets each replica use the cores it is given."""
    max_batch_patches: int = 16384
    """Patch budget of one vision forward: queued images are batched up to it (a bigger image runs alone)."""
    dtype: str = "float32"
    """Weights and activations dtype of the vision tower."""

    def __post_init__(self) -> None:
        _check(1 <= self.max_batch_patches <= 1 << 24, "encode.max_batch_patches",
               f"must be in [1, 16777216], got {self.max_batch_patches}")
        _check(self.dtype in DTYPE_CHOICES, "encode.dtype", f"must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        _check(1 <= self.num_replicas <= 256, "encode.num_replicas", f"must be in [1, 256], got {self.num_replicas}")
        _check(65536 <= self.max_decoded_pixels <= 1 << 31, "encode.max_decoded_pixels",
               f"must be in [65536, 2147483648], got {self.max_decoded_pixels}")
        _check(0 <= self.num_threads <= 256, "encode.num_threads", f"must be in [0, 256], got {self.num_threads}")


@dataclass(frozen=True)
class LMConfig:
    dtype: str = "float32"
    """Weights and activations dtype of the language model (prefill and decode)."""
    num_threads: int = 0
    """torch threads for the role; 0 keeps torch's default."""

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPE_CHOICES, "dtype", f"must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        _check(0 <= self.num_threads <= 256, "num_threads", f"must be in [0, 256], got {self.num_threads}")


@dataclass(frozen=True)
class PrefillConfig(LMConfig):
    chunk_tokens: int = 512
    """Longest run of prompt tokens one forward takes; waiting prompts take turns between chunks."""
    embedding_cache_mb: int = 256
    """In-process LRU of vision embeddings in front of Redis, in MiB; 0 turns it off."""
    prefix_cache_mb: int = 512
    """Prompt-prefix state snapshots (K/V + linear-attention states), in MiB; 0 turns it off."""
    prefix_block_size: int = 64
    """Tokens per prefix-cache block (64 = Gated DeltaNet's kernel chunk, so block edges fall on its chunk edges)."""
    snapshot_every_blocks: int = 8
    """Besides each prompt's last full block, keep a snapshot every this many blocks; 0: last block only."""
    metrics_port: int = 0
    """Port of the prefill worker's Prometheus /metrics endpoint on 127.0.0.1; 0 turns it off."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(1 <= self.chunk_tokens <= 1 << 20, "prefill.chunk_tokens", f"must be in [1, 1048576], got {self.chunk_tokens}")
        _check(0 <= self.embedding_cache_mb <= 1 << 20, "prefill.embedding_cache_mb",
               f"must be in [0, 1048576], got {self.embedding_cache_mb}")
        _check(0 <= self.prefix_cache_mb <= 1 << 20, "prefill.prefix_cache_mb",
               f"must be in [0, 1048576], got {self.prefix_cache_mb}")
        _check(1 <= self.prefix_block_size <= 8192, "prefill.prefix_block_size",
               f"must be in [1, 8192], got {self.prefix_block_size}")
        _check(0 <= self.snapshot_every_blocks <= 1 << 16, "prefill.snapshot_every_blocks",
               f"must be in [0, 65536], got {self.snapshot_every_blocks}")
        _check(0 <= self.metrics_port <= 65535, "prefill.metrics_port", f"must be in [0, 65535], got {self.metrics_port}")


@dataclass(frozen=True)
class DecodeConfig(LMConfig):
    handoff_lease_s: float = 30.0
    """A handed-off request that no Stream call claims within this many seconds is freed."""
    max_batch_size: int = 32
    """Requests decoded together in one step; more wait for a slot (continuous batching)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(0.1 <= self.handoff_lease_s <= 3600, "decode.handoff_lease_s",
               f"must be in [0.1, 3600], got {self.handoff_lease_s}")
        _check(1 <= self.max_batch_size <= 1024, "decode.max_batch_size",
               f"must be in [1, 1024], got {self.max_batch_size}")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    """Address the public Router service binds to."""
    port: int = 0
    """Port of the Router service; 0 picks a free one."""
    default_max_tokens: int = 256
    """max_tokens when a request leaves it unset."""
    max_tokens_limit: int = 4096
    """The largest max_tokens a request may ask for."""
    max_model_len: int = 0
    """Prompt plus completion ceiling in tokens; 0 uses the model's max_position_embeddings."""
    request_timeout_s: float = 600.0
    """A request still running after this many seconds is abandoned with DEADLINE_EXCEEDED."""
    metrics_port: int = 0
    """Port of the router's Prometheus /metrics endpoint (on ``host``); 0 turns it off."""

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "router.port", f"must be in [0, 65535], got {self.port}")
        _check(1 <= self.default_max_tokens <= self.max_tokens_limit, "router.default_max_tokens",
               f"must be in [1, max_tokens_limit={self.max_tokens_limit}], got {self.default_max_tokens}")
        _check(1 <= self.max_tokens_limit <= 1 << 20, "router.max_tokens_limit",
               f"must be in [1, 1048576], got {self.max_tokens_limit}")
        _check(self.max_model_len >= 0, "router.max_model_len", f"must be >= 0, got {self.max_model_len}")
        _check(1 <= self.request_timeout_s <= 86400, "router.request_timeout_s",
               f"must be in [1, 86400], got {self.request_timeout_s}")
        _check(0 <= self.metrics_port <= 65535, "router.metrics_port", f"must be in [0, 65535], got {self.metrics_port}")


@dataclass(frozen=True)
class ServeConfig:
    model_dir: str
    """Hugging Face Qwen3.5 checkpoint directory (config.json with model_type qwen3_5)."""
    store: StoreConfig = field(default_factory=StoreConfig)
    encode: EncodeConfig = field(default_factory=EncodeConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self) -> None:
        _check(os.path.isfile(os.path.join(self.model_dir, "config.json")), "model_dir",
               f"{self.model_dir!r} is not a checkpoint directory (no config.json); "
               "create one with `epd model create --preset tiny --out DIR`")
