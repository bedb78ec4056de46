"""Prefill's and the vision tower's CPU fast paths: batched matrix products through oneDNN, the
fused chunked gated delta rule (``chunk_gated_delta_rule``, ``epd/csrc/gdn_chunk.cpp``) and the
same library's causal conv and gated RMSNorm (``causal_conv1d``, ``gated_rms_norm``), the vision
tower's attention, rotary embedding, patch embedding and MLP GELU.

On this project's CPUs (AMD EPYC with AVX-512) ATen sends a float32 ``bmm``/``matmul`` to MKL,
which runs the Gated DeltaNet chunk products (``[heads, 32, 128] @ [heads, 128, 128]``) and the
vision tower's attention scores at ~95 GFLOP/s on one core; oneDNN, which libtorch already carries,
runs the same float32 products about 2x faster, bit-identical on every shape the kernels use (a
test checks it). ATen only routes float32 matmuls to oneDNN when reduced-precision float32 math
(bf32/tf32) is allowed, which epd never allows; ``epd/csrc/prefill_matmul.cpp`` is a ten-line
operator that calls the same oneDNN entry point in strict float32.

The operator is compiled with ``torch.utils.cpp_extension`` at first use (g++ and ninja; ~15 s,
once per torch version) by ``epd.fused.compile_library`` into ``$XDG_CACHE_HOME/epd/torch_extensions``
(``~/.cache`` by default), beside the fused decode kernel.
If it cannot be built or loaded, or ``EPD_PREFILL_KERNELS=0``, a warning says so once and every
product falls back to ``torch.matmul``: slower, same results. bfloat16 products stay on ATen,
which already uses oneDNN for them.

The fused chunked rule is built the same way (``-O3 -march=native``, one build per torch version
and CPU): the torch path's time was memory-bound passes over whole-prompt float32 tensors, which
the fused rule keeps in a per-thread workspace (docs/ARCHITECTURE.md). ``EPD_PREFILL_KERNELS=0``
turns every path of this module off.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "prefill_matmul.cpp"
_NAME = "epd_prefill_dnnl"


def cache_dir() -> Path:
    """Where the compiled operator lives: per user, per torch version (an ABI boundary)."""
    from epd import fused

    return fused.cache_dir() / f"{_NAME}_{fused.torch_tag()}"


@functools.cache
def available() -> bool:
    """Build (or find) and load the operator once per process; False, with one warning, when it
    is switched off or cannot be had. A freshly loaded operator is checked against
    ``torch.matmul`` on a small product before anything uses it."""
    if _switched_off():
        return False
    if not torch.backends.mkldnn.is_available():
        log.warning("oneDNN is not available in this torch: prefill products use torch.matmul")
        return False
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # torch's mkldnn_matmul refuses every dtype on such CPUs (AVX2 only, e.g. AMD Zen 3): its
        # check asks for AVX-512 (or AVX-NE-CONVERT) whatever the inputs; MKL is what runs there
        log.info("this CPU has no AVX-512: prefill products use torch.matmul (MKL)")
        return False
    try:
        from epd import fused

        fused.compile_library(_NAME, _SOURCE, ["-O2"], cache_dir())
        gen = torch.Generator().manual_seed(0)  # its own: the global generator's sequence stays the caller's
        a, b = torch.randn(2, 5, 7, generator=gen), torch.randn(2, 7, 3, generator=gen)
        out = torch.empty(2, 5, 3)
        torch.ops.epd_prefill.bmm_out(a, b, out, 0.0, 1.0)
        if not torch.allclose(out, a @ b, rtol=1e-5, atol=1e-5):
            raise RuntimeError("its self-check disagrees with torch.matmul")
    except Exception as error:  # noqa: BLE001 - any failure means the torch fallback
        log.warning("the oneDNN prefill operator is unavailable (%s): prefill products use torch.matmul "
                    "(slower; the same products to float32 rounding)", str(error).strip().splitlines()[-1] if str(error).strip() else
                    type(error).__name__)
        return False
    return True


def _switched_off() -> bool:
    """``EPD_PREFILL_KERNELS=0``: every fast path of this module off (the torch path runs)."""
    return os.environ.get("EPD_PREFILL_KERNELS", "1") == "0"


def _usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == torch.float32 and b.dtype == torch.float32 and a.device.type == "cpu"
            and b.device.type == "cpu" and a.dim() >= 3 and a.dim() == b.dim()
            and a.shape[:-2] == b.shape[:-2] and not torch.is_grad_enabled() and available())


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a [..., M, K]`` and ``b [..., K, N]`` with equal leading dims: oneDNN for
    float32 on a CPU, ``torch.matmul`` otherwise. Returns a contiguous ``[..., M, N]``."""
    if not _usable(a, b):
        return a @ b
    batch = a.shape[:-2]
    out = a.new_empty(*batch, a.shape[-2], b.shape[-1])
    torch.ops.epd_prefill.bmm_out(_flat(a), _flat(b), out.view(-1, *out.shape[-2:]), 0.0, 1.0)
    return out


def addmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``out += alpha * (a @ b)`` in place (``out`` contiguous in its last two dims' batches):
    one pass, the sum inside the product. Same result as ``out.add_(a @ b, alpha=alpha)`` for
    ``alpha`` of +-1 (the product is rounded once, then added)."""
    if not _usable(a, b) or not out.is_contiguous():
        return out.add_(a @ b, alpha=alpha)
    torch.ops.epd_prefill.bmm_out(_flat(a), _flat(b), out.view(-1, *out.shape[-2:]), 1.0, alpha)
    return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[..., M, K]`` -> ``[batch, M, K]``: a view where the leading dims allow it."""
    return x if x.dim() == 3 else x.reshape(-1, *x.shape[-2:])


# ---------------------------------------------------------------- the fused chunked gated delta rule

_GDN_SOURCE = Path(__file__).with_name("csrc") / "gdn_chunk.cpp"
GDN_CHUNK_DTYPES = (torch.bfloat16, torch.float32)
"""The dtypes whose prefill chunks run the fused rule (float32 too: the parity tests pass with it)."""


@functools.cache
def gdn_chunk_op():
    """The fused chunked gated delta rule (``epd/csrc/gdn_chunk.cpp``), built (``-O3
    -march=native``: one build per torch version, CPU and version of the C++ sources, like the decode kernel) or loaded once
    per process; None, with one warning, when it cannot be had, or None when
    ``EPD_PREFILL_KERNELS=0``."""
    if _switched_off():
        return None
    from epd import fused

    name = fused.native_name("epd_gdn_chunk")  # per torch, CPU and version of the C++ sources
    try:
        fused.compile_library(name, _GDN_SOURCE, ["-O3", "-march=native"])
        return torch.ops.epd_gdn_chunk.chunk_rule
    except Exception as error:  # noqa: BLE001 - any failure means the torch path
        lines = str(error).strip().splitlines() or [type(error).__name__]
        reason = next((line for line in lines if "error:" in line), lines[-1])
        log.warning("the fused chunked gated delta rule is unavailable (%s): prefill runs the torch path "
                    "(slower; the same results to float32 rounding)", reason.strip())
        return None


def _prefill_op(x: torch.Tensor, name: str):
    """``torch.ops.epd_gdn_chunk.<name>`` (built with the fused rule, ``gdn_chunk_op``) for a CPU
    tensor of a dtype it serves outside autograd; None otherwise."""
    if x.device.type != "cpu" or x.dtype not in GDN_CHUNK_DTYPES or torch.is_grad_enabled() or gdn_chunk_op() is None:
        return None
    return getattr(torch.ops.epd_gdn_chunk, name)


def serves(x: torch.Tensor) -> bool:
    """Whether the fused prefill ops of ``epd/csrc/gdn_chunk.cpp`` (``causal_conv1d``,
    ``gated_rms_norm``, the chunked rule) serve a tensor like ``x`` here."""
    return _prefill_op(x, "conv") is not None


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                  window: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``epd.kernels.causal_conv1d`` (same contract, same arithmetic) in one C++ call on a CPU for
    bfloat16 and float32 with SiLU or no activation: the torch path's concatenation, dtype
    conversions and K passes over ``[T, C]`` become one pass (86 of a 247-token prompt's 567 ms on
    one core went to them). Anything else runs the torch path."""
    from epd import kernels

    op = _prefill_op(x, "conv") if activation in (None, "silu", "swish") and x.shape[-1] > 0 else None
    if op is None or (window is not None and window.dtype != x.dtype):
        return kernels.causal_conv1d(x, weight, bias, activation, window=window)
    rows = x.transpose(1, 2)  # [B, T, C]: the input projection's own layout when x is its transposed view
    taps = weight.t().float().contiguous()  # [K, C]
    out, new_window = op(rows if rows.stride(-1) == 1 else rows.contiguous(), window, taps,
                         None if bias is None else bias.float(), activation is not None)
    return out.transpose(1, 2), new_window


def gated_rms_norm(norm: torch.nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet's gated RMSNorm (transformers' ``Qwen3_5RMSNormGated``, per head of
    ``norm.weight``'s size) of ``core`` and the gate ``z``, both ``[T, heads * dim]`` (rows may be
    strided), in one C++ call where it serves; ``[T, heads * dim]``, what the module computes on
    the per-head rows, rounded where it rounds."""
    op = _prefill_op(core, "gated_norm") if core.dtype == z.dtype == norm.weight.dtype else None
    if op is None or core.stride(-1) != 1 or z.stride(-1) != 1:
        dim = norm.weight.shape[0]
        return norm(core.reshape(-1, dim), z.reshape(-1, dim)).reshape(core.shape[0], -1)
    return op(core, z, norm.weight, norm.variance_epsilon)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False):
    """``epd.kernels.chunk_gated_delta_rule`` (same contract, same chunking and algebra) in one
    fused C++ call on a CPU, for bfloat16 and float32 inputs: ``query``/``key`` ``[B, T, k_heads,
    k_dim]`` and ``value`` ``[B, T, v_heads, v_dim]`` may be strided views (the conv output's
    split), ``g``/``beta`` ``[B, T, v_heads]``. Anything else (another device or dtype, autograd,
    the op unavailable) runs the torch path."""
    from epd import kernels

    op = None
    if (query.device.type == "cpu" and value.dtype in GDN_CHUNK_DTYPES and query.dtype == key.dtype == value.dtype
            and not torch.is_grad_enabled() and query.shape[1] > 0):
        op = gdn_chunk_op()
    if op is None:
        return kernels.chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=chunk_size,
                                              initial_state=initial_state, output_final_state=output_final_state,
                                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    batch, length, heads, v_dim = value.shape
    if initial_state is None:
        state = torch.zeros(batch, heads, key.shape[-1], v_dim, dtype=torch.float32)
    else:
        # a contiguous float32 copy: the caller's tensor stays as it was, whatever its strides
        state = initial_state.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    beta = beta if beta.dtype in (torch.float32, value.dtype) else beta.float()
    out = op(q, k, v, g.float(), beta, state, min(chunk_size, length), use_qk_l2norm_in_kernel)
    return out, state if output_final_state else None


