"""Checkpoint presets, creation and loading, checked against transformers' own Qwen3.5."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

from epd.checkpoint import (
    build_text_model,
    build_vision_model,
    config_from_name,
    count_parameters,
    create_checkpoint,
    load_tensors,
    model_fingerprint,
    read_config,
    save_weights,
)
from epd.tokenizer_build import SPECIAL_TOKENS, THINK_TOKENS

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return create_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0, progress=False)


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model.eval()


def _weights(path):
    return load_file(path / "model.safetensors")


def _assert_same_tensors(ours: dict, theirs: dict):
    assert ours.keys() == theirs.keys()
    for k, v in ours.items():
        assert torch.equal(v, theirs[k]), k


def test_0_8b_parameter_counts():
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config_from_name("qwen3.5-0.8b"))
    assert f"{count_parameters(model.model.visual) / 1e6:.1f}M" == "100.6M"
    assert f"{count_parameters(model) / 1e6:.1f}M" == "853.0M"


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        config_from_name("nope")


def test_tiny_files(tiny_dir):
    assert EXPECTED_FILES <= {p.name for p in tiny_dir.iterdir()}
    assert not list(tiny_dir.parent.glob(".tiny.*"))  # temp dir was renamed away
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    cfg = read_config(tiny_dir)
    assert gen["eos_token_id"] == [cfg.text_config.eos_token_id, cfg.text_config.pad_token_id]
    raw = json.loads((tiny_dir / "config.json").read_text())
    # As published Qwen3.5 checkpoints say: vLLM keeps the recurrent state in this dtype.
    assert raw["text_config"]["mamba_ssm_dtype"] == "float32"
    pre = json.loads((tiny_dir / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "Qwen2VLImageProcessor" and pre["merge_size"] == 2


def test_create_refuses_non_empty_dir(tiny_dir):
    with pytest.raises(FileExistsError):
        create_checkpoint("tiny", tiny_dir, progress=False)


def test_hf_loads_saved_tensors(tiny_dir, hf_model):
    saved = _weights(tiny_dir)
    assert "lm_head.weight" not in saved  # tied
    state = hf_model.state_dict()
    for k, v in saved.items():
        assert torch.equal(state[k], v), k
    assert torch.equal(hf_model.lm_head.weight, saved["model.language_model.embed_tokens.weight"])


def test_build_text_model_matches_hf(tiny_dir, hf_model):
    text, head = build_text_model(tiny_dir)
    ref = hf_model.model.language_model
    _assert_same_tensors(text.state_dict(), ref.state_dict())
    assert torch.equal(text.rotary_emb.inv_freq, ref.rotary_emb.inv_freq)
    assert torch.equal(text.rotary_emb.original_inv_freq, ref.rotary_emb.original_inv_freq)
    assert head is text.embed_tokens.weight  # tied: same tensor, not a copy
    ids = torch.tensor([[5, 17, 300, 42, 9, 120, 77]])
    with torch.no_grad():
        ours = text(input_ids=ids).last_hidden_state
        theirs = ref(input_ids=ids).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_build_vision_model_matches_hf(tiny_dir, hf_model):
    vision = build_vision_model(tiny_dir)
    ref = hf_model.model.visual
    _assert_same_tensors(vision.state_dict(), ref.state_dict())
    assert torch.equal(vision.rotary_pos_emb.inv_freq, ref.rotary_pos_emb.inv_freq)
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = vision(pixels, grid_thw=grid).pooler_output
        theirs = ref(pixels, grid_thw=grid).pooler_output
    assert ours.shape == (4, 64)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_sharded_checkpoint_with_extra_tensors(tiny_dir, hf_model, tmp_path):
    # The 0.8b path (index + shards) plus a real checkpoint's mtp.* tensors, at tiny size.
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_dir, sharded)
    (sharded / "model.safetensors").unlink()
    state = dict(_weights(tiny_dir), **{"mtp.fc.weight": torch.ones(4, 4)})
    files = save_weights(state, sharded, progress=False, max_shard_bytes=512 * 1024)
    assert len(files) > 1 and (sharded / "model.safetensors.index.json").is_file()
    visual = load_tensors(sharded, "model.visual.")
    assert visual.keys() == hf_model.model.visual.state_dict().keys()
    text, _ = build_text_model(sharded)
    _assert_same_tensors(text.state_dict(), hf_model.model.language_model.state_dict())
    reloaded, info = Qwen3_5ForConditionalGeneration.from_pretrained(sharded, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    _assert_same_tensors(reloaded.state_dict(), hf_model.state_dict())
    assert model_fingerprint(sharded) != model_fingerprint(tiny_dir)


def test_seed_determinism_and_fingerprint(tiny_dir, tmp_path):
    same = create_checkpoint("tiny", tmp_path / "same", seed=0, progress=False)
    other = create_checkpoint("tiny", tmp_path / "other", seed=1, progress=False)
    _assert_same_tensors(_weights(same), _weights(tiny_dir))
    assert model_fingerprint(same) == model_fingerprint(tiny_dir)
    assert model_fingerprint(other) != model_fingerprint(tiny_dir)
    assert len(model_fingerprint(tiny_dir)) == 64


def test_tokenizer_special_tokens(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = read_config(tiny_dir)
    ids = {t: tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS + THINK_TOKENS}
    assert all(len(v) == 1 for v in ids.values()), ids
    flat = [v[0] for v in ids.values()]
    assert flat == sorted(flat) and len(set(flat)) == len(flat)  # Qwen's order, distinct
    assert ids["<|image_pad|>"][0] == cfg.image_token_id
    assert ids["<|video_pad|>"][0] == cfg.video_token_id
    assert ids["<|vision_start|>"][0] == cfg.vision_start_token_id
    assert ids["<|vision_end|>"][0] == cfg.vision_end_token_id
    assert ids["<|im_end|>"][0] == cfg.text_config.eos_token_id == tok.eos_token_id
    assert ids["<|endoftext|>"][0] == cfg.text_config.pad_token_id == tok.pad_token_id
    assert cfg.text_config.bos_token_id is None
    assert len(tok) <= cfg.text_config.vocab_size and cfg.text_config.vocab_size % 64 == 0


@pytest.mark.parametrize("text", ["Hello, world!", "def f(x):\n    return x ** 2  # 3.14", "Zürich 日本 🙂\n\n  end"])
def test_tokenizer_round_trip(tiny_dir, text):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\n"
    out = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert out == prompt + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == out
    thinking = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert thinking == prompt + "<think>\n"
    with_system = [{"role": "system", "content": "Be brief."}] + messages
    assert tok.apply_chat_template(with_system, tokenize=False).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    ids = tok.encode(out, add_special_tokens=False)
    assert ids.count(read_config(tiny_dir).image_token_id) == 1


def test_read_config_errors(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        read_config(tmp_path)


def test_the_cli_offers_every_preset():
    from control.cli import PRESET_NAMES
    from epd.checkpoint import PRESETS

    assert set(PRESET_NAMES) == set(PRESETS)
