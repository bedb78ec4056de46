"""The language-model runner shared by prefill and decode: it owns the weights and runs forwards.

Qwen3.5's language model is a hybrid: most layers are Gated DeltaNet (linear attention with a
fixed-size causal-conv state and recurrent state), every fourth is full attention with a growing
K/V cache. The runner walks transformers' own decoder modules (so the weights and the kernels are
the reference ones) but keeps every piece of per-request state in an explicit ``HybridState``
that the caller owns: nothing about a request is stored on the shared model object. That is what
lets prefill run in one process, the state travel as raw tensors, and decode continue in another.

The runner does not decide anything (which request runs, when state is freed): it only computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as qm



@dataclass
class HybridState:
    """One request's language-model state: K/V for full-attention layers, conv and recurrent
    states for linear-attention layers, indexed by layer (None where a layer has no such state)."""

    keys: list[torch.Tensor | None]  # [1, num_kv_heads, num_tokens, head_dim]
    values: list[torch.Tensor | None]
    conv: list[torch.Tensor | None]  # [1, conv_dim, conv_kernel]
    recurrent: list[torch.Tensor | None]  # [1, num_v_heads, key_head_dim, value_head_dim]
    num_tokens: int = 0

    @classmethod
    def empty(cls, num_layers: int) -> HybridState:
        return cls([None] * num_layers, [None] * num_layers, [None] * num_layers, [None] * num_layers)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Flat, ordered view used by the handoff serializer."""
        out: list[tuple[str, torch.Tensor]] = []
        for kind in ("keys", "values", "conv", "recurrent"):
            for layer, tensor in enumerate(getattr(self, kind)):
                if tensor is not None:
                    out.append((f"{kind}.{layer}", tensor))
        return out

    @classmethod
    def from_named_tensors(cls, num_layers: int, num_tokens: int, tensors: dict[str, torch.Tensor]) -> HybridState:
        state = cls.empty(num_layers)
        state.num_tokens = num_tokens
        for name, tensor in tensors.items():
            kind, layer = name.split(".")
            if kind not in ("keys", "values", "conv", "recurrent") or not 0 <= int(layer) < num_layers:
                raise ValueError(f"unknown state tensor {name!r}")
            getattr(state, kind)[int(layer)] = tensor
        return state

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_tensors())


