"""Qwen3.5 checkpoints, dense and mixture-of-experts: named presets, random-weight creation, and loading.

This module owns the on-disk model format used by every stage:

* ``PRESETS`` / ``config_from_name``: Qwen3.5 configs in the real architecture
  (``tiny`` for tests/demos, ``tiny-moe``: ``tiny``'s dims with a sparse mixture-of-experts
  MLP, and ``PUBLISHED``: every released size, 0.8B to 397B-A17B, with its published shapes),
  whose token ids come from :mod:`epd.tokenizer_build`.
* ``create_checkpoint``: a Hugging Face checkpoint with transformers' own random
  init, written by our own safetensors writer, loadable by the family's
  ``...ForConditionalGeneration.from_pretrained`` (the correctness oracle); refused first by
  ``check_can_create`` (RAM and disk, from ``epd.memory_plan``) before anything is allocated.
  Which transformers classes a ``model_type`` uses is :mod:`epd.family`'s table.
* ``read_config`` / ``load_tensors`` / ``build_vision_model`` /
  ``build_text_model``: the loading path shared by our presets and real
  downloaded Qwen3.5 checkpoints (extra tensors such as ``mtp.*`` are ignored).
* ``model_fingerprint`` / ``count_parameters``: identity and size helpers.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import struct
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import PreTrainedConfig

from epd import memory_plan
from epd.family import EXPERTS_IMPLEMENTATION, FAMILIES, Family, family_of, family_of_config
from epd.tokenizer_build import build_tokenizer, special_token_ids

if TYPE_CHECKING:  # modeling_utils costs seconds to import; the roles that never build a model skip it
    from transformers import PreTrainedModel

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 2 * 10**9  # HF's "2GB" (decimal), as save_pretrained uses
VISION_PREFIX = "model.visual."
TEXT_PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"
# Loads smaller than this finish before a progress bar would be useful.
_PROGRESS_MIN_BYTES = 256 * 1024**2
_FINGERPRINT_SAMPLE = 1024**2

# The video processor's file as Qwen3-VL/Qwen3.5 checkpoints publish it (Qwen3VLVideoProcessor; fps,
# min/max frames are the class defaults). Without it transformers falls back to Qwen2-VL's video
# processor built from preprocessor_config.json, which Qwen3.5 checkpoints never do.
VIDEO_PREPROCESSOR_CONFIG = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "processor_class": "Qwen3VLProcessor",
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,
}

_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


# --------------------------------------------------------------------------- presets


def _layer_types(num_layers: int, full_every: int = 4) -> list[str]:
    # Qwen3.5 puts a full-attention layer after every three linear-attention ones.
    return ["full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(num_layers)]


def _token_config(ids: dict[str, int]) -> dict:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def _make_config(text: dict, vision: dict, initializer_range: float, family: Family = FAMILIES["qwen3_5"],
                 tied: bool = True) -> PreTrainedConfig:
    tokenizer = build_tokenizer()
    ids = special_token_ids(tokenizer)
    text = dict(text)
    if text.get("vocab_size") is None:
        # Round up so the embedding has a GEMM-friendly row count.
        text["vocab_size"] = -(-len(tokenizer) // 64) * 64
    text.update(
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
        tie_word_embeddings=tied,
        initializer_range=initializer_range,
        layer_types=_layer_types(text["num_hidden_layers"]),
        hidden_act="silu",
        rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4,
        # Published Qwen3.5 checkpoints keep Gated DeltaNet's recurrent state in float32 and say
        # so here; vLLM reads it (without it vLLM keeps the state in the model's dtype), and epd's
        # state is float32 in both dtypes.
        mamba_ssm_dtype="float32",
    )
    vision = dict(vision, initializer_range=initializer_range, hidden_act="gelu_pytorch_tanh", in_channels=3)
    return family.config(
        architectures=[family.architecture],  # as published checkpoints say (vLLM reads it)
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=tied,
        dtype="float32",
        **_token_config(ids),
    )


def _tiny_text() -> dict:
    return dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        intermediate_size=128,
        vocab_size=None,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    )


def _tiny_vision() -> dict:
    return dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
    )


def _tiny() -> PreTrainedConfig:
    # Wider init than 0.02 so random greedy decoding has decisive logits.
    return _make_config(_tiny_text(), _tiny_vision(), initializer_range=0.1)


def _tiny_moe() -> PreTrainedConfig:
    """``tiny``'s dims with Qwen3.5-MoE's sparse MLP in every layer: 8 experts of width 32, the top
    2 per token (softmax router renormalised over the top k), a shared expert of width 64 behind a
    sigmoid gate; the router, experts and shared expert as transformers builds and initialises them."""
    text = _tiny_text()
    del text["intermediate_size"]  # the MoE config has no dense MLP width
    text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    return _make_config(text, _tiny_vision(), initializer_range=0.1, family=FAMILIES["qwen3_5_moe"])


def _tiny_32k() -> PreTrainedConfig:
    """``tiny``'s layers with a 32,768-token window: long requests in tests of the memory model."""
    config = _tiny()
    config.text_config.max_position_embeddings = 32768
    return config


