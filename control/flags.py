"""Command-line flags derived from the config dataclasses (``epd.config``), so every default and
every help text has one source: the field's own default and docstring.

A ``Flag`` names the option and the config field(s) it sets (dotted paths from ``DeployConfig``);
``add_flags`` puts them on a parser with the field's type, default and docstring as help, and
``deploy_config`` builds the deployment config from what the user typed: the one function
``epd serve``, ``epd deploy`` and ``epd bench --model`` all use. Fields the user did not set keep
the dataclass default (argparse never fills them in).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass

from epd.config import (
    DTYPE_CHOICES,
    ConfigError,
    DeployConfig,
    deploy_file_tensor_parallel,
    field_default,
    field_docs,
    load_deploy_file,
)


@dataclass(frozen=True)
class Flag:
    option: str
    """The option as typed: ``--max-batch-size``."""
    paths: tuple[str, ...]
    """The config fields it sets, dotted from DeployConfig: ``("serve.decode.max_batch_size",)``."""
    required: bool = False
    help: str = ""
    """Help to use instead of the field's docstring (when one flag sets several fields)."""
    metavar: str = ""

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


def _flag(option: str, *paths: str, required: bool = False, help: str = "", metavar: str = "") -> Flag:  # noqa: A002
    return Flag(option, paths, required, help, metavar)


