"""One typed config per role, composed into ``ServeConfig`` and ``DeployConfig``: the one source
of truth for every setting and its default.

Each field has a docstring (the CLI's help is read from them, ``field_docs``) and a bound; a bad
value fails at start-up with a ``ConfigError`` naming the role and field (``decode.max_batch_size:
must be in [1, 1024], got 0``), not later in a worker.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import os
import textwrap
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value out of its bounds; the message names the field."""


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {message}")


def redact_url(url: str | None) -> str:
    """``url`` with any password replaced by ***: secrets never reach a log or an error message."""
    if not url:
        return str(url)
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"


def _check_range(value: float, low: float, high: float, name: str) -> None:
    _check(low <= value <= high, name, f"must be in [{low:g}, {high:g}], got {value}")


DTYPE_CHOICES = ("float32", "bfloat16", "float16")
PREEMPTION_CHOICES = ("swap", "replay")


def parse_cpus(text: str) -> set[int]:
    """A CPU list as Linux writes one (``taskset -c``, ``/sys/.../cpulist``): ``"0"``, ``"0-3"``,
    ``"0,2,4-5"``; empty: no list. Raises ValueError on anything else."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and (not high.isdigit() or int(high) < int(low))):
            raise ValueError(f"not a CPU list: {text!r} (write it as 0-3 or 0,2)")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


def _check_cpus(text: str, name: str) -> None:
    try:
        parse_cpus(text)
    except ValueError as error:
        raise ConfigError(f"{name}: {error}") from None


@dataclass(frozen=True)
class StoreConfig:
    redis_url: str | None = None
    """External Redis URL (redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS, unix://PATH); none: an
    embedded redis-server on a private unix socket."""
    ttl_s: int = 3600
    """Seconds an embedding stays in the store after it is written."""
    max_memory_mb: int = 1024
    """Memory cap of the embedded Redis in MiB, evicting least-recently-used entries past it (an
    external Redis keeps its own maxmemory; set maxmemory-policy allkeys-lru there)."""
    timeout_s: float = 2.0
    """Seconds one Redis call (and a connection attempt) may take before it counts as a failure."""
    breaker_base_s: float = 0.25
    """After a failed Redis call, calls fail at once (embeddings travel inline instead) for this long,
    doubling while the trial calls keep failing."""
    breaker_max_s: float = 5.0
    """The longest that back-off grows to: a Redis that is back is used again within this."""

    def __post_init__(self) -> None:
        _check(self.redis_url is None or self.redis_url.startswith(("redis://", "rediss://", "unix://")),
               "store.redis_url", f"must start with redis://, rediss:// or unix://, got {redact_url(self.redis_url)!r}")
        _check_range(self.ttl_s, 1, 30 * 86400, "store.ttl_s")
        _check_range(self.max_memory_mb, 16, 1 << 20, "store.max_memory_mb")
        _check_range(self.timeout_s, 0.01, 600, "store.timeout_s")
        _check_range(self.breaker_base_s, 0.01, 3600, "store.breaker_base_s")
        _check_range(self.breaker_max_s, self.breaker_base_s, 3600, "store.breaker_max_s")

    def __repr__(self) -> str:  # the URL's password never reaches a log, an error or a report
        return (f"StoreConfig(redis_url={redact_url(self.redis_url) if self.redis_url else None!r}, "
                f"ttl_s={self.ttl_s!r}, max_memory_mb={self.max_memory_mb!r}, timeout_s={self.timeout_s!r}, "
                f"breaker_base_s={self.breaker_base_s!r}, breaker_max_s={self.breaker_max_s!r})")


@dataclass(frozen=True)
class EncodeConfig:
    max_decoded_pixels: int = 64 * 1024 * 1024
    """Ceiling on an image's own pixel count before resizing: a decompression-bomb guard."""
    num_threads: int = 0
    """torch threads per encoder replica; 0: every core the replica may run on."""
    cpus: str = ""
    """CPU cores an encoder replica runs on, as Linux lists them (0-3, or 0,2); empty: every core
    Ray gives it. Roles on disjoint cores of one machine do not preempt each other."""
    max_batch_patches: int = 0
    """Patch budget of one vision forward: queued images are batched up to it (a bigger image runs
    alone). 0: one image per forward on a CPU (a compute-bound CPU encodes no more images/s in a
    batch, and each image would wait for the whole batch: docs/BENCHMARKS.md), 16384 on a GPU."""
    dtype: str = "float32"
    """Weights and activations dtype of the vision tower."""
    prepack: bool = True
    """On a CPU, run the vision tower's linear layers through oneDNN with pre-packed weights."""
    max_queued_per_replica: int = 128
    """Images an Encoder service lets queue or run per encoder replica taking work; a request whose
    new images would go past it is refused with RESOURCE_EXHAUSTED. High enough that a burst queues
    while the autoscaler adds replicas (its signal is that queue); 0: no limit."""
    gpu_batch_patches: int = 16384
    """The patch budget of one vision forward on a GPU when max_batch_patches is 0."""
    actor_concurrency: int = 64
    """Calls one encoder replica runs at once (Ray's max_concurrency of its actor): enough for
    images to queue up inside it and be batched; more wait in Ray."""
    lease_s: float = 5.0
    """An encode lease's expiry (one vision forward per image across replicas: the holder renews it
    every lease_s / 3 while it works; a dead holder's image is taken over this long after)."""
    lease_wait_s: float = 300.0
    """The longest an image whose encode another replica holds waits for that result before it is
    encoded here anyway."""

    def __post_init__(self) -> None:
        _check_range(self.gpu_batch_patches, 1, 1 << 24, "encode.gpu_batch_patches")
        _check_range(self.actor_concurrency, 1, 4096, "encode.actor_concurrency")
        _check_range(self.lease_s, 0.1, 3600, "encode.lease_s")
        _check_range(self.lease_wait_s, 0, 86400, "encode.lease_wait_s")
        _check_range(self.max_queued_per_replica, 0, 1 << 20, "encode.max_queued_per_replica")
        _check_range(self.max_batch_patches, 0, 1 << 24, "encode.max_batch_patches")
        _check(self.dtype in DTYPE_CHOICES, "encode.dtype", f"must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        _check_range(self.max_decoded_pixels, 65536, 1 << 31, "encode.max_decoded_pixels")
        _check_range(self.num_threads, 0, 256, "encode.num_threads")
        _check_cpus(self.cpus, "encode.cpus")


@dataclass(frozen=True)
class LMConfig:
    """What prefill and decode (the two language-model roles) share; ``section`` names the role."""

    section = "lm"
    dtype: str = "float32"
    """Weights and activations dtype of the language model."""
    num_threads: int = 0
    """torch threads of the role; 0: every core it may run on."""
    cpus: str = ""
    """CPU cores the role's processes run on, as Linux lists them (0-3, or 0,2); empty: every core
    Ray gives them. Roles on disjoint cores of one machine do not preempt each other."""
    prepack: bool = True
    """On a CPU, run the linear layers through oneDNN with pre-packed weights (2-4x faster here;
    costs a second copy of the weights in memory, ~3 GB for the 0.8b model in float32)."""
    tensor_parallel: int = 1
    """Processes each replica's language model spans (tensor parallelism, gloo on a CPU): rank 0 is
    the replica, the others local processes it starts, each holding 1/N of the weights and of every
    request's K/V and linear state; Ray reserves the N ranks' resources together (a placement group
    of N bundles) when the role asks Ray for any. Heads, K/V heads and MLP width must divide by it."""

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPE_CHOICES, f"{self.section}.dtype", f"must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        _check_range(self.tensor_parallel, 1, 64, f"{self.section}.tensor_parallel")
        _check_range(self.num_threads, 0, 256, f"{self.section}.num_threads")
        _check_cpus(self.cpus, f"{self.section}.cpus")


@dataclass(frozen=True)
class PrefillConfig(LMConfig):
    section = "prefill"
    chunk_tokens: int = 512
    """Longest chunk of one prompt in a prefill forward; waiting prompts take turns between forwards."""
    batch_tokens: int = 1024
    """Prompt tokens one prefill forward takes in all: chunks of several prompts share a forward
    up to this budget (at least chunk_tokens)."""
    step_tokens: int = 2048
    """An aggregated replica's (``aggregate``) budget for one step: its decode rows plus the prompt
    chunks riding them (at least chunk_tokens); batch_tokens is a prefill replica's own. Room for a
    burst's prompts in one forward, as vLLM's max_num_batched_tokens (W1 beside vLLM: 0.81x at
    1024, 0.90x at 2048, docs/BENCHMARKS.md)."""
    max_wait_s: float = 2.0
    """A prompt that arrived this many seconds ago or more goes first, oldest first (aging:
    shortest-first never starves it)."""
    embedding_cache_mb: int = 256
    """The prefill worker's in-process LRU of vision embeddings in front of Redis, in MiB; 0 turns it off."""
    prefix_cache_mb: int = 512
    """The prefill worker's prefix cache (K/V + linear-attention state snapshots), in MiB; 0 turns it off."""
    prefix_block_size: int = 64
    """Tokens per prefix-cache block (64 = Gated DeltaNet's kernel chunk, so block edges fall on its chunk edges)."""
    snapshot_every_blocks: int = 8
    """Besides each prompt's last full block and turn start, keep a prefix snapshot every this many blocks; 0: those only."""
    max_held_mb: int = 0
    """Memory the prompts one prefill worker holds may take in all (queued, running, or waiting for
    a decode worker with room; each counted by its state and embeddings); past it a prompt is
    refused with RESOURCE_EXHAUSTED before any work. 0: a quarter of the memory available once the
    weights are loaded."""
    metrics_port: int = 0
    """Port of the prefill worker's Prometheus /metrics endpoint; 0 turns it off."""
    shared_memory_handoff: bool = True
    """Hand a prompt's state to a decode worker on the same host through a file of the host's shared
    memory (/dev/shm) instead of streaming its bytes over gRPC; off: always stream."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_range(self.max_held_mb, 0, 1 << 30, "prefill.max_held_mb")
        _check_range(self.chunk_tokens, 1, 1 << 20, "prefill.chunk_tokens")
        _check_range(self.batch_tokens, 1, 1 << 20, "prefill.batch_tokens")
        _check_range(self.step_tokens, 1, 1 << 20, "prefill.step_tokens")
        _check_range(self.max_wait_s, 0.01, 3600, "prefill.max_wait_s")
        _check_range(self.embedding_cache_mb, 0, 1 << 20, "prefill.embedding_cache_mb")
        _check_range(self.prefix_cache_mb, 0, 1 << 20, "prefill.prefix_cache_mb")
        _check_range(self.prefix_block_size, 1, 8192, "prefill.prefix_block_size")
        _check_range(self.snapshot_every_blocks, 0, 1 << 16, "prefill.snapshot_every_blocks")
        _check_range(self.metrics_port, 0, 65535, "prefill.metrics_port")


@dataclass(frozen=True)
class DecodeConfig(LMConfig):
    section = "decode"
    handoff_lease_s: float = 30.0
    """A handed-off request that no stream claims within this many seconds is freed."""
    max_batch_size: int = 32
    """Requests decoded together in one step (continuous batching); more wait for a slot. Also the
    number of linear-attention state slots decode allocates at start."""
    kv_cache_bytes: int = 0
    """Bytes of decode's paged K/V pool, allocated once at start; 0: kv_cache_memory_fraction of the
    memory available once the weights are loaded."""
    kv_cache_memory_fraction: float = 0.0
    """Share of the memory available after the weights load that the K/V pool takes when
    kv_cache_bytes is 0; 0: 0.25 of host RAM on a CPU (the roles share it), 0.8 of the GPU's free memory."""
    kv_block_tokens: int = 16
    """Tokens per K/V block (the unit decode allocates, frees and preempts by)."""
    max_waiting_tokens: int = 0
    """Tokens the handed-off requests waiting for the batch may hold in all (their states live
    outside the pool); past it a handoff is refused with RESOURCE_EXHAUSTED and prefill tries
    another decode worker or waits. 0: half the pool's tokens."""
    max_waiting_requests: int = 0
    """Handed-off requests that may wait for the batch; 0: max_batch_size."""
    preemption: str = "swap"
    """How a request gives its K/V blocks back when a running one needs a block and none is free:
    swap (its state is copied to host memory and comes back bit for bit, while swap_space_bytes has
    room; replay past it) or replay (the router resumes it by a prefill of the prompt and its answer)."""
    swap_space_bytes: int = 0
    """Host memory swapped-out requests may take in all; 0: half the K/V pool's bytes (on a CPU the roles
    share host RAM: pool, swap space, waiting handoffs and prefill's budget stay below what is available)."""
    stream_group_s: float = 0.02
    """How long a token stream waits after a token to send the ones that follow in the same message
    (fewer, larger messages; tokens then arrive in bursts, so inter-token latency shows the wait
    while time per output token does not). A CPU step takes far longer than this; on a GPU lower it;
    0: no wait (tokens already waiting still go together)."""
    metrics_port: int = 0
    """Port of the decode worker's Prometheus /metrics endpoint; 0 turns it off."""
    reserve_hold_s: float = 10.0
    """A place reserved for a handoff (Decode.Reserve) is kept this long for it, then given back."""
    def __post_init__(self) -> None:
        super().__post_init__()
        _check_range(self.reserve_hold_s, 0.1, 3600, "decode.reserve_hold_s")
        _check_range(self.stream_group_s, 0, 1, "decode.stream_group_s")
        _check_range(self.handoff_lease_s, 0.1, 3600, "decode.handoff_lease_s")
        _check_range(self.max_batch_size, 1, 1024, "decode.max_batch_size")
        _check_range(self.kv_cache_bytes, 0, 1 << 50, "decode.kv_cache_bytes")
        _check_range(self.kv_cache_memory_fraction, 0, 0.95, "decode.kv_cache_memory_fraction")
        _check_range(self.kv_block_tokens, 1, 4096, "decode.kv_block_tokens")
        _check_range(self.max_waiting_tokens, 0, 1 << 40, "decode.max_waiting_tokens")
        _check_range(self.max_waiting_requests, 0, 1 << 20, "decode.max_waiting_requests")
        _check(self.preemption in PREEMPTION_CHOICES, "decode.preemption",
               f"must be one of {PREEMPTION_CHOICES}, got {self.preemption!r}")
        _check_range(self.swap_space_bytes, 0, 1 << 50, "decode.swap_space_bytes")
        _check_range(self.metrics_port, 0, 65535, "decode.metrics_port")


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
    """Prompt plus completion ceiling in tokens; 0: the model's max_position_embeddings."""
    request_timeout_s: float = 600.0
    """A request still running after this many seconds is abandoned with DEADLINE_EXCEEDED."""
    metrics_port: int = 0
    """Port of the router's Prometheus /metrics endpoint; 0 turns it off."""
    max_queued_requests: int = 0
    """Requests one router lets wait (accepted, first token not yet streamed) before it refuses
    more with RESOURCE_EXHAUSTED (HTTP 429). 0: derived from the deployment's capacity, twice
    decode.max_batch_size for each decode replica that takes work; -1: no limit. Requests resumed
    after a decode worker died always pass."""
    max_concurrent_rpcs: int = 4096
    """Calls one router's gRPC server runs at once (streams included); more are refused by gRPC
    with RESOURCE_EXHAUSTED before they are read."""
    max_images_per_request: int = 16
    """The most images and video clips one request may carry; more is INVALID_ARGUMENT."""
    video_chunk_patches: int = 4
    """Temporal patches (2 frames each) per encoder item of a video clip: a longer clip is split into
    chunks of this many, encoded on several encoder replicas at once and reassembled in order (the
    vision tower attends within each temporal patch, so the embeddings are those of one forward)."""
    max_request_mb: int = 64
    """Largest public request message in MiB (images included); a bigger one is refused by gRPC
    with RESOURCE_EXHAUSTED before it is read. Calls between roles have their own, larger cap."""
    allow_special_tokens: bool = False
    """Trusted callers only: control tokens in request text (<|im_start|>, <|im_end|>, ...) are
    tokenized as the tokens they name instead of as plain text, so a caller can write turns itself."""
    max_resumes: int = 8
    """A request whose decode worker died is resumed on another (a prefill of its prompt and answer
    so far) at most this many times; once more fails it with UNAVAILABLE. Preemptions do not count."""
    prefill_routing: str = "epd"
    """How a request's prefill replica is chosen: epd (least expected time to first token: queued
    work plus the prompt tokens the replica's prefix cache does not hold, never past 1.5x the mean
    queued work), least-load (fewest calls in flight), round-robin, or affinity (longest cached prefix)."""

    def __post_init__(self) -> None:
        _check_range(self.port, 0, 65535, "router.port")
        _check_range(self.max_resumes, 0, 1000, "router.max_resumes")
        if self.prefill_routing not in ("epd", "least-load", "round-robin", "affinity"):
            raise ConfigError(f"router.prefill_routing must be one of epd, least-load, round-robin, affinity; "
                              f"got {self.prefill_routing!r}")
        _check_range(self.max_images_per_request, 0, 4096, "router.max_images_per_request")
        _check_range(self.video_chunk_patches, 1, 4096, "router.video_chunk_patches")
        _check_range(self.max_request_mb, 1, 2047, "router.max_request_mb")
        _check_range(self.max_queued_requests, -1, 1 << 20, "router.max_queued_requests")
        _check_range(self.max_concurrent_rpcs, 1, 1 << 20, "router.max_concurrent_rpcs")
        _check_range(self.max_tokens_limit, 1, 1 << 20, "router.max_tokens_limit")
        _check_range(self.default_max_tokens, 1, self.max_tokens_limit, "router.default_max_tokens")
        _check_range(self.max_model_len, 0, 1 << 24, "router.max_model_len")
        _check_range(self.request_timeout_s, 1, 86400, "router.request_timeout_s")
        _check_range(self.metrics_port, 0, 65535, "router.metrics_port")


@dataclass(frozen=True)
class RpcConfig:
    """The gRPC hops between roles, in every role's process (channels and servers alike)."""

    keepalive_s: float = 5.0
    """Every connection (both ends) pings its peer this often and drops it when the answer takes as
    long again: a call to (or a stream from) a lost machine fails with UNAVAILABLE within about
    twice this and is retried elsewhere, instead of hanging until its deadline."""
    max_message_mb: int = 256
    """Largest message on a hop between roles, in MiB (a handoff chunk, an inline embedding, the
    images of a request). The public Router service has its own, smaller cap (router.max_request_mb)."""
    max_concurrent_rpcs: int = 4096
    """Calls one internal gRPC server (Encoder service, prefill, decode) runs at once; more are
    refused by gRPC with RESOURCE_EXHAUSTED. A ceiling on memory: the queues behind bound the work."""
    executor_threads: int = 16
    """Threads of each role server's blocking-work pool (tokenizing, Redis round trips, tensor
    building off the event loop)."""

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024

    def __post_init__(self) -> None:
        _check_range(self.keepalive_s, 1, 3600, "rpc.keepalive_s")
        _check_range(self.max_message_mb, 1, 2047, "rpc.max_message_mb")
        _check_range(self.max_concurrent_rpcs, 1, 1 << 20, "rpc.max_concurrent_rpcs")
        _check_range(self.executor_threads, 1, 1024, "rpc.executor_threads")


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP front each router replica serves beside its gRPC service."""

    port: int | None = None
    """Port of the first router's OpenAI-compatible HTTP front (other routers take a free port); 0: a free
    port; none: no HTTP front."""
    served_model_name: str = ""
    """The model name the HTTP front answers to (GET /v1/models, the request's model); empty: the
    checkpoint directory's name."""
    allow_media_urls: bool = False
    """Let requests name images by http(s) URL, fetched by the router; off: data: URLs (and local files
    under allowed_local_media_path) only."""
    allowed_media_domains: tuple[str, ...] = ()
    """Hosts image URLs may name (exact names or IP literals, comma-separated); when set, no other host is
    fetched and these may resolve to private, loopback or link-local addresses, which are otherwise refused."""
    allowed_local_media_path: str = ""
    """Directory whose files requests may name as file:// image URLs (never outside it: no .., no symlink
    escape); empty: local files are refused."""
    media_fetch_timeout_s: float = 10.0
    """Seconds one image URL may take to fetch, redirects included."""
    media_max_mb: float = 20.0
    """Largest image an http(s) URL or a local file may bring, in MiB."""
    media_max_redirects: int = 3
    """Redirects followed per image URL (each hop is checked like the first)."""
    body_timeout_s: float = 30.0
    """Seconds a client may take to send a request body; slower: 408 and the connection is closed."""
    reasoning_parser: str = ""
    """vLLM's --reasoning-parser: "qwen3" splits what an answer has before </think> into the message's
    reasoning_content (streamed as reasoning_content deltas); empty: off, the answer is all content."""
    max_open_requests: int = 0
    """HTTP requests one router's front carries at once (reading, waiting, streaming); more are
    answered 429 with Retry-After at once. 0: 4 x --max-queued-requests + 256 when that is set, else 4096."""

    def open_requests_limit(self, max_queued_requests: int) -> int:
        """``max_open_requests``, or the default derived from the router's queue bound."""
        if self.max_open_requests:
            return self.max_open_requests
        return 4 * max_queued_requests + 256 if max_queued_requests else 4096

    def __post_init__(self) -> None:
        _check(self.port is None or 0 <= self.port <= 65535, "http.port", f"must be in [0, 65535], got {self.port}")
        _check_range(self.body_timeout_s, 0.1, 3600, "http.body_timeout_s")
        _check_range(self.max_open_requests, 0, 1 << 20, "http.max_open_requests")
        _check(self.served_model_name == "" or (self.served_model_name.isprintable() and
                                                len(self.served_model_name) <= 256),
               "http.served_model_name", "must be printable and at most 256 characters")
        _check_range(self.media_fetch_timeout_s, 0.1, 600, "http.media_fetch_timeout_s")
        _check_range(self.media_max_mb, 0.001, 1024, "http.media_max_mb")
        _check_range(self.media_max_redirects, 0, 20, "http.media_max_redirects")
        _check(self.reasoning_parser in ("", "qwen3"), "http.reasoning_parser",
               f"must be qwen3 or empty (off), got {self.reasoning_parser!r}")
        for host in self.allowed_media_domains:
            _check(_is_ip(host) or (bool(host) and all(c.isalnum() or c in "-._" for c in host)),
                   "http.allowed_media_domains", f"expected host names or IP addresses (no port), got {host!r}")
        if self.allowed_local_media_path:
            _check(os.path.isdir(self.allowed_local_media_path), "http.allowed_local_media_path",
                   f"{self.allowed_local_media_path!r} is not a directory")


def _is_ip(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call what. Secrets are never printed: repr hides them and nothing logs them."""

    api_key: str = field(default="", repr=False)
    """Key the public fronts (gRPC Router, HTTP) require as `authorization: Bearer KEY`; empty:
    open. epd serve/deploy also read it from EPD_API_KEY."""
    internal_token: str = field(default="", repr=False)
    """Secret every call between roles carries (metadata `x-epd-internal`); internal services
    refuse calls without it. epd serve/deploy make a fresh one per deployment unless given."""
    tls_cert: str = ""
    """PEM certificate (chain) of the public fronts; with tls_key, clients must use TLS."""
    tls_key: str = ""
    """PEM private key of the public fronts' certificate."""
    internal_tls_ca: str = ""
    """PEM CA that signed every role's internal certificate: with the two below, calls between
    roles use mutual TLS (each side checks the other's certificate). The files must exist at the
    same path on every node."""
    internal_tls_cert: str = ""
    """PEM certificate every role presents to the others (its SANs must name the addresses roles bind)."""
    internal_tls_key: str = ""
    """PEM private key of the internal certificate."""

    def __post_init__(self) -> None:
        _check(bool(self.tls_cert) == bool(self.tls_key), "security.tls_cert",
               "give both --tls-cert and --tls-key, or neither")
        internal = (self.internal_tls_ca, self.internal_tls_cert, self.internal_tls_key)
        _check(all(internal) or not any(internal), "security.internal_tls_ca",
               "mutual TLS between roles needs all three of --internal-tls-ca, --internal-tls-cert, --internal-tls-key")
        for name in ("tls_cert", "tls_key", *("internal_tls_" + n for n in ("ca", "cert", "key"))):
            path = getattr(self, name)
            _check(not path or os.path.isfile(path), f"security.{name}", f"no such file: {path}")
        _check(not self.api_key or (len(self.api_key) >= 8 and self.api_key.isprintable() and " " not in self.api_key),
               "security.api_key", "must be at least 8 printable characters without spaces")
        _check(not self.internal_token or len(self.internal_token) >= 16, "security.internal_token",
               "must be at least 16 characters")
        _check(not (self.api_key and self.api_key == self.internal_token), "security.internal_token",
               "must differ from the public API key")


@dataclass(frozen=True)
class ServeConfig:
    model_dir: str
    """Hugging Face Qwen3.5 checkpoint directory (config.json with model_type qwen3_5 or qwen3_5_moe)."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    encode: EncodeConfig = field(default_factory=EncodeConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    rpc: RpcConfig = field(default_factory=RpcConfig)
    replica_wait_s: float = 30.0
    """How long a call waits for a replica of the role it needs when none is left (the only one
    died and Ray is restarting it): the router's calls to every role, prefill's handoffs, the
    Encoder service's images. Within the request's deadline; 0: fail at once with UNAVAILABLE."""

    def __post_init__(self) -> None:
        _check_range(self.replica_wait_s, 0, 3600, "replica_wait_s")
        path = os.path.join(self.model_dir, "config.json")
        _check(os.path.isfile(path), "model_dir", f"{self.model_dir!r} is not a checkpoint directory (no config.json); "
               "create one with `epd model create --preset tiny --out DIR`")
        try:
            with open(path) as f:
                text = json.load(f).get("text_config", {})
        except (OSError, ValueError) as error:
            raise ConfigError(f"model_dir: cannot read {path}: {error}") from None
        positions = text.get("max_position_embeddings")
        if isinstance(positions, int) and self.router.max_model_len > positions:
            raise ConfigError(f"router.max_model_len: {self.router.max_model_len} is more than the model's "
                              f"max_position_embeddings ({positions})")


def redacted(config) -> dict:
    """``dataclasses.asdict(config)`` with every secret taken out: the API key and the internal
    token become ``"***"`` when set (``""`` when not), a Redis URL loses its password. What reports
    and logs print of a config (``epd bench --json``)."""
    def scrub(value):
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if key in SECRET_FIELDS:
                    out[key] = "***" if item else ""
                elif key == "redis_url" and isinstance(item, str):
                    out[key] = redact_url(item)
                else:
                    out[key] = scrub(item)
            return out
        if isinstance(value, (list, tuple)):
            return type(value)(scrub(item) for item in value)
        return value

    return scrub(dataclasses.asdict(config))


SECRET_FIELDS = frozenset({"api_key", "internal_token"})
"""Config fields holding a secret (``SecurityConfig``): never printed, logged or written to a report."""


# ---------------------------------------------------------------- deployment on a Ray cluster

ROLES = ("encoder", "encode", "prefill", "decode", "router")
"""The roles a deployment places: encoder replicas (Ray actors), the Encoder gRPC service in
front of them, prefill, decode and the router."""

BIND_CHOICES = ("loopback", "node")


@dataclass(frozen=True)
class RoleResources:
    """What one replica of a role asks Ray for; Ray places it on a node that has it."""

    num_cpus: float = 0.0
    """CPUs reserved per replica. 0 shares the node's cores (one machine, small roles)."""
    num_gpus: float = 0.0
    """GPUs per replica (fractions share a GPU)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom resources per replica, e.g. ``{"epd_encoder": 1}``: only nodes started with that
    resource (``ray start --resources``, or ``resources:`` of a node type in a ``ray up`` file)
    take the role."""

    def __post_init__(self) -> None:
        _check_range(self.num_cpus, 0, 1024, "num_cpus")
        _check_range(self.num_gpus, 0, 64, "num_gpus")
        for name, amount in self.resources.items():
            _check(isinstance(name, str) and name and name not in ("CPU", "GPU", "memory"), "resources",
                   f"custom resource names must be non-empty and not CPU/GPU/memory, got {name!r}")
            _check(isinstance(amount, (int, float)) and 0 < amount <= 1 << 20, f"resources.{name}",
                   f"must be in (0, 1048576], got {amount!r}")

    def ray_options(self) -> dict:
        options: dict = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


@dataclass(frozen=True)
class AutoscaleConfig:
    """Encoder autoscaling: replicas between ``min_replicas`` and ``max_replicas`` by queue depth."""

    enabled: bool = False
    """Off: the encoder count is what ``--encoders`` / ``epd scale`` set."""
    min_replicas: int = 1
    """The fewest encoder replicas; the count falls back here after ``cooldown_s`` of low load."""
    max_replicas: int = 4
    """The most encoder replicas; a new one waits for the cluster to have its resources."""
    target_queue_per_replica: float = 2.0
    """Images queued or running per replica the autoscaler aims for (the load signal)."""
    cooldown_s: float = 30.0
    """Seconds of load below target before replicas are removed, and the least time between
    two scale-downs."""
    interval_s: float = 1.0
    """Seconds between two looks at the load."""

    def __post_init__(self) -> None:
        _check_range(self.min_replicas, 1, 256, "autoscale.min_replicas")
        _check(self.min_replicas <= self.max_replicas <= 256, "autoscale.max_replicas",
               f"must be in [min_replicas={self.min_replicas}, 256], got {self.max_replicas}")
        _check_range(self.target_queue_per_replica, 0.1, 1024, "autoscale.target_queue_per_replica")
        _check_range(self.cooldown_s, 0, 86400, "autoscale.cooldown_s")
        _check_range(self.interval_s, 0.05, 3600, "autoscale.interval_s")


@dataclass(frozen=True)
class DeployConfig:
    """A deployment on a Ray cluster (``epd deploy``) or on a fresh local Ray (``epd serve``)."""

    serve: ServeConfig
    """The roles' own settings (model, store, per-role knobs)."""
    num_encoders: int = 1
    """Encoder replicas (Ray actors, each with its own copy of the vision tower); the start count
    when autoscaling."""
    num_encode_services: int = 1
    """Encoder gRPC services in front of the encoder replicas (the router balances over them)."""
    num_prefill: int = 1
    """Prefill replicas (the router balances over them)."""
    num_decode: int = 1
    """Decode replicas (prefill hands each request to the one with the fewest in flight); none
    with ``aggregate``."""
    aggregate: bool = False
    """Prefill and decode as one engine per replica (``pd_svc``): each of the ``num_prefill``
    replicas loads the language model once and runs every step's decode rows and prefill chunks
    (up to prefill.step_tokens in all) in one forward; a prompt decodes where it was prefilled.
    For roles that share one device's cores; separate prefill and decode replicas otherwise."""
    num_routers: int = 1
    """Router replicas (the public entry points)."""
    bind: str = "loopback"
    """Where role servers listen: loopback (one machine) or node (the Ray node's IP, so roles on
    other nodes reach them)."""
    namespace: str = "epd"
    """Ray namespace of the deployment's named actors; two deployments on one cluster differ here."""
    resources: dict[str, RoleResources] = field(default_factory=lambda: {role: RoleResources() for role in ROLES})
    """Ray resources per role (see ``deploy/roles.toml``)."""
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    metrics_port: int = 0
    """Port of the controller's Prometheus endpoint; 0 picks a free one (kept across a restart of
    the controller)."""
    poll_s: float = 0.25
    """The shortest time between two reads of the registry by one watcher (each read waits there
    for a change, up to ``discovery.LONG_POLL_S``): replicas that joined or left, and their load."""
    drain_timeout_s: float = 30.0
    """On shutdown (SIGTERM/SIGINT to epd serve, epd down) the routers stop taking requests and
    those in flight get this many seconds to finish; streams still running then end with UNAVAILABLE."""
    scale_drain_timeout_s: float = 600.0
    """A replica being removed (epd scale, autoscaling) gets this long to finish what it holds before it is stopped."""
    probe_interval_s: float = 1.0
    """Seconds between two health probes of every replica by the controller."""
    probe_timeout_s: float = 2.0
    """A probe without an answer within this many seconds marks the replica unhealthy."""
    local_gpus: int = -1
    """`epd serve` only: GPUs the local Ray node offers (-1: what Ray detects). When it has some and
    no role asks for GPUs, each model replica (encoder, prefill, decode) is given a GPU of its own,
    or an equal share when there are fewer GPUs than model replicas (``share_gpus``)."""
    start_timeout_s: float = 900.0
    """How long a new replica may wait for resources (a node the cluster autoscaler adds) and load."""
    max_start_failures: int = 3
    """A role whose new replicas' constructors fail this many times in a row (none joining in
    between: a wrong checkpoint, a missing file) is not replaced forever: with none of it serving
    the deployment stops with the error, else no more of it are started until `epd scale`."""
    max_restarts: int = 3
    """Ray restarts a replica whose process died this many times (same name, new port); after that
    the controller replaces it with a new one."""
    heartbeat_s: float = 1.0
    """Every replica registers itself again this often: a restarted registry is full again within
    a few heartbeats (its warm-up is 3 of them)."""
    refill_grace_s: float = 15.0
    """After a registry restart, a replica a caller knew that has not registered again is kept in
    rotation this long past the warm-up (a heartbeat can take seconds on a loaded machine)."""
    status_wait_s: float = 2.0
    """How long `epd status` waits for each replica to say how much work it holds (one that does
    not answer in time is shown without it)."""

    def __post_init__(self) -> None:
        _check_range(self.max_restarts, 0, 1000, "max_restarts")
        _check_range(self.heartbeat_s, 0.05, 60, "heartbeat_s")
        _check_range(self.refill_grace_s, 0, 3600, "refill_grace_s")
        _check_range(self.status_wait_s, 0.1, 600, "status_wait_s")
        for name in ("num_encoders", "num_encode_services", "num_prefill", "num_decode", "num_routers"):
            _check_range(getattr(self, name), 1, 256, name)
        _check(self.bind in BIND_CHOICES, "bind", f"must be one of {BIND_CHOICES}, got {self.bind!r}")
        _check(bool(self.namespace) and self.namespace.replace("-", "").replace("_", "").isalnum(), "namespace",
               f"must be letters, digits, - or _, got {self.namespace!r}")
        unknown = set(self.resources) - set(ROLES)
        _check(not unknown, "resources", f"unknown roles {sorted(unknown)}; roles are {ROLES}")
        _check_range(self.metrics_port, 0, 65535, "metrics_port")
        _check_range(self.poll_s, 0.01, 60, "poll_s")
        _check_range(self.drain_timeout_s, 0, 86400, "drain_timeout_s")
        _check_range(self.scale_drain_timeout_s, 1, 86400, "scale_drain_timeout_s")
        _check_range(self.probe_interval_s, 0.1, 60, "probe_interval_s")
        _check_range(self.probe_timeout_s, 0.1, 60, "probe_timeout_s")
        _check_range(self.start_timeout_s, 1, 86400, "start_timeout_s")
        _check_range(self.local_gpus, -1, 1024, "local_gpus")
        _check_range(self.max_start_failures, 1, 1000, "max_start_failures")
        if self.bind == "node":
            _check(not (self.serve.store.redis_url or "").startswith("unix://") and self.serve.store.redis_url is not None,
                   "store.redis_url", "a deployment bound to node addresses needs a TCP Redis every node can reach "
                   "(--redis redis://HOST:PORT/0)")
        if self.autoscale.enabled:
            _check_range(self.num_encoders, self.autoscale.min_replicas, self.autoscale.max_replicas, "num_encoders")
        if self.aggregate:
            for section in ("prefill", "decode"):
                _check(getattr(self.serve, section).tensor_parallel == 1, f"{section}.tensor_parallel",
                       "an aggregated replica is one process: tensor parallelism is for separate replicas")
            for name in ("dtype", "prepack", "num_threads", "cpus"):
                prefill, decode = getattr(self.serve.prefill, name), getattr(self.serve.decode, name)
                _check(prefill == decode, f"prefill.{name}",
                       f"an aggregated replica runs one model for both: must equal decode.{name} ({decode!r}), "
                       f"got {prefill!r}")

    def role_resources(self, role: str) -> RoleResources:
        return self.resources.get(role, RoleResources())

    def replicas(self, role: str) -> int:
        return {"encoder": self.num_encoders, "encode": self.num_encode_services, "prefill": self.num_prefill,
                "decode": 0 if self.aggregate else self.num_decode, "router": self.num_routers}[role]


MODEL_ROLES = ("encoder", "prefill", "decode")


def share_gpus(deploy: DeployConfig, gpus: float) -> DeployConfig:
    """``deploy`` with the model roles asking Ray for GPUs when the node has ``gpus`` and no role
    asks for any: a whole GPU per model replica when there are enough, else ``1 / k`` of one, ``k``
    replicas to a GPU (Ray then places them and sets each one's CUDA_VISIBLE_DEVICES, so no two
    replicas share a device they were not told to share)."""
    if gpus <= 0 or any(deploy.role_resources(role).num_gpus for role in ROLES):
        return deploy
    replicas = sum(deploy.replicas(role) for role in MODEL_ROLES)
    share = 1.0 if gpus >= replicas else 1.0 / -(-replicas // int(gpus))
    resources = dict(deploy.resources)
    for role in MODEL_ROLES:
        resources[role] = dataclasses.replace(deploy.role_resources(role), num_gpus=share)
    return dataclasses.replace(deploy, resources=resources)


def load_deploy_file(path: str) -> tuple[dict[str, RoleResources], AutoscaleConfig]:
    """Read a TOML deploy file: ``[roles.<role>]`` tables of resources and an ``[autoscale]`` table.

    Unknown keys are errors that name the key, so a typo never silently places a role anywhere.
    """
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as error:
        raise ConfigError(f"deploy file {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"deploy file {path}: {error}") from None
    _check(set(data) <= {"roles", "autoscale"}, path, f"unknown tables {sorted(set(data) - {'roles', 'autoscale'})}; "
           "expected [roles.<role>] and [autoscale]")
    resources = {}
    for role, table in data.get("roles", {}).items():
        _check(role in ROLES, f"{path}: roles", f"unknown role {role!r}; roles are {ROLES}")
        allowed = {"num_cpus", "num_gpus", "resources", *(("tensor_parallel",) if role in TP_ROLES else ())}
        _check(set(table) <= allowed, f"{path}: roles.{role}", f"unknown keys {sorted(set(table) - allowed)}"
               + (f"; tensor_parallel is served for {' and '.join(TP_ROLES)} only" if "tensor_parallel" in table
                  else ""))
        table = {key: value for key, value in table.items() if key != "tensor_parallel"}
        try:
            resources[role] = RoleResources(**table)
        except ConfigError as error:
            raise ConfigError(f"{path}: roles.{role}.{error}") from None
    allowed = set(AutoscaleConfig.__dataclass_fields__)
    table = data.get("autoscale", {})
    _check(set(table) <= allowed, f"{path}: autoscale", f"unknown keys {sorted(set(table) - allowed)}")
    try:
        autoscale = AutoscaleConfig(**table)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    return resources, autoscale


TP_ROLES = ("prefill", "decode")
"""The roles a replica of which may span several processes (``tensor_parallel``)."""


def deploy_file_tensor_parallel(path: str) -> dict[str, int]:
    """``tensor_parallel`` of ``[roles.prefill]`` and ``[roles.decode]`` in a deploy file
    (``load_deploy_file`` checks the file), by role, for those that set one."""
    import tomllib

    with open(path, "rb") as f:
        roles = tomllib.load(f).get("roles", {})
    found = {}
    for role in TP_ROLES:
        value = roles.get(role, {}).get("tensor_parallel")
        _check(value is None or (isinstance(value, int) and not isinstance(value, bool)),
               f"{path}: roles.{role}.tensor_parallel", f"must be an integer, got {value!r}")
        if value is not None:
            found[role] = value
    return found


# ---------------------------------------------------------------- field docs (the CLI's help)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal under it), base classes included."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_default(cls: type, name: str):
    """A field's default value (calling its default factory)."""
    spec = cls.__dataclass_fields__[name]
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")