# ---------------------------------------------------------------- the vision tower's attention

ATTENTION = "epd_cpu"  # the name under which transformers' attention interface finds vision_attention
_SCORE_ELEMENTS = 1 << 21  # one block of attention scores: 8 MiB of float32


def vision_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Non-causal attention of one image's patches, ``query``/``key``/``value`` ``[1, heads, L,
    dim]`` (any strides) -> ``[1, L, heads, dim]`` in the query's dtype: transformers' attention
    interface contract (``sdpa_attention_forward``), registered as ``ATTENTION``.

    bfloat16, where the CPU has AVX-512 BF16: ``epd_gdn_chunk.vision_attention``
    (``epd/csrc/vision_attention.h``), scores as bfloat16 products summed in float32, the softmax
    in float32 and its weights rounded to bfloat16 for the weighted sum, as torch's fused CPU
    kernel rounds them: 12.7 ms a layer of a 448x448 image (784 patches, 12 heads of 64) on one
    AMD EPYC core against 26.2 for the fused SDPA kernel (``python -m bench.vision_attention``), the
    tower 1.06-1.10 -> 0.89-0.95 s (docs/BENCHMARKS.md, "Issue 18 on the AMD EPYC again").
    Otherwise scores, softmax and the weighted sum in float32 with
    the products through oneDNN, a block of query rows at a time (at most ``_SCORE_ELEMENTS``
    scores live): 13-14 ms a layer against the fused SDPA kernel's 20-23 on this CPU at a low
    load (bfloat16's fused kernel also accumulates in float32); under heavy load the float32 case
    tied, so ``use_for_vision`` uses it in bfloat16 only. Anything else (a mask, dropout, a
    device other than a CPU, no oneDNN operator) goes to transformers' SDPA function unchanged."""
    fallback = attention_mask is not None or dropout or query.device.type != "cpu" or torch.is_grad_enabled()
    # the kernel takes head widths of whole 16-lane panels up to 256 (the 0.8b's 64; the 9B's tower
    # has 72, which goes the float32 way below)
    fits = query.dtype == torch.bfloat16 and query.shape[-1] % 16 == 0 and query.shape[-1] <= 256
    fused_op = _bf16_attention_op() if fits and not fallback else None
    if fused_op is not None:
        query, key, value = (t[0] if t.stride(-1) == 1 else t[0].contiguous() for t in (query, key, value))
        return fused_op(query, key, value, scaling).unsqueeze(0), None
    if fallback or not available():  # without oneDNN's products the fused kernel is the faster one
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    dtype = query.dtype
    # [heads, L, dim] float32, contiguous (oneDNN reads the strided views of the qkv split slowly)
    key, value = (t[0].to(torch.float32, memory_format=torch.contiguous_format) for t in (key, value))
    # scaled here, on [L, dim], rather than the [L, L] scores: one pass less over them (a new
    # tensor: the caller's query stays as it was)
    query = query[0].to(torch.float32).mul(scaling).contiguous()
    heads, length, _ = query.shape
    out = query.new_empty(length, heads, value.shape[-1])
    rows = max(1, _SCORE_ELEMENTS // length)
    key_t = key.transpose(-1, -2)
    for head in range(heads):
        for start in range(0, length, rows):
            part = slice(start, start + rows)
            scores = matmul(query[head, part].unsqueeze(0), key_t[head].unsqueeze(0))  # [1, rows, L]
            weights = scores.softmax(dim=-1)
            out[part, head] = matmul(weights, value[head].unsqueeze(0))[0]
    return out.to(dtype).unsqueeze(0), None


def _bf16_attention_op():
    """``torch.ops.epd_gdn_chunk.vision_attention`` where its build has it (a CPU with AVX-512 BF16)
    and the prefill kernels are on; None otherwise."""
    if gdn_chunk_op() is None:
        return None
    return getattr(torch.ops.epd_gdn_chunk, "vision_attention", None)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``epd_gdn_chunk.rotary``: ``x [L, heads, dim]`` rotated by float32 ``cos``/``sin`` ``[L, dim]``."""
    return torch.ops.epd_gdn_chunk.rotary(x, cos, sin)


@functools.cache
def _vision_attention_class():
    """``RotaryVisionAttention``: made on first use (transformers' Qwen3.5 module is imported only
    by a process that builds a vision tower)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qm

    class RotaryVisionAttention(qm.Qwen3_5VisionAttention):
        """transformers' ``Qwen3_5VisionAttention`` with the rotary embedding of the query and the
        key as one C++ pass each (``epd_gdn_chunk.rotary``) instead of ``apply_rotary_pos_emb_vision``'s
        conversions, ``rotate_half`` copies, two products and a sum over ``[patches, heads, dim]``
        float32 tensors (about 15% of a 448x448 image's tower on one core). The same float32
        operations, each rounded as torch rounds it: the output is bit-identical. Attention and
        the output projection are transformers' (its non-flash path: one call per image)."""

        def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                    max_seqlen: int | None = None, **kwargs) -> torch.Tensor:
            if (position_embeddings is None or not serves(hidden_states) or self.training
                    or qm.is_flash_attention_requested(self.config)):
                return super().forward(hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
            cos, sin = position_embeddings
            length = hidden_states.shape[0]
            query, key, value = self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1).unbind(1)
            cos, sin = (t.to(torch.float32) for t in (cos, sin))
            query, key = (_rotary(t, cos, sin) for t in (query, key))  # [L, heads, dim]
            query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
            attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                           qm.eager_attention_forward)
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            outs = [attend(self, q, k, v, attention_mask=None, scaling=self.scaling, dropout=0.0, is_causal=False,
                           **kwargs)[0]
                    for q, k, v in zip(*(torch.split(t, lengths, dim=2) for t in (query, key, value)))]
            out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
            return self.proj(out.reshape(length, -1).contiguous())

    return RotaryVisionAttention