MODEL = _flag("--model", "serve.model_dir", required=True, metavar="DIR")
SECURITY = (
    _flag("--api-key", "serve.security.api_key", metavar="KEY",
          help="key the public fronts require as `authorization: Bearer KEY` (visible in `ps`: prefer "
               "EPD_API_KEY or --api-key-file); none: open"),
    _flag("--tls-cert", "serve.security.tls_cert", metavar="PEM"),
    _flag("--tls-key", "serve.security.tls_key", metavar="PEM"),
    _flag("--internal-tls-ca", "serve.security.internal_tls_ca", metavar="PEM"),
    _flag("--internal-tls-cert", "serve.security.internal_tls_cert", metavar="PEM"),
    _flag("--internal-tls-key", "serve.security.internal_tls_key", metavar="PEM"),
)
REDIS = _flag("--redis", "serve.store.redis_url", metavar="URL")
STACK = (  # what shapes the roles, whichever command starts them
    _flag("--encoders", "num_encoders"),
    _flag("--encode-services", "num_encode_services"),
    _flag("--prefill", "num_prefill"),
    _flag("--decode", "num_decode"),
    _flag("--aggregate", "aggregate",
          help="prefill and decode as one engine per replica, every step's decode rows and prompt chunks in one "
               "forward (--no-aggregate: separate prefill and decode replicas; default: aggregated for `epd serve` "
               "and `epd bench --model` on a machine without GPUs, unless a flag shapes separate replicas; "
               "separate for `epd deploy` and with GPUs)"),
    _flag("--routers", "num_routers"),
    _flag("--dtype", "serve.encode.dtype", "serve.prefill.dtype", "serve.decode.dtype",
          help="weights and activations dtype of every model role (vision tower and language model)"),
    _flag("--max-model-len", "serve.router.max_model_len"),
    _flag("--max-tokens-limit", "serve.router.max_tokens_limit"),
    _flag("--default-max-tokens", "serve.router.default_max_tokens"),
    _flag("--request-timeout-s", "serve.router.request_timeout_s"),
    _flag("--max-queued-requests", "serve.router.max_queued_requests"),
    _flag("--max-images-per-request", "serve.router.max_images_per_request"),
    _flag("--video-chunk-patches", "serve.router.video_chunk_patches"),
    _flag("--max-request-mb", "serve.router.max_request_mb"),
    _flag("--allow-special-tokens", "serve.router.allow_special_tokens"),
    _flag("--prefill-routing", "serve.router.prefill_routing"),
    _flag("--store-ttl-s", "serve.store.ttl_s"),
    _flag("--store-max-memory-mb", "serve.store.max_memory_mb"),
    _flag("--embedding-cache-mb", "serve.prefill.embedding_cache_mb"),
    _flag("--prefix-cache-mb", "serve.prefill.prefix_cache_mb"),
    _flag("--prefix-block-size", "serve.prefill.prefix_block_size"),
    _flag("--snapshot-every-blocks", "serve.prefill.snapshot_every_blocks"),
    _flag("--prefill-chunk-tokens", "serve.prefill.chunk_tokens"),
    _flag("--prefill-batch-tokens", "serve.prefill.batch_tokens"),
    _flag("--step-tokens", "serve.prefill.step_tokens"),
    _flag("--prefill-max-wait-s", "serve.prefill.max_wait_s"),
    _flag("--prefill-max-held-mb", "serve.prefill.max_held_mb"),
    _flag("--max-batch-size", "serve.decode.max_batch_size"),
    _flag("--handoff-lease-s", "serve.decode.handoff_lease_s"),
    _flag("--kv-cache-bytes", "serve.decode.kv_cache_bytes"),
    _flag("--kv-cache-memory-fraction", "serve.decode.kv_cache_memory_fraction"),
    _flag("--kv-block-tokens", "serve.decode.kv_block_tokens"),
    _flag("--decode-max-waiting-tokens", "serve.decode.max_waiting_tokens"),
    _flag("--decode-max-waiting-requests", "serve.decode.max_waiting_requests"),
    _flag("--preemption", "serve.decode.preemption"),
    _flag("--stream-group-s", "serve.decode.stream_group_s"),
    _flag("--swap-space-bytes", "serve.decode.swap_space_bytes"),
    _flag("--encoder-batch-patches", "serve.encode.max_batch_patches"),
    _flag("--encoder-threads", "serve.encode.num_threads"),
    _flag("--prefill-threads", "serve.prefill.num_threads",
          help="torch threads of each prefill process (each rank of a tensor-parallel replica); 0: every core it "
               "may run on"),
    _flag("--decode-threads", "serve.decode.num_threads",
          help="torch threads of each decode process (each rank of a tensor-parallel replica); 0: every core it may "
               "run on"),
    _flag("--encoder-max-queued", "serve.encode.max_queued_per_replica"),
    _flag("--encoder-cpus", "serve.encode.cpus", metavar="LIST"),
    _flag("--prefill-cpus", "serve.prefill.cpus", metavar="LIST"),
    _flag("--decode-cpus", "serve.decode.cpus", metavar="LIST"),
    _flag("--max-decoded-pixels", "serve.encode.max_decoded_pixels"),
    _flag("--prepack", "serve.encode.prepack", "serve.prefill.prepack", "serve.decode.prepack",
          help="on a CPU, run the linear layers of every model role through oneDNN with pre-packed weights "
               "(2-4x faster here; a second copy of the weights in memory, ~3 GB for the 0.8b LM in float32)"),
    _flag("--router-metrics-port", "serve.router.metrics_port"),
    _flag("--prefill-metrics-port", "serve.prefill.metrics_port"),
    _flag("--decode-metrics-port", "serve.decode.metrics_port"),
    _flag("--replica-wait-s", "serve.replica_wait_s"),
    _flag("--drain-timeout-s", "drain_timeout_s"),
    _flag("--scale-drain-timeout-s", "scale_drain_timeout_s"),
    # tunables of the machinery (docs/OPERATIONS.md "Tunables"); the defaults suit most deployments
    _flag("--max-resumes", "serve.router.max_resumes"),
    _flag("--reserve-hold-s", "serve.decode.reserve_hold_s"),
    _flag("--shared-memory-handoff", "serve.prefill.shared_memory_handoff"),
    _flag("--prefill-tensor-parallel", "serve.prefill.tensor_parallel"),
    _flag("--decode-tensor-parallel", "serve.decode.tensor_parallel"),
    _flag("--encoder-gpu-batch-patches", "serve.encode.gpu_batch_patches"),
    _flag("--encoder-concurrency", "serve.encode.actor_concurrency"),
    _flag("--encode-lease-s", "serve.encode.lease_s"),
    _flag("--encode-lease-wait-s", "serve.encode.lease_wait_s"),
    _flag("--store-timeout-s", "serve.store.timeout_s"),
    _flag("--store-breaker-base-s", "serve.store.breaker_base_s"),
    _flag("--store-breaker-max-s", "serve.store.breaker_max_s"),
    _flag("--keepalive-s", "serve.rpc.keepalive_s"),
    _flag("--max-message-mb", "serve.rpc.max_message_mb"),
    _flag("--internal-max-concurrent-rpcs", "serve.rpc.max_concurrent_rpcs"),
    _flag("--router-max-concurrent-rpcs", "serve.router.max_concurrent_rpcs"),
    _flag("--executor-threads", "serve.rpc.executor_threads"),
    _flag("--max-restarts", "max_restarts"),
    _flag("--heartbeat-s", "heartbeat_s"),
    _flag("--refill-grace-s", "refill_grace_s"),
    _flag("--status-wait-s", "status_wait_s"),
    _flag("--probe-interval-s", "probe_interval_s"),
    _flag("--probe-timeout-s", "probe_timeout_s"),
    _flag("--max-start-failures", "max_start_failures"),
    _flag("--start-timeout-s", "start_timeout_s"),
)
HTTP = (  # the OpenAI-compatible HTTP front of each router
    _flag("--http-port", "serve.http.port"),
    _flag("--served-model-name", "serve.http.served_model_name"),
    _flag("--allow-media-urls", "serve.http.allow_media_urls"),
    _flag("--allowed-media-domains", "serve.http.allowed_media_domains", metavar="HOST,..."),
    _flag("--allowed-local-media-path", "serve.http.allowed_local_media_path", metavar="DIR"),
    _flag("--media-fetch-timeout-s", "serve.http.media_fetch_timeout_s"),
    _flag("--media-max-mb", "serve.http.media_max_mb"),
    _flag("--media-max-redirects", "serve.http.media_max_redirects"),
    _flag("--http-body-timeout-s", "serve.http.body_timeout_s"),
    _flag("--http-max-open-requests", "serve.http.max_open_requests"),
    _flag("--reasoning-parser", "serve.http.reasoning_parser", metavar="qwen3"),
)
SERVE = (MODEL, REDIS, _flag("--host", "serve.router.host"), _flag("--port", "serve.router.port"),
         _flag("--num-gpus", "local_gpus"), _flag("--metrics-port", "metrics_port"), *STACK, *SECURITY, *HTTP)