def _tiny_hd64() -> PreTrainedConfig:
    """``tiny`` with linear-attention head dims of 64: vLLM's CPU Gated DeltaNet kernels take only
    64 or 128 (``tiny``'s 16 fails to load there), so ``epd bench --baseline vllm`` tests run on it."""
    config = _tiny()
    config.text_config.linear_key_head_dim = 64
    config.text_config.linear_value_head_dim = 64
    return config


# --- the published family -------------------------------------------------------------------
# Shapes as each model's config.json on the Hugging Face Hub publishes them (Qwen/Qwen3.5-<size>,
# main). Read from public copies, cross-checked where two disagreed: p-doom/omegalax
# omegalax/models/qwen3_5/config.py (every size, dense and MoE, and the three vision towers), a
# Chandra/Qwen3.6-27B config.json fixture (4B and 27B text and vision, verbatim config.json), a
# simulator's KNOWN_MODEL_METADATA table (35B-A3B and 397B-A17B text, incl. linear heads), an NPU
# run script (122B-A10B: 16 key / 64 value linear heads) and Megatron-style vision variant tables
# (small 0.8B, medium 2B/4B, large 9B/27B/MoE). One disagreement: a Megatron-Bridge test fixture
# gives 397B-A17B shared_expert_intermediate_size 4096 ("a sample ... configuration"); two copies
# of the published config give 1024, kept here. Common to all: head_dim 256, linear key/value head
# dims 128 with 16 key heads, conv kernel 4, full attention every fourth layer, vocab 248320,
# 262,144-token window, M-RoPE sections [11, 11, 10] over a quarter of each head, theta 1e7,
# vision patch 16, merge 2, temporal patch 2, 2304 position embeddings. Token ids stay epd's own
# tokenizer's (tokenizer_build): only the shapes are the published ones.

_VISION_TOWERS = {  # depth, hidden, MLP width, heads
    "small": dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12),  # 0.8B
    "medium": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16),  # 2B, 4B
    "large": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16),  # 9B, 27B, MoE
}


def _published(hidden: int, layers: int, heads: int, kv_heads: int, linear_v_heads: int, tower: str,
               tied: bool, intermediate: int = 0, experts: tuple[int, int, int, int] | None = None
               ) -> PreTrainedConfig:
    """A published size: ``experts`` = (num_experts, num_experts_per_tok, moe_intermediate_size,
    shared_expert_intermediate_size) for a MoE model, else the dense MLP's ``intermediate``."""
    text = dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=linear_v_heads,
        linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    )
    family = FAMILIES["qwen3_5"]
    if experts is None:
        text["intermediate_size"] = intermediate
    else:
        family = FAMILIES["qwen3_5_moe"]
        num, top_k, width, shared = experts
        text.update(num_experts=num, num_experts_per_tok=top_k, moe_intermediate_size=width,
                    shared_expert_intermediate_size=shared)
    vision = dict(_VISION_TOWERS[tower], out_hidden_size=hidden, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=2304)
    return _make_config(text, vision, initializer_range=0.02, family=family, tied=tied)


def _qwen35_0_8b() -> PreTrainedConfig:
    return _published(1024, 24, 8, 2, 16, "small", tied=True, intermediate=3584)