@dataclass
class TextModelRunner:
    """Owns the language model's weights; runs prefill and decode forwards over a HybridState."""

    model: qm.Qwen3_5TextModel
    lm_head_weight: torch.Tensor  # [vocab, hidden]
    layer_types: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.layer_types = list(self.model.config.layer_types)

    @classmethod
    def load(cls, model_dir: str, dtype: str = "float32", device: str | None = None) -> TextModelRunner:
        """Load the language model of ``model_dir`` in ``dtype`` (a name: float32, bfloat16, float16)."""
        from epd import checkpoint  # heavy: only a role that serves the LM needs it
        from epd.tensors import default_device, parse_dtype

        device = device or default_device()
        model, lm_head = checkpoint.build_text_model(model_dir, dtype=parse_dtype(dtype), device=device)
        return cls(model=model, lm_head_weight=lm_head)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    def new_state(self) -> HybridState:
        return HybridState.empty(self.num_layers)

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` ids -> ``[num_tokens, hidden]`` embeddings."""
        return self.model.embed_tokens(token_ids.to(self.device))

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, state: HybridState) -> torch.Tensor:
        """Run ``embeds [T, hidden]`` at ``positions [3, T]`` on top of ``state`` (updated in place).

        Returns the final-norm hidden state of the last token, ``[hidden]``.
        """
        hidden = embeds.to(self.device, self.dtype).unsqueeze(0)  # [1, T, hidden]
        cos, sin = self.model.rotary_emb(hidden, positions.to(self.device).unsqueeze(1))
        for index, layer in enumerate(self.model.layers):
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            if self.layer_types[index] == "linear_attention":
                hidden = _linear_attention(layer.linear_attn, hidden, state, index)
            else:
                hidden = _full_attention(layer.self_attn, hidden, cos, sin, state, index)
            hidden = residual + hidden
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        state.num_tokens += embeds.shape[0]
        return self.model.norm(hidden[0, -1])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[hidden]`` -> float32 ``[vocab]`` logits."""
        return F.linear(hidden, self.lm_head_weight).float()


def _full_attention(
    attn: qm.Qwen3_5Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: HybridState, index: int
) -> torch.Tensor:
    """Gated full attention with partial M-RoPE; appends this chunk's K/V to the state."""
    batch, length, _ = x.shape
    head_dim = attn.head_dim
    query, gate = torch.chunk(attn.q_proj(x).view(batch, length, -1, head_dim * 2), 2, dim=-1)
    gate = gate.reshape(batch, length, -1)
    query = attn.q_norm(query).transpose(1, 2)
    key = attn.k_norm(attn.k_proj(x).view(batch, length, -1, head_dim)).transpose(1, 2)
    value = attn.v_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
    query, key = qm.apply_rotary_pos_emb(query, key, cos, sin)

    past_keys, past_values = state.keys[index], state.values[index]
    if past_keys is not None:
        key = torch.cat([past_keys, key], dim=2)
        value = torch.cat([past_values, value], dim=2)
    state.keys[index], state.values[index] = key, value

    mask = None
    if length > 1 and past_keys is not None:
        # A chunk on top of cached tokens: each new token sees all the past and its own prefix.
        total = key.shape[2]
        mask = torch.ones(length, total, dtype=torch.bool, device=x.device).tril(total - length)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=length > 1 and mask is None,
        scale=attn.scaling,
        enable_gqa=True,
    )
    out = out.transpose(1, 2).reshape(batch, length, -1)
    return attn.o_proj(out * torch.sigmoid(gate))


def _linear_attention(gdn: qm.Qwen3_5GatedDeltaNet, x: torch.Tensor, state: HybridState, index: int) -> torch.Tensor:
    """Gated DeltaNet over a chunk; carries the conv window and the recurrent state in ``state``."""
    batch, length, _ = x.shape
    mixed = gdn.in_proj_qkv(x).transpose(1, 2)  # [1, conv_dim, T]
    z = gdn.in_proj_z(x).reshape(batch, length, -1, gdn.head_v_dim)
    beta = gdn.in_proj_b(x).sigmoid()
    # float32 here because A may overflow to -inf in half precision (as transformers does).
    g = -gdn.A_log.float().exp() * F.softplus(gdn.in_proj_a(x).float() + gdn.dt_bias)
    weight = gdn.conv1d.weight.squeeze(1)
    kernel = gdn.conv_kernel_size

    conv_state = state.conv[index]
    if conv_state is not None and length == 1:
        conv_state = conv_state.clone()  # updated in place by the kernel; never alias a caller's tensor
        mixed = qm.causal_conv1d_update(mixed, conv_state, weight, gdn.conv1d.bias, gdn.activation)
    else:
        full = mixed if conv_state is None else torch.cat([conv_state, mixed], dim=-1)
        conv_state = F.pad(full, (max(0, kernel - full.shape[-1]), 0))[..., -kernel:].contiguous()
        mixed = qm.causal_conv1d_fn(full, weight, gdn.conv1d.bias, activation=gdn.activation)[..., -length:]
    state.conv[index] = conv_state

    mixed = mixed.transpose(1, 2)
    query, key, value = torch.split(mixed, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    query = query.reshape(batch, length, -1, gdn.head_k_dim)
    key = key.reshape(batch, length, -1, gdn.head_k_dim)
    value = value.reshape(batch, length, -1, gdn.head_v_dim)

    recurrent = state.recurrent[index]
    rule = qm.torch_recurrent_gated_delta_rule if recurrent is not None and length == 1 else qm.torch_chunk_gated_delta_rule
    core, state.recurrent[index] = rule(
        query, key, value, g=g, beta=beta, initial_state=recurrent, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
    return gdn.out_proj(core.reshape(batch, length, -1))