DEPLOY = (
    MODEL, _flag("--redis", "serve.store.redis_url", required=True, metavar="URL",
                 help="Redis every node can reach: redis://[:PASSWORD@]HOST:PORT/DB (rediss:// for TLS)"),
    _flag("--router-port", "serve.router.port"), _flag("--namespace", "namespace"),
    _flag("--metrics-port", "metrics_port"), *STACK, *SECURITY, *HTTP,
)
BENCH_STACK = (REDIS, *STACK)  # `epd bench --model DIR`: its own --model is the checkpoint


SEPARATE_SHAPES = ("--decode", "--prefill-tensor-parallel", "--decode-tensor-parallel", "--prefill-threads",
                   "--decode-threads", "--prefill-cpus", "--decode-cpus", "--decode-metrics-port")
"""Flags that shape separate prefill and decode replicas: given one, a one-machine stack keeps
them separate unless --aggregate says otherwise."""


def local_gpus_offered(local_gpus: int) -> bool:
    """Whether the local Ray node offers GPUs to the replicas: ``--num-gpus N`` > 0, or the default
    (-1) on a machine where Ray will find one."""
    return local_gpus > 0 or (local_gpus < 0 and os.path.exists("/dev/nvidiactl"))


def one_machine_mode(args: argparse.Namespace, config_file: str | None = None) -> tuple[bool, str]:
    """(aggregate, why) for a stack on this machine (``epd serve``, ``epd bench --model``).

    ``--aggregate`` / ``--no-aggregate`` decide when given. Otherwise prefill and decode run as
    one engine per replica where they share the same cores (no GPU offered), which measured
    faster than separate replicas on every CPU tried (docs/BENCHMARKS.md), and as separate
    replicas where GPUs are offered, where a deploy file gives roles their own resources, or where
    a flag shapes separate replicas (``SEPARATE_SHAPES``)."""
    if hasattr(args, "aggregate"):
        return bool(args.aggregate), "--aggregate" if args.aggregate else "--no-aggregate"
    if local_gpus_offered(getattr(args, "num_gpus", -1)):
        return False, "GPUs offered: prefill and decode on their own devices"
    if config_file:
        return False, f"{config_file} gives each role its resources"
    shaped = [flag.option for flag in STACK if flag.option in SEPARATE_SHAPES and hasattr(args, flag.dest)]
    if shaped:
        return False, f"{', '.join(shaped)} shape{'s' if len(shaped) == 1 else ''} separate replicas"
    return True, "one machine, no GPU: both share its cores"