PUBLISHED: dict[str, Callable[[], PreTrainedConfig]] = {
    "qwen3.5-0.8b": _qwen35_0_8b,
    "qwen3.5-2b": lambda: _published(2048, 24, 8, 2, 16, "medium", tied=True, intermediate=6144),
    "qwen3.5-4b": lambda: _published(2560, 32, 16, 4, 32, "medium", tied=True, intermediate=9216),
    "qwen3.5-9b": lambda: _published(4096, 32, 16, 4, 32, "large", tied=False, intermediate=12288),
    "qwen3.5-27b": lambda: _published(5120, 64, 24, 4, 48, "large", tied=False, intermediate=17408),
    "qwen3.5-35b-a3b": lambda: _published(2048, 40, 16, 2, 32, "large", tied=False, experts=(256, 8, 512, 512)),
    "qwen3.5-122b-a10b": lambda: _published(3072, 48, 32, 2, 64, "large", tied=False, experts=(256, 8, 1024, 1024)),
    "qwen3.5-397b-a17b": lambda: _published(4096, 60, 32, 2, 64, "large", tied=False, experts=(512, 10, 1024, 1024)),
}


PRESETS: dict[str, Callable[[], PreTrainedConfig]] = {
    "tiny": _tiny,
    "tiny-32k": _tiny_32k,
    "tiny-hd64": _tiny_hd64,
    "tiny-moe": _tiny_moe,
    **PUBLISHED,
}


def config_from_name(name: str) -> PreTrainedConfig:
    """A fresh config for preset ``name`` (configs are mutable, so never shared)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


def count_parameters(module: torch.nn.Module) -> int:
    """Number of parameters, counting tied (shared) tensors once."""
    return sum(p.numel() for _, p in module.named_parameters(remove_duplicate=True))


# --------------------------------------------------------------------------- writing


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # View as raw bytes so bf16 (which numpy lacks) works too; safetensors is little-endian.
    return memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())


def _shard_plan(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _write_safetensors(path: pathlib.Path, tensors: dict[str, torch.Tensor], bar) -> None:
    """Stream one safetensors file: 8-byte header length, JSON header, raw data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the spec wants the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors.values():
            f.write(_tensor_bytes(t))
            bar.update(1)


def save_weights(state: dict[str, torch.Tensor], out_dir, progress: bool = True,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """Write ``state`` as HF safetensors (sharded + index when over ``max_shard_bytes``)."""
    out_dir = pathlib.Path(out_dir)
    plan = _shard_plan(state, max_shard_bytes)
    names = [SINGLE_FILE] if len(plan) == 1 else [
        f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))
    ]
    with tqdm(total=len(state), desc="writing tensors", unit="tensor", disable=not progress) as bar:
        for fname, keys in zip(names, plan):
            _write_safetensors(out_dir / fname, {k: state[k] for k in keys}, bar)
    if len(plan) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: fname for fname, keys in zip(names, plan) for k in keys},
        }
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


def _generation_config(config: PreTrainedConfig) -> dict:
    text = config.text_config
    return {
        "eos_token_id": [text.eos_token_id, text.pad_token_id],  # [<|im_end|>, <|endoftext|>]
        "pad_token_id": text.pad_token_id,
        "do_sample": False,
    }


CREATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def creation_need(config: PreTrainedConfig, what: str = "a random checkpoint", dtype: str = "float32"
                  ) -> memory_plan.Need:
    """What creating a random checkpoint of ``config`` holds at once: transformers builds the
    whole model in ``dtype`` (the state dict shares its tensors, the writer streams them), plus
    1 GiB for the Python process, torch and the tokenizer."""
    params = memory_plan.count_params(json.loads(config.to_json_string()))
    size = CREATE_DTYPES[dtype].itemsize
    return memory_plan.Need(what, dtype, {"weights": params.total * size, "process": memory_plan.GIB})


def check_can_create(preset: str, out_dir, available_ram: int | None = None, available_disk: int | None = None,
                     dtype: str = "float32") -> memory_plan.Need:
    """Raise ``DoesNotFit`` (before anything is allocated) when this host's free RAM, or the free
    disk where ``out_dir`` goes, cannot hold a random checkpoint of ``preset`` in ``dtype``."""
    what = f"a random {preset} checkpoint"
    hint = "pass --config-only to write its config and tokenizer alone"
    if dtype == "float32":
        hint += ", or --dtype bfloat16 to need half"
    need = creation_need(config_from_name(preset), what, dtype)
    ram = memory_plan.host_available() if available_ram is None else available_ram
    memory_plan.check_fits(need, ram, "this host's RAM", hint)
    if available_disk is None:
        probe = pathlib.Path(out_dir).resolve()
        while not probe.exists():
            probe = probe.parent
        available_disk = shutil.disk_usage(probe).free
    weights = memory_plan.Need(what, dtype, {"safetensors files": need.parts["weights"]})
    memory_plan.check_fits(weights, available_disk, f"the disk under {out_dir}", hint)
    return need


