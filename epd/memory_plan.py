"""What a checkpoint costs in memory, from its config.json alone, before anything is loaded.

Plain Python (json only, no torch): ``epd model create`` and ``epd serve`` ask it before they
import torch or start Ray, and every model role asks it again in its own process before it reads a
weight, so a model that cannot fit is refused in one line naming the numbers instead of dying part
way through a load (or being killed by the kernel's OOM killer).

* ``count_params``: the parameters of each piece (vision tower, decoder, embedding, LM head, the
  routed experts), counted from the shapes transformers builds for ``qwen3_5`` / ``qwen3_5_moe``
  (``tests/test_memory_plan.py`` checks the counts against the model transformers builds on the
  meta device, for every preset).
* ``kv_bytes_per_token`` / ``slot_state_bytes``: a request's full-attention K/V per token and its
  fixed-size Gated DeltaNet state (conv + recurrent, float32 recurrent as transformers keeps it).
* ``active_bytes_per_token``: the weight bytes one decode token reads; for a MoE model only its
  ``num_experts_per_tok`` routed experts count (plus the shared expert, attention, router, head).
* ``role_need``: one role's bytes (weights + K/V pool + linear-attention slots + activations) as a
  ``Need`` whose parts name each term; ``check_fits`` raises ``DoesNotFit`` with them in one line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1024**3


class DoesNotFit(ValueError):
    """A role (or a checkpoint's creation) needs more memory than the device or host has; the
    message names what it needs, each part, and what is available."""


@dataclass(frozen=True)
class ParamCount:
    vision: int  # the vision tower (merger included)
    decoder: int  # the language model's layers and final norm, routed experts included
    embedding: int  # embed_tokens
    head: int  # lm_head (0 when tied to the embedding)
    experts: int  # of ``decoder``: the routed experts' weights (0 for a dense model)
    expert_params_each: int  # one routed expert in one layer (gate, up, down)

    @property
    def text(self) -> int:
        """What a language-model role (prefill or decode) holds."""
        return self.decoder + self.embedding + self.head

    @property
    def total(self) -> int:
        return self.vision + self.text


def read_raw_config(model_dir) -> dict:
    with open(os.path.join(os.fspath(model_dir), "config.json")) as f:
        return json.load(f)


def _text(raw: dict) -> dict:
    return raw.get("text_config") or raw


def _tied(raw: dict) -> bool:
    if "tie_word_embeddings" in raw:
        return bool(raw["tie_word_embeddings"])
    return bool(_text(raw).get("tie_word_embeddings", False))


def is_moe(raw: dict) -> bool:
    return bool(_text(raw).get("num_experts"))


def _layer_types(text: dict) -> list[str]:
    types = text.get("layer_types")
    if types:
        return list(types)
    every = text.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(text["num_hidden_layers"])]


def _full_attention_params(t: dict) -> int:
    hidden, heads, kv, dim = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    # q_proj carries the output gate too (2 x heads x dim); q_norm and k_norm are per head_dim
    return hidden * heads * dim * 2 + 2 * hidden * kv * dim + heads * dim * hidden + 2 * dim


def _linear_attention_params(t: dict) -> int:
    hidden = t["hidden_size"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value_dim = t["linear_num_value_heads"] * t["linear_value_head_dim"]
    v_heads = t["linear_num_value_heads"]
    conv_dim = 2 * key_dim + value_dim
    return (hidden * conv_dim  # in_proj_qkv
            + hidden * value_dim  # in_proj_z
            + 2 * hidden * v_heads  # in_proj_b, in_proj_a
            + conv_dim * t.get("linear_conv_kernel_dim", 4)  # depthwise conv1d, no bias
            + 2 * v_heads  # dt_bias, A_log
            + t["linear_value_head_dim"]  # gated RMSNorm over a head
            + value_dim * hidden)  # out_proj


def _mlp_params(t: dict) -> tuple[int, int, int]:
    """(params of one layer's MLP, of which routed experts, one expert's params)."""
    hidden = t["hidden_size"]
    if not t.get("num_experts"):
        return 3 * hidden * t["intermediate_size"], 0, 0
    each = 3 * hidden * t["moe_intermediate_size"]
    experts = t["num_experts"] * each
    shared = 3 * hidden * t["shared_expert_intermediate_size"]
    router = t["num_experts"] * hidden
    return experts + shared + router + hidden, experts, each  # + hidden: shared_expert_gate (hidden -> 1)


def _vision_params(v: dict) -> int:
    hidden, inter = v["hidden_size"], v["intermediate_size"]
    patch = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2 * hidden + hidden
    pos = v["num_position_embeddings"] * hidden
    block = 4 * hidden + (3 * hidden * hidden + 3 * hidden) + (hidden * hidden + hidden) \
        + (hidden * inter + inter) + (inter * hidden + hidden)
    merged = hidden * v["spatial_merge_size"] ** 2
    merger = 2 * hidden + merged * merged + merged + merged * v["out_hidden_size"] + v["out_hidden_size"]
    return patch + pos + v["depth"] * block + merger


def count_params(raw: dict) -> ParamCount:
    t = _text(raw)
    hidden = t["hidden_size"]
    mlp, experts, each = _mlp_params(t)
    decoder = hidden  # final norm
    num_experts = 0
    for kind in _layer_types(t):
        mixer = _full_attention_params(t) if kind == "full_attention" else _linear_attention_params(t)
        decoder += mixer + mlp + 2 * hidden  # + input and post-attention RMSNorms
        num_experts += experts
    embedding = t["vocab_size"] * hidden
    vision = _vision_params(raw["vision_config"]) if raw.get("vision_config") else 0
    return ParamCount(vision=vision, decoder=decoder, embedding=embedding, head=0 if _tied(raw) else embedding,
                      experts=num_experts, expert_params_each=each)


def kv_bytes_per_token(raw: dict, dtype: str) -> int:
    """Bytes of K and V one token holds over every full-attention layer (decode's paged-pool unit)."""
    t = _text(raw)
    full = sum(kind == "full_attention" for kind in _layer_types(t))
    return full * 2 * t["num_key_value_heads"] * t["head_dim"] * DTYPE_BYTES[dtype]


def slot_state_bytes(raw: dict, dtype: str) -> int:
    """Bytes of one request's Gated DeltaNet state over every linear-attention layer: the conv
    window in the model's dtype, the recurrent state in float32 (transformers' gated delta rule)."""
    t = _text(raw)
    linear = sum(kind == "linear_attention" for kind in _layer_types(t))
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    conv = (2 * key_dim + t["linear_num_value_heads"] * t["linear_value_head_dim"]) * t.get("linear_conv_kernel_dim", 4)
    recurrent = t["linear_num_value_heads"] * t["linear_key_head_dim"] * t["linear_value_head_dim"]
    return linear * (conv * DTYPE_BYTES[dtype] + recurrent * 4)


def active_params_per_token(raw: dict) -> int:
    """Weights one decode token reads: the whole language model (head included: every logit),
    except that of the routed experts only its ``num_experts_per_tok`` per MoE layer count; the
    embedding is a row lookup (one row, counted as 0)."""
    params = count_params(raw)
    t = _text(raw)
    head = params.head or params.embedding  # tied: the embedding table is the head's weight
    if not params.experts:
        return params.decoder + head
    moe_layers = len(_layer_types(t))
    active_experts = moe_layers * t["num_experts_per_tok"] * params.expert_params_each
    return params.decoder - params.experts + active_experts + head


def active_bytes_per_token(raw: dict, dtype: str) -> int:
    return active_params_per_token(raw) * DTYPE_BYTES[dtype]


@dataclass
class Need:
    """Bytes one role needs, by part, and the dtype they were counted in."""

    what: str  # "decode", "prefill", "encoder", "model create"
    dtype: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = " + ".join(f"{name} {_gib(n)}" for name, n in self.parts.items() if n)
        return f"{_gib(self.total)} ({parts}, {self.dtype})"


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def role_need(raw: dict, role: str, dtype: str, *, max_batch_size: int = 32, kv_cache_bytes: int = 0,
              swap_space_bytes: int = 0, chunk_tokens: int = 512, max_held_bytes: int = 0,
              max_image_patches: int = 16384) -> Need:
    """What ``role`` (``encoder``, ``prefill`` or ``decode``) holds for the checkpoint ``raw``.

    decode: the language model's weights, the K/V pool when its size is given (``kv_cache_bytes``;
    0: the pool takes a share of what is left once the weights are in, so it is sized to fit and
    not counted here), ``max_batch_size`` slots of linear-attention state, swap space, a step's
    logits and the LM head's int8 copy that screens greedy rows (counted on every CPU). prefill:
    weights, one chunk's activations (the widest projection's output per token, the MLP or the
    experts' hidden, a few copies of the residual) and the held-state budget.
    encoder: the vision tower and one forward's activations at ``max_image_patches`` patches.
    Activations are an estimate (the order of a forward's live tensors, not an exact peak)."""
    size = DTYPE_BYTES[dtype]
    params = count_params(raw)
    need = Need(role, dtype)
    if role == "encoder":
        v = raw["vision_config"]
        need.parts["weights"] = params.vision * size
        need.parts["activations"] = max_image_patches * (8 * v["hidden_size"] + 2 * v["intermediate_size"]) * size
        return need
    t = _text(raw)
    need.parts["weights"] = params.text * size
    if role == "decode":
        need.parts["K/V pool"] = kv_cache_bytes
        need.parts["linear-attention slots"] = max_batch_size * slot_state_bytes(raw, dtype)
        need.parts["swap space"] = swap_space_bytes
        need.parts["activations"] = max_batch_size * (t["vocab_size"] * 4 + 16 * t["hidden_size"] * size)
        # the LM head's int8 copy that screens greedy rows and its four float figures a column
        # (kernels.GreedyScreen; CPUs with AMX-INT8 or AVX-512 VNNI)
        need.parts["greedy screen"] = t["vocab_size"] * (t["hidden_size"] + 16)
    elif role == "prefill":
        widest = max(t.get("intermediate_size") or 0,
                     (t.get("num_experts_per_tok") or 0) * (t.get("moe_intermediate_size") or 0),
                     2 * t["num_attention_heads"] * t["head_dim"],
                     2 * t["linear_num_key_heads"] * t["linear_key_head_dim"]
                     + t["linear_num_value_heads"] * t["linear_value_head_dim"])
        need.parts["activations"] = chunk_tokens * (2 * widest + 8 * t["hidden_size"]) * size + t["vocab_size"] * 4
        need.parts["held states"] = max_held_bytes
    else:
        raise ValueError(f"unknown role {role!r}")
    return need


ROLE_HINT = "a smaller dtype (--dtype bfloat16), fewer replicas, a smaller K/V pool, or more devices"


def check_fits(need: Need, available: int, where: str, hint: str = ROLE_HINT) -> None:
    """Raise ``DoesNotFit`` when ``need`` is more than ``available`` bytes of ``where``; the
    message says what is needed, by part, what ``where`` has, and ``hint`` (what would help)."""
    if need.total > available:
        raise DoesNotFit(f"{need.what} needs {need.describe()} but {where} has {_gib(available)} available; "
                         f"{hint}")


def host_available() -> int:
    """Bytes of host RAM a new allocation could take now (MemAvailable)."""
    import psutil

    return int(psutil.virtual_memory().available)


# --------------------------------------------------------------------------- roles of a deployment

MODEL_ROLES = ("encoder", "prefill", "decode")
AGGREGATE = "prefill+decode"
"""The role of an aggregated replica (``DeployConfig.aggregate``): one process that holds the
language model once and does both prefill's and decode's work."""
MIB = 1024**2


def need_of_role(raw: dict, role: str, serve) -> Need:
    """``role_need`` with the sizes ``serve`` (an ``epd.config.ServeConfig``) sets for that role;
    ``AGGREGATE``: decode's need (the weights once, its pool, slots and logits) plus a step's
    activations at ``prefill.step_tokens`` and prefill's held states."""
    if role == AGGREGATE:
        need = need_of_role(raw, "decode", serve)
        prefill = role_need(raw, "prefill", serve.prefill.dtype, chunk_tokens=serve.prefill.step_tokens,
                            max_held_bytes=serve.prefill.max_held_mb * MIB)
        need.what = AGGREGATE
        need.parts["step activations"] = prefill.parts["activations"]
        need.parts["held states"] = prefill.parts["held states"]
        return need
    if role == "encoder":
        config = serve.encode
        return role_need(raw, "encoder", config.dtype, max_image_patches=config.max_batch_patches or 16384)
    if role == "prefill":
        config = serve.prefill
        need = role_need(raw, "prefill", config.dtype, chunk_tokens=config.chunk_tokens,
                         max_held_bytes=config.max_held_mb * MIB)
    else:
        config = serve.decode
        need = role_need(raw, "decode", config.dtype, max_batch_size=config.max_batch_size,
                         kv_cache_bytes=config.kv_cache_bytes, swap_space_bytes=config.swap_space_bytes)
    world = getattr(config, "tensor_parallel", 1)
    if world > 1:  # the ranks share the host: each also holds the whole embedding, and is a process
        need.parts[f"embedding in {world - 1} more ranks"] = (world - 1) * count_params(raw).embedding \
            * DTYPE_BYTES[config.dtype]
        need.parts[f"{world - 1} more rank processes"] = (world - 1) * 512 * MIB
    return need


def tensor_parallel_problem(raw: dict, world: int) -> str:
    """Why the language model of ``raw`` (config.json) cannot be split over ``world`` ranks the way
    ``epd.tensor_parallel`` splits it ('' when it can): every head count and width it cuts must
    divide by ``world``."""
    text = _text(raw)
    parts = {name: text.get(name) for name in (
        "num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
        "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "vocab_size")}
    bad = [f"{name} {value}" for name, value in parts.items() if isinstance(value, int) and value % world]
    return f"the model does not split over {world} ranks ({', '.join(bad)}: not divisible by {world})" if bad else ""


def check_role(model_dir, role: str, serve, available: int, where: str) -> Need:
    """In a role's own process, before it reads a weight: raise ``DoesNotFit`` unless what it
    needs fits in ``available`` bytes of ``where`` (its GPU's free memory, or host RAM)."""
    need = need_of_role(read_raw_config(model_dir), role, serve)
    check_fits(need, available, where)
    return need


def check_deployment(model_dir, serve, replicas: dict[str, int], available: int, where: str,
                     aggregate: bool = False) -> Need:
    """Before Ray starts (``epd serve``, every role on this host): raise ``DoesNotFit`` unless the
    model replicas of every role together fit in ``available`` bytes of ``where``. With
    ``aggregate`` the prefill replicas are aggregated ones (``AGGREGATE``) and decode has none."""
    raw = read_raw_config(model_dir)
    replicas = dict(replicas)
    if aggregate:
        replicas[AGGREGATE] = replicas.pop("prefill", 0)
        replicas.pop("decode", None)
    roles = ("encoder", AGGREGATE) if aggregate else MODEL_ROLES
    total = Need(" + ".join(f"{replicas[r]} {r}" for r in roles if replicas.get(r)), _dtypes(serve))
    for role in roles:
        count = replicas.get(role, 0)
        if count:
            need = need_of_role(raw, role, serve)
            total.parts[f"{role}{f' x {count}' if count > 1 else ''} (weights {_gib(need.parts['weights'])})"] = \
                need.total * count
    check_fits(total, available, where)
    return total


def _dtypes(serve) -> str:
    names = {serve.encode.dtype, serve.prefill.dtype, serve.decode.dtype}
    return "/".join(sorted(names))


def device_available(device: str) -> tuple[int, str]:
    """(bytes a new allocation could take now, a name for the message) on ``device``: a GPU's
    free memory, or host RAM."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0]), f"GPU {device}"
    return host_available(), "this host's RAM"
