"""The machinery's tunables (resume limit, keepalive, message cap, heartbeat, restarts, encoder
concurrency, store breaker...) live in the config dataclasses: one default each, checked at start
with an error naming the field, set by a flag of `epd serve` / `epd deploy`, applied where they
bound something, and listed in docs/OPERATIONS.md."""

from __future__ import annotations

import pathlib
import re

import pytest

from control import cli, flags
from epd import config as cfg
from epd import discovery, rpc
from epd.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent

# option -> (config path from DeployConfig, default before the move: the defaults did not change)
TUNABLES = {
    "--max-resumes": ("serve.router.max_resumes", 8),
    "--reserve-hold-s": ("serve.decode.reserve_hold_s", 10.0),
    "--encoder-gpu-batch-patches": ("serve.encode.gpu_batch_patches", 16384),
    "--encoder-concurrency": ("serve.encode.actor_concurrency", 64),
    "--encode-lease-s": ("serve.encode.lease_s", 5.0),
    "--encode-lease-wait-s": ("serve.encode.lease_wait_s", 300.0),
    "--store-timeout-s": ("serve.store.timeout_s", 2.0),
    "--store-breaker-base-s": ("serve.store.breaker_base_s", 0.25),
    "--store-breaker-max-s": ("serve.store.breaker_max_s", 5.0),
    "--keepalive-s": ("serve.rpc.keepalive_s", 5.0),
    "--max-message-mb": ("serve.rpc.max_message_mb", 256),
    "--internal-max-concurrent-rpcs": ("serve.rpc.max_concurrent_rpcs", 4096),
    "--executor-threads": ("serve.rpc.executor_threads", 16),
    "--max-restarts": ("max_restarts", 3),
    "--heartbeat-s": ("heartbeat_s", 1.0),
    "--refill-grace-s": ("refill_grace_s", 15.0),
    "--status-wait-s": ("status_wait_s", 2.0),
    "--probe-interval-s": ("probe_interval_s", 1.0),
    "--probe-timeout-s": ("probe_timeout_s", 2.0),
    "--max-start-failures": ("max_start_failures", 3),
    "--start-timeout-s": ("start_timeout_s", 900.0),
}


def _get(config, path: str):
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _serve_config(model_dir: str, *argv: str) -> cfg.DeployConfig:
    args = cli._parser().parse_args(["serve", "--model", model_dir, *argv])
    return flags.deploy_config(args, flags.SERVE)


def test_defaults_are_the_ones_the_module_constants_had(tiny_model_dir):
    config = _serve_config(tiny_model_dir)
    assert {option: _get(config, path) for option, (path, _) in TUNABLES.items()} == \
        {option: default for option, (_, default) in TUNABLES.items()}
    assert rpc.MAX_MESSAGE_BYTES == 256 * 1024 * 1024 and rpc.KEEPALIVE_S == 5.0
    assert discovery.HEARTBEAT_S == 1.0 and discovery.REFILL_GRACE_S == 15.0


@pytest.mark.parametrize("command", ["serve", "deploy"])
def test_every_tunable_is_a_flag_that_sets_its_field(tiny_model_dir, command):
    argv = [command, "--model", tiny_model_dir] + (["--redis", "redis://127.0.0.1:1/0", "--address", "127.0.0.1:1"] if command == "deploy" else [])
    values = {}
    for option, (path, default) in TUNABLES.items():
        value = default * 2 if "breaker_base" not in path else 1.0  # within every bound, unlike the default
        values[option] = type(default)(value)
        argv += [option, str(values[option])]
    args = cli._parser().parse_args(argv)
    config = flags.deploy_config(args, flags.SERVE if command == "serve" else flags.DEPLOY)
    assert {option: _get(config, path) for option, (path, _) in TUNABLES.items()} == values


@pytest.mark.parametrize("argv, message", [
    (["--max-resumes", "-1"], "router.max_resumes: must be in [0, 1000], got -1"),
    (["--keepalive-s", "0.1"], "rpc.keepalive_s: must be in [1, 3600], got 0.1"),
    (["--max-message-mb", "4096"], "rpc.max_message_mb: must be in [1, 2047], got 4096"),
    (["--executor-threads", "0"], "rpc.executor_threads: must be in [1, 1024], got 0"),
    (["--encoder-concurrency", "0"], "encode.actor_concurrency: must be in [1, 4096], got 0"),
    (["--store-breaker-base-s", "2", "--store-breaker-max-s", "1"], "store.breaker_max_s: must be in [2, 3600], got 1.0"),
    (["--heartbeat-s", "0"], "heartbeat_s: must be in [0.05, 60], got 0.0"),
    (["--max-restarts", "-2"], "max_restarts: must be in [0, 1000], got -2"),
])
def test_a_bad_value_is_refused_naming_the_field(tiny_model_dir, argv, message):
    with pytest.raises(ConfigError) as error:
        _serve_config(tiny_model_dir, *argv)
    assert str(error.value) == message