def _write_metadata_files(config: PreTrainedConfig, out_dir: pathlib.Path) -> None:
    config.save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(json.dumps(_generation_config(config), indent=2) + "\n")
    build_tokenizer().save_pretrained(out_dir)  # also writes chat_template.jinja
    (out_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PREPROCESSOR_CONFIG, indent=2) + "\n")


def _write_checkpoint_files(preset: str, out_dir: pathlib.Path, seed: int, progress: bool,
                            config_only: bool, dtype: str = "float32") -> None:
    config = config_from_name(preset)
    if config_only:  # config + tokenizer: enough for memory planning and placement, no weights
        _write_metadata_files(config, out_dir)
        return
    torch.manual_seed(seed)
    # Built in ``dtype`` from the start (the default dtype while the modules are made): a bfloat16
    # checkpoint never holds a float32 copy, so it needs half the memory.
    default = torch.get_default_dtype()
    torch.set_default_dtype(CREATE_DTYPES[dtype])
    try:
        model = family_of_config(config).conditional_generation(config).to(CREATE_DTYPES[dtype]).eval()
    finally:
        torch.set_default_dtype(default)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop(LM_HEAD, None)  # tied: the embedding is the head
    del model  # the state dict keeps the tensors; drop the module graph early
    _write_metadata_files(config, out_dir)
    save_weights(state, out_dir, progress=progress)


