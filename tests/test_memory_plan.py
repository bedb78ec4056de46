"""Memory planning from config.json (epd.memory_plan) for every preset, and the refusals that use
it: `epd model create` of a preset this host cannot hold, `epd serve` of a deployment that cannot
fit, and each model role's constructor, all before anything is allocated. No large checkpoint is
written: the big presets are config-only directories (config + tokenizer, no weights)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from epd import memory_plan as mp
from epd.checkpoint import (
    PRESETS,
    PUBLISHED,
    check_can_create,
    config_from_name,
    count_parameters,
    create_checkpoint,
    creation_need,
)
from epd.family import family_of_config
from tests.conftest import epd
from tests.test_cli_errors import assert_one_line_error

GIB = 1024**3

# Published names: billions of parameters in total (and active per token, for MoE), the name's figure
NAMED = {
    "qwen3.5-0.8b": (0.8, None), "qwen3.5-2b": (2, None), "qwen3.5-4b": (4, None), "qwen3.5-9b": (9, None),
    "qwen3.5-27b": (27, None), "qwen3.5-35b-a3b": (35, 3), "qwen3.5-122b-a10b": (122, 10),
    "qwen3.5-397b-a17b": (397, 17),
}


def _raw(name: str) -> dict:
    return json.loads(config_from_name(name).to_json_string())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_counts_match_the_model_transformers_builds(name):
    """Every preset, built on the meta device (no memory): the counted parameters of the vision
    tower, the language model and the head are exactly transformers' own."""
    config = config_from_name(name)
    params = mp.count_params(_raw(name))
    with torch.device("meta"):
        model = family_of_config(config).conditional_generation(config)
    assert params.vision == count_parameters(model.model.visual)
    assert params.decoder + params.embedding == count_parameters(model.model.language_model)
    assert params.head == (0 if config.tie_word_embeddings else model.lm_head.weight.numel())
    if mp.is_moe(_raw(name)):
        experts = sum(layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
                      for layer in model.model.language_model.layers)
        assert params.experts == experts


def test_every_published_size_is_a_preset_with_the_size_its_name_says():
    assert set(PUBLISHED) == set(NAMED)
    for name, (total_b, active_b) in NAMED.items():
        raw = _raw(name)
        total = mp.count_params(raw).total / 1e9
        assert 0.95 * total_b <= total <= 1.15 * total_b, (name, total)  # 0.8B counts 0.85B, 4B 4.54B
        assert mp.is_moe(raw) == (active_b is not None)
        if active_b:  # the experts a token reads, plus attention, shared expert, head: 2.95B, 9.01B, 16.3B
            active = mp.active_params_per_token(raw) / 1e9
            assert 0.85 * active_b <= active <= 1.05 * active_b, (name, active)


def test_state_bytes_agree_with_the_runner(tiny_model_dir, tiny_moe_model_dir):
    from epd.lm import TextModelRunner

    for model_dir in (tiny_model_dir, tiny_moe_model_dir):
        raw = mp.read_raw_config(model_dir)
        for dtype in ("float32", "bfloat16"):
            runner = TextModelRunner.load(model_dir, dtype=dtype, prepack=False)
            assert mp.kv_bytes_per_token(raw, dtype) == runner.kv_bytes_per_token()
            assert mp.slot_state_bytes(raw, dtype) == runner.slot_state_bytes()
            weights = sum(t.numel() * t.element_size() for t in runner.model.state_dict().values())
            assert mp.count_params(raw).text * mp.DTYPE_BYTES[dtype] == weights  # tied: no separate head


@pytest.mark.parametrize("name", sorted(NAMED))
def test_creation_is_planned_for_every_preset(name, tmp_path):
    """The bytes creation needs are the float32 weights + 1 GiB; with less RAM or disk than that
    it is refused, saying both numbers, and nothing is written."""
    need = creation_need(config_from_name(name))
    assert need.parts["weights"] == mp.count_params(_raw(name)).total * 4
    with pytest.raises(mp.DoesNotFit, match=rf"a random {name} checkpoint needs {need.total / GIB:.2f} GiB .* "
                                            r"this host's RAM has 1.00 GiB available"):
        check_can_create(name, tmp_path / "out", available_ram=GIB, available_disk=1 << 50)
    with pytest.raises(mp.DoesNotFit, match=r"the disk under .* has 2.00 GiB available"):
        check_can_create(name, tmp_path / "out", available_ram=1 << 50, available_disk=2 * GIB)
    assert check_can_create(name, tmp_path / "out", available_ram=1 << 50, available_disk=1 << 50).total == need.total
    assert not (tmp_path / "out").exists()