def use_rotary_kernel(vision: torch.nn.Module) -> int:
    """Each of ``vision``'s attention modules (transformers' ``Qwen3_5VisionAttention``) becomes
    ``RotaryVisionAttention`` (the same weights, the rotary embedding in C++) where the fused ops
    serve its dtype; how many. 0 with ``EPD_PREFILL_KERNELS=0``."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qm

    weight = next(vision.parameters())
    if weight.device.type != "cpu" or weight.dtype not in GDN_CHUNK_DTYPES or gdn_chunk_op() is None:
        return 0
    cls, count = _vision_attention_class(), 0
    for module in vision.modules():
        if type(module) is qm.Qwen3_5VisionAttention:
            module.__class__ = cls
            count += 1
    return count


def use_for_vision(vision: torch.nn.Module, prepack: bool = True) -> bool:
    """``vision``'s CPU fast paths, when its weights are on a CPU: the patch embedding as one
    pre-packed linear layer (``PatchProjection``; not when ``prepack`` is off, as ``--no-prepack``
    leaves every linear layer to ``F.linear``), each MLP's GELU inside its first layer's oneDNN
    call (``fuse_mlp_activations``, where that layer is pre-packed), and, in bfloat16 or float16, its attention through
    ``vision_attention`` when the operator is available (True if so; built here, at start-up,
    rather than in the first request). Elsewhere it keeps what it was built with. float32, the
    exactness mode, keeps transformers' SDPA: there the two ran within noise of each other on a
    loaded machine (0.90x and 1.03x in two runs), while in bfloat16 ``vision_attention`` won every
    run (0.87-0.90x the whole tower; docs/BENCHMARKS.md) on AVX-512 without AMX. bfloat16 on a CPU
    with AMX (``kernels.amx_bf16``) keeps SDPA too: its fused kernel runs on the tiles, 4x faster."""
    weight = next(vision.parameters())
    if weight.device.type != "cpu":
        return False
    from epd import kernels  # the runner's kernels import this module

    proj = getattr(getattr(vision, "patch_embed", None), "proj", None)
    if prepack and isinstance(proj, torch.nn.Conv3d) and kernels.can_prepack(weight.device, weight.dtype):
        vision.patch_embed.proj = PatchProjection(proj)
    fuse_mlp_activations(vision)
    use_rotary_kernel(vision)
    bf16_kernel = weight.dtype == torch.bfloat16 and _bf16_attention_op() is not None
    if weight.dtype == torch.float32 or not (available() or bf16_kernel):
        return False
    if weight.dtype == torch.bfloat16 and kernels.amx_bf16():
        # torch's fused SDPA kernel multiplies on AMX tiles there: 5.8 ms a layer of a 448x448
        # image against 24.5 for the float32 products (one thread; docs/BENCHMARKS.md, "A CPU with AMX")
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, vision_attention)
    vision.config._attn_implementation = ATTENTION
    return True


def fuse_mlp_activations(vision: torch.nn.Module) -> int:
    """Each vision MLP whose first layer is pre-packed and whose activation is transformers'
    ``GELUTanh`` (Qwen3.5's ``gelu_pytorch_tanh``) gets the GELU inside that layer's oneDNN call,
    as a post-op on the float32 accumulator (``PackedLinearGelu``): one pass less over the
    ``[patches, intermediate]`` activations, 784 x 3,072 for a 448x448 image on the 0.8b (one
    thread, one layer's fc1 + GELU: 14.2 -> 10.9 ms in bfloat16, 23.3 -> 20.4 in float32). Returns
    how many (0 with ``EPD_PREFILL_KERNELS=0``)."""
    if _switched_off():
        return 0
    from transformers.activations import GELUTanh

    from epd import kernels

    count = 0
    for module in vision.modules():
        fc1 = getattr(module, "linear_fc1", None)
        if type(fc1) is kernels.PackedLinear and type(getattr(module, "act_fn", None)) is GELUTanh:
            module.linear_fc1, module.act_fn = PackedLinearGelu(fc1), torch.nn.Identity()
            count += 1
    return count


class PackedLinearGelu(torch.nn.Module):
    """``gelu(linear(x), approximate="tanh")`` in one oneDNN call over a ``kernels.PackedLinear``'s
    packed weight: the GELU applied to the float32 sums before they are stored, so in bfloat16
    the output is rounded once (the unfused pair rounds the product, then the GELU); in float32
    within 3e-7 of the pair."""

    def __init__(self, linear: torch.nn.Module) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight, persistent=False)  # packed, as in PackedLinear
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "gelu", [], "tanh")


class PatchProjection(torch.nn.Module):
    """The patch embedding's ``Conv3d`` whose kernel is its stride (each patch is one output
    position), as the linear layer it is: ``[N, C, T, P, P] -> [N, D, 1, 1, 1]`` through
    ``kernels.PackedLinear`` (or what ``kernels.linear_maker`` picks for the dtype) over the flattened patch: for a 448x448 image (784 patches, one
    thread) 24 -> 4.7 ms in bfloat16 and 61 -> 8.8 ms in float32 against ATen's convolution;
    float32 results within rounding (a different summation order)."""

    def __init__(self, conv: torch.nn.Conv3d) -> None:
        super().__init__()
        from epd import kernels

        if tuple(conv.kernel_size) != tuple(conv.stride) or any(conv.padding) or conv.groups != 1:
            raise ValueError("PatchProjection needs a convolution whose kernel is its stride")
        self.out_channels = conv.out_channels
        make = kernels.linear_maker(conv.weight.device, conv.weight.dtype) or kernels.PackedLinear
        self.linear = make(conv.weight.detach().reshape(conv.out_channels, -1), conv.bias)

    @property
    def weight(self) -> torch.Tensor:
        """The packed weight: what ``patch_embed`` reads its input dtype from."""
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.reshape(x.shape[0], -1)).view(x.shape[0], self.out_channels, 1, 1, 1)