def create_checkpoint(preset: str, out_dir, seed: int = 0, progress: bool = True,
                      overwrite: bool = False, config_only: bool = False, dtype: str = "float32") -> pathlib.Path:
    """Create a random-weight checkpoint of ``preset`` in ``out_dir``, its weights stored in
    ``dtype`` (float32, or bfloat16 as Qwen publishes its checkpoints); returns the path.

    ``config_only``: write config.json, the tokenizer and the processor config but no weights (a
    checkpoint for memory planning and placement, of any size). Otherwise ``check_can_create``
    refuses first, with ``DoesNotFit``, a preset this host's RAM or disk cannot hold.

    Files are written to a sibling temp dir and renamed into place, so an
    interrupted create never leaves a half checkpoint behind. An existing
    non-empty ``out_dir`` is an error unless ``overwrite``.
    """
    out_dir = pathlib.Path(out_dir).resolve()
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True)")
    if dtype not in CREATE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(CREATE_DTYPES)}, got {dtype!r}")
    if not config_only:
        check_can_create(preset, out_dir, dtype=dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; a checkpoint should be readable by other users
    try:
        _write_checkpoint_files(preset, tmp, seed, progress, config_only, dtype)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# --------------------------------------------------------------------------- reading


def read_config(model_dir) -> PreTrainedConfig:
    """The Qwen3.5 (dense or MoE) config in ``model_dir``; ValueError if missing or another model type."""
    # family_of makes the check `epd serve` makes before Ray starts, too
    return family_of(model_dir).config.from_pretrained(model_dir)


def _weight_files(model_dir: pathlib.Path) -> dict[str, list[str] | None]:
    """File name -> tensor names it holds (None: all of them, unindexed single file)."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        files: dict[str, list[str]] = {}
        for name, fname in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(fname, []).append(name)
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return {SINGLE_FILE: None}
    raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def _read_header(path: pathlib.Path) -> tuple[bytes, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
    return raw, json.loads(raw)


def _nbytes(entry: dict) -> int:
    start, end = entry["data_offsets"]
    return end - start


def stored_dtype(model_dir, prefix: str = TEXT_PREFIX) -> torch.dtype:
    """The dtype the first floating tensor under ``prefix`` is stored in (read from a header only)."""
    model_dir = pathlib.Path(model_dir)
    by_name = {name: dtype for dtype, name in _ST_DTYPES.items()}
    for fname in _weight_files(model_dir):
        _, header = _read_header(model_dir / fname)
        for name, entry in header.items():
            dtype = by_name.get(entry["dtype"], torch.int8) if name != "__metadata__" else torch.int8
            if name.startswith(prefix) and dtype.is_floating_point:
                return dtype
    raise ValueError(f"no floating tensor under {prefix!r} in {model_dir}")


def load_tensors(model_dir, prefix: str, progress: bool = False) -> dict[str, torch.Tensor]:
    """Tensors whose name starts with ``prefix``, keyed with the prefix stripped."""
    model_dir = pathlib.Path(model_dir)
    wanted: dict[str, list[str]] = {}
    total = 0
    for fname in _weight_files(model_dir):
        _, header = _read_header(model_dir / fname)
        names = [k for k in header if k != "__metadata__" and k.startswith(prefix)]
        if names:
            wanted[fname] = names
            total += sum(_nbytes(header[k]) for k in names)
    count = sum(len(v) for v in wanted.values())
    out: dict[str, torch.Tensor] = {}
    show = progress and total >= _PROGRESS_MIN_BYTES
    with tqdm(total=count, desc=f"loading {prefix or 'tensors'}", unit="tensor", disable=not show) as bar:
        for fname, names in wanted.items():
            with safe_open(model_dir / fname, framework="pt", device="cpu") as f:
                for name in names:
                    out[name[len(prefix):]] = f.get_tensor(name)
                    bar.update(1)
    return out


def _assign_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], dtype, device) -> None:
    tensors = {
        k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in tensors.items()
    }
    model.load_state_dict(tensors, strict=True, assign=True)


def _check_materialized(model: torch.nn.Module, what: str) -> None:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{what}: tensors still on the meta device after loading: {left[:5]}")


def build_vision_model(model_dir, dtype=torch.float32, device="cpu") -> PreTrainedModel:
    """The vision tower (the family's vision model) from ``model.visual.*`` tensors only, in eval mode."""
    family = family_of(model_dir)
    config = family.config.from_pretrained(model_dir).vision_config
    with torch.device("meta"):
        model = family.vision_model(config)
    _assign_weights(model, load_tensors(model_dir, VISION_PREFIX), dtype, device)
    # inv_freq is a non-persistent buffer (not in the file): meta-init left it
    # empty, so rebuild the parameter-free rotary module for real.
    with torch.device(device):
        model.rotary_pos_emb = family.vision_rotary(config)
    _check_materialized(model, "vision model")
    return model.eval()


def build_text_model(model_dir, dtype=torch.float32, device="cpu") -> tuple[PreTrainedModel, torch.Tensor]:
    """The language model (the family's text model) from ``model.language_model.*`` plus the LM
    head weight. A MoE model runs its experts with ``epd.family.EXPERTS_IMPLEMENTATION``.

    The head is ``lm_head.weight`` when the checkpoint has one, else (tied
    embeddings) the very same tensor as ``embed_tokens.weight``.
    """
    model_dir = pathlib.Path(model_dir)
    family = family_of(model_dir)
    config = family.config.from_pretrained(model_dir).text_config
    if family.moe:
        config._experts_implementation = EXPERTS_IMPLEMENTATION  # checked by transformers at construction
    with torch.device("meta"):
        model = family.text_model(config)
    _assign_weights(model, load_tensors(model_dir, TEXT_PREFIX, progress=True), dtype, device)
    with torch.device(device):
        model.rotary_emb = family.text_rotary(config)  # see build_vision_model
    _check_materialized(model, "text model")
    head = load_tensors(model_dir, LM_HEAD).get("")
    if head is not None:
        head = head.to(device=device, dtype=dtype)
    else:
        head = model.embed_tokens.weight
    return model.eval(), head


# --------------------------------------------------------------------------- identity


def model_fingerprint(model_dir) -> str:
    """Hex sha256 identifying a checkpoint's config and weights, without a full read.

    Hashes config.json's bytes, then per weight file (sorted by name): its name,
    size, raw safetensors header (names, dtypes, shapes, offsets) and a 1 MiB
    sample of tensor data (512 KiB from the start of the data section and
    512 KiB from its end). Any re-initialisation rewrites those bytes, so a new
    seed gives a new fingerprint; hashing all 3.4 GB of the 0.8b would be slow.
    """
    model_dir = pathlib.Path(model_dir)
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    half = _FINGERPRINT_SAMPLE // 2
    for fname in sorted(_weight_files(model_dir)):
        path = model_dir / fname
        size = path.stat().st_size
        raw, _ = _read_header(path)
        h.update(f"\0{fname}\0{size}\0".encode())
        h.update(raw)
        data_start = 8 + len(raw)
        with open(path, "rb") as f:
            f.seek(data_start)
            h.update(f.read(half))
            f.seek(max(data_start, size - half))
            h.update(f.read(half))
    return h.hexdigest()