def test_model_create_refuses_a_preset_this_host_cannot_hold(tmp_path):
    out = tmp_path / "big"
    started = time.monotonic()
    result = epd("model", "create", "--preset", "qwen3.5-397b-a17b", "--out", str(out), timeout=120)
    line = assert_one_line_error(result, "epd model create: error:", "a random qwen3.5-397b-a17b checkpoint needs",
                                 "GiB", "available", "--config-only")
    assert f"{creation_need(config_from_name('qwen3.5-397b-a17b')).total / GIB:.2f} GiB" in line
    assert not out.exists() and time.monotonic() - started < 60


@pytest.fixture(scope="module")
def config_only_397b(tmp_path_factory) -> str:
    return str(create_checkpoint("qwen3.5-397b-a17b", tmp_path_factory.mktemp("cfg") / "397b", config_only=True))


def test_epd_serve_refuses_a_deployment_that_cannot_fit_in_one_line(config_only_397b):
    started = time.monotonic()
    result = epd("serve", "--model", config_only_397b, "--dtype", "bfloat16", timeout=60)
    # on a machine without GPUs the stack is aggregated by default: prefill and decode in one replica
    line = assert_one_line_error(result, "epd serve: error:", "1 encoder + 1 prefill+decode needs",
                                 "this host's RAM has", "bfloat16")
    raw = mp.read_raw_config(config_only_397b)
    assert f"weights {mp.count_params(raw).text * 2 / GIB:.2f} GiB" in line  # the language model's, in bf16
    assert time.monotonic() - started < 30  # before Ray: no role was started


def test_each_model_role_refuses_before_loading(config_only_397b, monkeypatch):
    """The check every role's constructor makes before it reads a weight (its checkpoint here has
    none: getting past the check would fail on the missing files instead). The 397B's language
    model cannot fit this host; its vision tower (1.8 GB) can, so the encoder sees 1 GiB."""
    from decode_svc.server import DecodeServer
    from encode_svc.engine import EncoderEngine
    from epd.config import DecodeConfig, ServeConfig
    from epd.discovery import RoleContext
    from pd_svc.server import AggregateServer
    from prefill_svc.server import PrefillServer

    serve = ServeConfig(model_dir=config_only_397b)
    for role, make in (("decode", DecodeServer), ("prefill", PrefillServer), (r"prefill\+decode", AggregateServer),
                       ("encoder", EncoderEngine)):
        if role == "encoder":
            monkeypatch.setattr(mp, "host_available", lambda: GIB)
        with pytest.raises(mp.DoesNotFit, match=rf"^{role} needs [0-9.]+ GiB \(weights .*this host's RAM has"):
            make(serve, RoleContext(name=f"{role}-0"))
    # a K/V pool asked for explicitly is counted: a tiny model with a 10 PiB pool is refused too
    tiny = ServeConfig(model_dir=config_only_397b, decode=DecodeConfig(kv_cache_bytes=1 << 50))
    need = mp.need_of_role(mp.read_raw_config(config_only_397b), "decode", tiny)
    assert need.parts["K/V pool"] == 1 << 50


def test_a_deployment_that_fits_passes_and_sums_its_replicas(tiny_model_dir):
    from epd.config import ServeConfig

    serve = ServeConfig(model_dir=tiny_model_dir)
    one = mp.check_deployment(tiny_model_dir, serve, {"encoder": 1, "prefill": 1, "decode": 1}, 1 << 40, "RAM")
    two = mp.check_deployment(tiny_model_dir, serve, {"encoder": 2, "prefill": 2, "decode": 2}, 1 << 40, "RAM")
    assert two.total == 2 * one.total
    with pytest.raises(mp.DoesNotFit, match=r"2 encoder \+ 2 prefill \+ 2 decode needs"):
        mp.check_deployment(tiny_model_dir, serve, {"encoder": 2, "prefill": 2, "decode": 2}, one.total, "RAM")