def test_serve_refuses_a_bad_tunable_in_one_line(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--model", tiny_model_dir, "--keepalive-s", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "rpc.keepalive_s: must be in [1, 3600], got 0.0" in err and "Traceback" not in err


def test_rpc_configure_sets_the_processes_channel_and_server_options():
    before = list(rpc.CHANNEL_OPTIONS)
    try:
        rpc.configure(cfg.RpcConfig(keepalive_s=7.0, max_message_mb=8, max_concurrent_rpcs=5, executor_threads=3))
        options = dict(rpc.CHANNEL_OPTIONS)
        assert options["grpc.keepalive_time_ms"] == 7000 and options["grpc.max_receive_message_length"] == 8 << 20
        assert dict(rpc.KEEPALIVE_OPTIONS)["grpc.http2.min_recv_ping_interval_without_data_ms"] == 5600
        assert rpc.MAX_CONCURRENT_RPCS == 5
        loop = rpc.EventLoop("tunables")
        try:
            assert loop.loop._default_executor._max_workers == 3
        finally:
            loop.close()
    finally:
        rpc.configure(cfg.RpcConfig())
    assert rpc.CHANNEL_OPTIONS == before


def test_store_and_encoder_take_their_settings_from_the_config():
    from encode_svc.engine import EncoderEngine
    from epd.store import EmbeddingStore

    store = EmbeddingStore.from_config(cfg.StoreConfig(redis_url="redis://127.0.0.1:1/0", timeout_s=0.5,
                                                       breaker_base_s=1.5, breaker_max_s=9.0))
    assert (store._breaker.base_s, store._breaker.max_s) == (1.5, 9.0)
    assert store._redis.connection_pool.connection_kwargs["socket_timeout"] == 0.5
    serve = cfg.ServeConfig.__new__(cfg.ServeConfig)  # actor_options reads only the encode section
    object.__setattr__(serve, "encode", cfg.EncodeConfig(actor_concurrency=7))
    assert EncoderEngine.actor_options(serve) == {"max_concurrency": 7}


def test_a_registry_warms_up_for_three_of_its_heartbeats():
    assert discovery.Registry(heartbeat_s=0.5)._warmup_s == 1.5
    assert discovery.Registry()._warmup_s == 3.0


def test_operations_lists_every_tunable_with_its_default():
    text = (ROOT / "docs" / "OPERATIONS.md").read_text()
    table = text.split("## Tunables", 1)[1].split("\n## ", 1)[0]
    for option, (path, default) in TUNABLES.items():
        row = next((line for line in table.splitlines() if line.startswith(f"| `{option}`")), None)
        assert row is not None, f"{option} missing from docs/OPERATIONS.md's Tunables table"
        assert re.search(rf"\| `?{re.escape(str(default))}`? \|", row), f"{option}: default {default} not in {row!r}"


@pytest.mark.parametrize("argv, gpus, aggregate, why", [
    ([], False, True, "one machine, no GPU"),
    (["--aggregate"], True, True, "--aggregate"),
    (["--no-aggregate"], False, False, "--no-aggregate"),
    (["--decode", "2"], False, False, "--decode shapes separate replicas"),
    (["--decode-threads", "1", "--decode-cpus", "1"], False, False, "--decode-threads, --decode-cpus shape"),
    (["--num-gpus", "1"], False, False, "GPUs offered"),
    ([], True, False, "GPUs offered"),
])
def test_one_machine_stacks_default_to_the_aggregated_engine(tiny_model_dir, monkeypatch, argv, gpus, aggregate, why):
    """`epd serve` on a machine without GPUs runs prefill and decode as one engine per replica
    (the mode that measured faster on every CPU: docs/BENCHMARKS.md) unless a flag asks for
    separate replicas or shapes them; with GPUs offered they stay separate. `epd deploy` keeps
    the config's default (separate)."""
    import os.path

    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda path: gpus if path == "/dev/nvidiactl" else real(path))
    args = cli._parser().parse_args(["serve", "--model", tiny_model_dir, *argv])
    chosen, reason = flags.one_machine_mode(args)
    assert chosen is aggregate and why in reason
    config = flags.deploy_config(args, flags.SERVE, aggregate=chosen)
    assert config.aggregate is aggregate and config.replicas("decode") == (0 if aggregate else int(
        dict(zip(argv, argv[1:])).get("--decode", 1)))
    deploy = cli._parser().parse_args(["deploy", "--model", tiny_model_dir, "--redis", "redis://127.0.0.1:1/0",
                                       "--address", "127.0.0.1:1"])
    assert flags.deploy_config(deploy, flags.DEPLOY, bind="node").aggregate is False
    explicit = "--aggregate" in argv or "--no-aggregate" in argv  # a deploy file gives roles their own resources
    assert flags.one_machine_mode(args, "roles.toml")[0] is (aggregate if explicit else False)