def add_secret_files(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key-file", metavar="FILE", help="read the API key from FILE (or set EPD_API_KEY)")
    parser.add_argument("--internal-token-file", metavar="FILE",
                        help="read the token calls between roles carry from FILE (default: a fresh random one per "
                             "deployment; give one to call internal services yourself)")


def with_secrets(config: DeployConfig, args: argparse.Namespace, environ: Mapping[str, str]) -> DeployConfig:
    """Fill in the secrets: the API key from --api-key, --api-key-file or EPD_API_KEY; the internal
    token from --internal-token-file or a fresh random one. Raises ConfigError naming the option."""
    security = config.serve.security
    api_key = security.api_key or _read_secret(getattr(args, "api_key_file", None), "--api-key-file") \
        or environ.get("EPD_API_KEY", "")
    token = _read_secret(getattr(args, "internal_token_file", None), "--internal-token-file") \
        or secrets.token_urlsafe(32)
    security = dataclasses.replace(security, api_key=api_key, internal_token=token)
    return dataclasses.replace(config, serve=dataclasses.replace(config.serve, security=security))


def _read_secret(path: str | None, option: str) -> str:
    if not path:
        return ""
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError as error:
        raise ConfigError(f"{option}: cannot read {path}: {error.strerror}") from None
    if not value:
        raise ConfigError(f"{option}: {path} is empty")
    return value


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flags: tuple[Flag, ...]) -> None:
    for flag in flags:
        cls, name = _field(flag.paths[0])
        kind = _type(cls, name)
        options: dict = {"dest": flag.dest, "default": argparse.SUPPRESS, "required": flag.required,
                         "type": kind, "metavar": flag.metavar or _METAVARS.get(kind)}
        if kind is bool:  # --switch / --no-switch
            options = {"dest": flag.dest, "default": argparse.SUPPRESS, "action": argparse.BooleanOptionalAction}
        if name == "dtype":
            options["choices"] = DTYPE_CHOICES
            del options["metavar"]
        text = flag.help or field_docs(cls).get(name, "")
        if not flag.required and "default:" not in text:
            default = field_default(cls, name)
            shown = "none" if default in (None, (), "") else "off" if default is False else default
            text += f" (default: {shown})"
        parser.add_argument(flag.option, help=text.replace("%", "%%"), **options)


def deploy_config(args: argparse.Namespace, flags: tuple[Flag, ...], config_file: str | None = None,
                  **fixed) -> DeployConfig:
    """The deployment config from the flags the user set (``fixed`` holds what the command
    decides itself, e.g. ``bind="node"``). Raises ``ConfigError`` naming the field."""
    overrides: dict = {}
    for flag in flags:
        if hasattr(args, flag.dest):
            for path in flag.paths:
                _put(overrides, path, getattr(args, flag.dest))
    for path, value in fixed.items():
        _put(overrides, path.replace("__", "."), value)
    if config_file:
        resources, autoscale = load_deploy_file(config_file)
        overrides["resources"], overrides["autoscale"] = resources, autoscale
        for role, tensor_parallel in deploy_file_tensor_parallel(config_file).items():
            if not hasattr(args, f"{role}_tensor_parallel"):  # the flag wins
                _put(overrides, f"serve.{role}.tensor_parallel", tensor_parallel)
    return _build(DeployConfig, overrides)


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def _put(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _build(cls: type, overrides: dict):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in overrides.items():
        kind = hints[name]
        if isinstance(value, dict) and dataclasses.is_dataclass(kind):
            value = _build(kind, value)
        kwargs[name] = value
    return cls(**kwargs)


def _field(path: str) -> tuple[type, str]:
    cls = DeployConfig
    *parents, leaf = path.split(".")
    for part in parents:
        cls = typing.get_type_hints(cls)[part]
    return cls, leaf


def _comma_list(text: str) -> tuple[str, ...]:
    """``a,b,c`` -> ("a", "b", "c"), blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _type(cls: type, name: str):
    kind = typing.get_type_hints(cls)[name]
    if kind in (int, float, str, bool):
        return kind
    if typing.get_origin(kind) is tuple and typing.get_args(kind) == (str, ...):
        return _comma_list
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # ``str | None``
        return next(arg for arg in typing.get_args(kind) if arg is not type(None))
    raise TypeError(f"{cls.__name__}.{name}: no command-line type for {kind}")