def test_an_aggregated_replica_is_planned_as_both_engines_in_one_process(tiny_model_dir):
    """One aggregated replica holds the weights once (not a prefill's copy and a decode's), decode's
    slots and logits, and a step's activations at prefill.step_tokens (not chunk_tokens)."""
    from epd.config import PrefillConfig, ServeConfig

    raw = mp.read_raw_config(tiny_model_dir)
    serve = ServeConfig(model_dir=tiny_model_dir, prefill=PrefillConfig(step_tokens=4096, chunk_tokens=256))
    decode, prefill = mp.need_of_role(raw, "decode", serve), mp.need_of_role(raw, "prefill", serve)
    both = mp.need_of_role(raw, mp.AGGREGATE, serve)
    assert both.parts["weights"] == decode.parts["weights"] == prefill.parts["weights"]
    logits = raw["text_config"]["vocab_size"] * 4  # one row's logits, counted once at any chunk size
    assert both.parts["step activations"] == 16 * prefill.parts["activations"] - 15 * logits
    assert both.total == decode.total + both.parts["step activations"] + prefill.parts["held states"]
    # at a step budget of one chunk, two aggregated replicas need two copies of the weights less
    serve = ServeConfig(model_dir=tiny_model_dir, prefill=PrefillConfig(step_tokens=256, chunk_tokens=256))
    separate = mp.check_deployment(tiny_model_dir, serve, {"encoder": 1, "prefill": 2, "decode": 2}, 1 << 40, "RAM")
    aggregated = mp.check_deployment(tiny_model_dir, serve, {"encoder": 1, "prefill": 2, "decode": 0}, 1 << 40, "RAM",
                                     aggregate=True)
    assert aggregated.total == separate.total - 2 * both.parts["weights"]
    with pytest.raises(mp.DoesNotFit, match=r"^1 encoder \+ 2 prefill\+decode needs"):
        mp.check_deployment(tiny_model_dir, serve, {"encoder": 1, "prefill": 2, "decode": 0}, aggregated.total - 1,
                            "RAM", aggregate=True)


def test_the_roofline_counts_a_moe_tokens_active_experts(tiny_model_dir, tiny_moe_model_dir):
    from bench.roofline import ModelCost

    dense = ModelCost.of(tiny_model_dir, torch.float32)
    assert dense.active_lm_params == dense.lm_params and dense.step_weight_bytes(16) == dense.weight_bytes
    moe = ModelCost.of(tiny_moe_model_dir, torch.float32)
    raw = mp.read_raw_config(tiny_moe_model_dir)
    assert moe.step_weight_bytes(1) == mp.active_bytes_per_token(raw, "float32")  # top_k experts a layer
    assert moe.step_weight_bytes(1) < moe.step_weight_bytes(16) < moe.weight_bytes
    assert moe.active_lm_params < moe.lm_params


def test_a_bfloat16_checkpoint_is_created_in_half_the_memory_and_loads(tmp_path):
    """``--dtype bfloat16``: the need is half the float32 weights (+ 1 GiB), the files hold
    bfloat16 tensors, and the language model loads from them in float32 and runs."""
    config = config_from_name("tiny")
    half, full = creation_need(config, dtype="bfloat16"), creation_need(config)
    assert half.parts["weights"] * 2 == full.parts["weights"] and half.dtype == "bfloat16"
    result = epd("model", "create", "--preset", "tiny", "--dtype", "bfloat16", "--out", str(tmp_path / "bf16"),
                 timeout=120)
    assert result.returncode == 0, result.stderr
    from epd import positions
    from epd.checkpoint import stored_dtype
    from epd.lm import TextModelRunner

    assert stored_dtype(tmp_path / "bf16") == torch.bfloat16
    files = sum(p.stat().st_size for p in (tmp_path / "bf16").glob("*.safetensors"))
    assert files < half.parts["weights"] * 1.01  # two bytes a weight on disk too
    runner = TextModelRunner.load(str(tmp_path / "bf16"), dtype="float32", prepack=False)
    pos, _ = positions.mrope_positions(3, [])
    logits = runner.logits(runner.forward(runner.embed(torch.tensor([1, 2, 3])), pos, runner.new_state()))
    assert torch.isfinite(logits).all()
