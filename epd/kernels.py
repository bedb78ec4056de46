"""Qwen3.5's Gated DeltaNet kernels, vectorized in torch: what the runner calls instead of
transformers' reference fallbacks.

This module owns the arithmetic of a linear-attention layer: the chunked gated delta rule
(prefill), its one-token recurrent step (decode), and the depthwise causal conv1d for a chunk and
for one token, each carrying its state the way ``epd.lm.HybridState`` stores it (the conv window
holds the last ``kernel`` inputs; the recurrent state is float32 ``[B, v_heads, k_dim, v_dim]``).

Why not transformers' functions: they are its "reference" fallbacks (the chunked rule solves its
triangular system twice per chunk and makes several extra passes over its inputs; the per-token
rule reads the recurrent state a dozen times), and the packages they would defer to
(flash-linear-attention, causal-conv1d) do not run on a CPU (Triton and CUDA only; see
docs/bench/kernels.md). The GDN kernels are plain torch, so the same code runs on CUDA.
Accumulation is float32 wherever transformers keeps it in float32.

It also owns the runner's linear layers on a CPU: ``PackedLinear`` (oneDNN with pre-packed
weights, every role), ``DecodeLinear`` (epd's few-row kernel, ``epd/csrc/decode_ops.cpp``, for
decode steps) and ``MergedLinear`` (projections that read the same input as one product), and
``add_rms_norm``, the decoder layers' residual add + RMSNorm in one call.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from epd import fused, kernels_prefill

_L2_EPS = 1e-6  # transformers' l2norm epsilon (matches the FLA library)


def _inverse_norm(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale / sqrt(|x|^2 + eps)`` over the last dim, float32, keepdim: transformers' l2norm
    factor (eps inside the root, as the FLA library does), computed without a temporary x*x."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return norm.square_().add_(_L2_EPS).rsqrt_().mul_(scale)


def _heads_first_float32(query, key, value, g, beta, use_qk_l2norm: bool, pad: int = 0):
    """[B, T, heads, dim] inputs -> float32 [B, v_heads, T + pad, dim] (zero rows appended), keys
    and queries repeated for GQA (each key head serves num_v_heads // num_k_heads consecutive
    value heads), L2-normalised if asked, queries scaled by 1/sqrt(k_dim); ``g``/``beta`` become
    [B, v_heads, T + pad]. Each tensor is written once: repeat, normalisation and scaling happen
    in the transposing copy."""
    num_v_heads, k_dim = value.shape[2], key.shape[-1]
    q_scale, k_scale = k_dim**-0.5, None
    if use_qk_l2norm:
        q_scale, k_scale = _inverse_norm(query, q_scale), _inverse_norm(key)
    query = _heads_first(query, pad, num_v_heads, q_scale)
    key = _heads_first(key, pad, num_v_heads, k_scale)
    value, g, beta = (_heads_first(t, pad, num_v_heads) for t in (value, g, beta))
    return query, key, value, g, beta


def _heads_first(x: torch.Tensor, pad: int, heads: int, scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """[B, T, h, ...] -> contiguous float32 [B, heads, T + pad, ...], padding rows zero, each of
    the h input heads repeated for heads // h consecutive output heads, times ``scale`` (a
    number or [B, T, h, 1]) if given: one pass over the output."""
    batch, length, h = x.shape[:3]
    rest = x.shape[3:]
    out = x.new_empty((batch, heads, length + pad, *rest), dtype=torch.float32)
    dest = out.view(batch, h, heads // h, length + pad, *rest)[:, :, :, :length]
    source = x.transpose(1, 2).unsqueeze(2).expand(dest.shape)  # a view: repeated by broadcasting
    if scale is None:
        dest.copy_(source)
    else:
        if isinstance(scale, torch.Tensor):
            scale = scale.transpose(1, 2).unsqueeze(2)
        torch.mul(source, scale, out=dest)
    if pad:
        out[:, :, length:] = 0.0
    return out


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over a sequence, chunk-parallel; same contract as transformers'
    ``torch_chunk_gated_delta_rule``.

    ``query``/``key`` ``[B, T, k_heads, k_dim]``, ``value`` ``[B, T, v_heads, v_dim]``, ``g`` (log
    decay, <= 0) and ``beta`` ``[B, T, v_heads]``, ``initial_state`` ``[B, v_heads, k_dim, v_dim]``.
    Returns the output ``[B, T, v_heads, v_dim]`` in the query's dtype and, if asked, the final
    float32 state. Within a chunk the UT system is inverted once (an explicit inverse of the unit
    lower triangular matrix, then matrix products) rather than solved for each right-hand side.
    """
    out_dtype = query.dtype
    length = key.shape[1]
    # A prompt shorter than a chunk is one chunk of its own length: no padded rows to compute.
    # Padding rows are zero: zero key, value and beta add nothing to the state, zero log-decay
    # keeps it unchanged.
    chunk = min(chunk_size, length)
    pad = -length % chunk
    query, key, value, g, beta = _heads_first_float32(query, key, value, g, beta, use_qk_l2norm_in_kernel, pad)
    batch, heads, padded, k_dim = key.shape
    num_chunks = padded // chunk
    query, key, value = (t.view(batch, heads, num_chunks, chunk, -1) for t in (query, key, value))
    beta = beta.view(batch, heads, num_chunks, chunk, 1)
    cum = g.view(batch, heads, num_chunks, chunk).cumsum(dim=-1)  # log decay from chunk start

    u, w, intra, query, key, chunk_decay = _chunk_intra(query, key, value, beta, cum)
    state = _initial_state(initial_state, batch, heads, k_dim, value.shape[-1], value.device)
    out = u.new_empty(batch, length, heads, value.shape[-1], dtype=out_dtype)
    _chunk_scan(u, w, intra, query, key, chunk_decay, state, out)
    return out, state if output_final_state else None


def _chunk_intra(query, key, value, beta, cum):
    """Everything that does not depend on the carried state, for all chunks at once.

    Returns ``u`` (the chunk's values corrected by the UT transform), ``w`` (its decayed keys as
    the transform mixes them), the causal intra-chunk attention, queries scaled by their decay
    from the chunk start, keys scaled by their decay to the chunk end, and each chunk's total
    decay. The per-row factors (beta, decay from the chunk start) are applied to the small
    chunk x chunk matrices rather than to the chunk x dim operands: fewer passes over memory.
    """
    chunk = key.shape[-2]
    # decay[i, j] = exp(cum_i - cum_j) for j <= i; masked before exp so nothing overflows
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=key.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    key_t = key.transpose(-1, -2)
    beta_row = beta.transpose(-1, -2)  # [.., 1, C]: scales column j by beta_j
    # The UT system is I + strictly-lower(diag(beta) k k^T * decay): the solver reads only the
    # strict lower triangle (unitriangular), so neither the diagonal nor the upper part is set.
    system = kernels_prefill.matmul(key, key_t) * (decay * beta)
    eye = torch.eye(chunk, dtype=system.dtype, device=system.device).expand_as(system)
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True) * beta_row
    cum_exp = cum.exp().unsqueeze(-1)
    u = kernels_prefill.matmul(inverse, value)  # inverse diag(beta) v
    w = kernels_prefill.matmul(inverse * cum_exp.transpose(-1, -2), key)  # inverse diag(beta exp(cum)) k
    intra = kernels_prefill.matmul(query, key_t) * decay
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    return u, w, intra, query * cum_exp, key, cum[..., -1].exp()


def _initial_state(initial, batch, heads, k_dim, v_dim, device) -> torch.Tensor:
    if initial is None:
        return torch.zeros(batch, heads, k_dim, v_dim, dtype=torch.float32, device=device)
    return initial.to(device=device, dtype=torch.float32, copy=True)  # the caller's tensor stays as it was


def _chunk_scan(u, w, intra, query, key, chunk_decay, state, out):
    """The sequential part: per chunk, subtract what the carried state already predicts from the
    chunk's values (the delta rule), read the state for the queries, and fold the chunk in
    (``state`` is updated in place). Each chunk's output is written straight into ``out``
    ``[B, T, H, v_dim]`` (the caller's layout and dtype; padding rows are dropped)."""
    chunk, length = u.shape[-2], out.shape[1]
    key_t = key.transpose(-1, -2)
    # the products through kernels_prefill (oneDNN for float32 on a CPU, 2x MKL here), each
    # subtraction or sum inside its product: u - w S, q S + intra v_new, d S + k^T v_new
    for i in range(u.shape[2]):
        v_new = kernels_prefill.addmm_(u[:, :, i].contiguous(), w[:, :, i], state, alpha=-1.0)
        chunk_out = kernels_prefill.addmm_(kernels_prefill.matmul(query[:, :, i], state), intra[:, :, i], v_new)
        start = i * chunk
        rows = min(chunk, length - start)
        out[:, start : start + rows] = chunk_out[:, :, :rows].transpose(1, 2)
        kernels_prefill.addmm_(state.mul_(chunk_decay[:, :, i, None, None]), key_t[:, :, i], v_new)
    return out


def recurrent_gated_delta_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor,
                               use_qk_l2norm_in_kernel: bool = True) -> torch.Tensor:
    """One token of the gated delta rule for each of B sequences, updating ``state`` in place.

    transformers' ``torch_recurrent_gated_delta_rule`` for a single token (same normalisation,
    decay, delta update and read-out), rearranged so that one product reads the old state for
    both contractions: with S the old state and d = exp(g), the new state is S' = d S + k delta^T
    where delta = beta (v - d k^T S), and the output is q^T S' = d q^T S + (q . k) delta, so
    [k; q]^T S gives both. The state is then scaled and updated in place: three reads and two
    writes of it per step, against four and two for decay, read, update, read. Inputs ``[B, 1, heads, dim]``, ``g``/``beta`` ``[B, 1,
    v_heads]``; ``state`` float32 ``[B, v_heads, k_dim, v_dim]``, contiguous. Returns ``[B, 1,
    v_heads, v_dim]`` in the query's dtype.
    """
    out_dtype = query.dtype
    query, key, value, g, beta = _heads_first_float32(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    size, heads, _, k_dim = key.shape  # [B, H, 1, dim]
    v_dim = value.shape[-1]
    decay = g.exp().view(size, heads, 1, 1)
    read = torch.cat([key, query], dim=-2) @ state  # [B, H, 2, v_dim]: k^T S and q^T S
    delta = (value - decay * read[..., :1, :]) * beta.unsqueeze(-1)  # [B, H, 1, v_dim]
    qk = (query * key).sum(dim=-1, keepdim=True)  # [B, H, 1, 1]
    out = decay * read[..., 1:, :] + qk * delta
    flat = state.view(size * heads, k_dim, v_dim)
    flat.mul_(decay.view(-1, 1, 1)).baddbmm_(key.reshape(-1, k_dim, 1), delta.view(-1, 1, v_dim))
    return out.transpose(1, 2).to(out_dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                  window: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d over a chunk ``x [B, C, T]`` that continues ``window [B, C, K]``
    (the previous K inputs; zeros before the first token when None). ``weight`` is ``[C, K]``.

    Returns the activated output ``[B, C, T]`` in ``x``'s dtype and the new window (the last K
    inputs, a fresh contiguous tensor). The arithmetic runs time-major, ``[B, T, C]``, the layout
    the input projection produces (``x`` is usually its transposed view) and the one the caller
    wants back: K multiply-adds of whole rows, so no transposing copies and no conv1d call (a
    depthwise ``F.conv1d`` on this CPU runs at a fraction of the multiply-adds' speed). The
    returned output is a ``[B, C, T]`` view of time-major memory. float32 accumulation.
    """
    kernel = weight.shape[1]
    length = x.shape[-1]
    rows = x.transpose(1, 2)  # [B, T, C]
    if window is None:
        carried = rows.new_zeros(rows.shape[0], kernel - 1, rows.shape[2])
    else:
        carried = window[..., 1:].transpose(1, 2).to(rows.dtype)
    full = torch.cat([carried, rows], dim=1)  # [B, K - 1 + T, C]
    new_window = full[:, -kernel:].transpose(1, 2).contiguous()
    if full.dtype != torch.float32:
        full = full.float()
    # [K, C], contiguous: a row of the transposed view has stride K, and a multiply-add whose
    # broadcast operand is strided runs ~4x slower here (0.71 against 2.83 ms for 247 tokens x
    # 6,144 channels, float32, one thread); same products, same order
    taps = weight.t().float().contiguous()
    out = full[:, :length] * taps[0]
    for tap in range(1, kernel):
        out.addcmul_(full[:, tap : tap + length], taps[tap])
    if bias is not None:
        out += bias.float()
    return _activate(out, activation).to(x.dtype).transpose(1, 2), new_window


def causal_conv1d_step(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       activation: str | None) -> torch.Tensor:
    """One token of the depthwise causal conv: shift ``x [B, C]`` into ``window``, kept time-major
    ``[B, K, C]`` (row ``t`` holds the input ``K - 1 - t`` tokens back; updated in place), and
    return the activated output ``[B, C]``. ``weight`` is ``[C, K]``.

    Time-major because that makes the step K multiply-adds of whole contiguous rows and the shift
    one contiguous copy: with transformers' ``[B, C, K]`` layout the shift and the sum run over a
    last dimension of 4, 8x slower on this CPU (bfloat16, batch 16, the 0.8b's 6,144 channels:
    2.0 ms a layer against 0.27, one thread). ``DecodeBatch`` stores its conv slots this way; a
    ``HybridState`` keeps transformers' layout. float32 accumulation in any dtype, taps summed
    oldest first."""
    kernel = weight.shape[1]
    taps = weight.t().float()  # [K, C]
    out = window[:, 1].float() * taps[0]
    for tap in range(1, kernel - 1):
        out.addcmul_(window[:, tap + 1], taps[tap])
    out.addcmul_(x, taps[kernel - 1])
    if bias is not None:
        out += bias.float()
    window[:, :-1] = window[:, 1:].clone()
    window[:, -1] = x
    return _activate(out, activation).to(x.dtype)


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``activation`` by transformers' name, in place when it is SiLU (Qwen3.5's) and ``x`` is a
    temporary of ours."""
    if activation in ("silu", "swish"):
        return F.silu(x, inplace=True)
    return x if activation is None else ACT2FN[activation](x)


# ---------------------------------------------------------------- decode attention


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One request's decode-step attention: ``query [1, heads, 1, dim]`` over its ``keys`` and
    ``values`` ``[T, kv_heads, dim]`` (token rows of the paged pool, typically a view of it: any
    row stride). Grouped-query: query head ``h`` reads kv head ``h // (heads // kv_heads)``, as
    transformers' ``repeat_kv``. Returns ``[1, heads, 1, dim]`` in the query's dtype.

    ``scaled_dot_product_attention`` in float32, as transformers' sdpa attention (float32 is the
    exactness mode). On a CPU other dtypes are converted to float32 first: for one query row the
    fused bfloat16 kernel is 6-8x slower on this project's CPUs than converting the request's
    rows and running the float32 one, and bfloat16 matrix products 1.8-2x slower
    (``python -m bench.decode_attention``; docs/BENCHMARKS.md, "Decode attention").
    """
    dtype = query.dtype
    if dtype != torch.float32 and query.device.type == "cpu":
        query, keys, values = query.float(), keys.float(), values.float()
    out = F.scaled_dot_product_attention(query, keys.transpose(0, 1).unsqueeze(0),
                                         values.transpose(0, 1).unsqueeze(0), scale=scale, enable_gqa=True)
    return out.to(dtype)


# ---------------------------------------------------------------- linear layers on a CPU


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` whose weight is stored pre-packed in oneDNN's blocked layout and multiplied
    by oneDNN rather than by ATen's default CPU GEMM (MKL's sgemm for float32).

    Why: on this project's machines MKL's float32 GEMM is far from the AVX-512 peak at every
    batch size the runner uses (about 40-130 GFLOP/s on 2 cores), while oneDNN with a pre-packed
    weight runs the same products 1.5-3.6x faster, from M=1 (decode, bandwidth-bound) to M=512
    (prefill chunks): docs/bench/kernels.md. Results agree with ``F.linear`` to float32
    rounding (a different summation order). CPU only; the dense weight is released, so memory
    stays the same.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        # not a Parameter (it has no storage an optimizer could use); not in the state dict
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
                             persistent=False)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def onednn_serves(dtype: torch.dtype) -> bool:
    """Whether oneDNN has CPU kernels for ``dtype`` here: float32 wherever it is built in, bfloat16
    only on CPUs with native bfloat16 arithmetic (AVX-512 BF16, AMX, AVX-NE-CONVERT); elsewhere
    (AVX2 CPUs such as AMD Zen 3) ATen's and oneDNN's bfloat16 products fall back to slow paths
    (~20 GFLOP/s on two cores at any size)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def amx_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 on AMX tiles (Intel Sapphire Rapids and later), which
    oneDNN's bfloat16 GEMM uses by itself. There oneDNN's pre-packed product beats the few-row
    kernel's AVX-512 registers (``vdpbf16ps``) from 8 rows up, 13x at 2,048 rows (a prefill chunk
    in an aggregated step), so the kernel has a tile path of its own (``fused.decode_tiles``), and
    the vision tower keeps SDPA: docs/BENCHMARKS.md, "A CPU with AMX"."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)  # torch's own CPUID check
    try:
        return bool(probe is not None and probe()) and onednn_serves(torch.bfloat16)
    except RuntimeError:
        return False


def linear_maker(device: torch.device, dtype: torch.dtype):
    """What replaces an ``nn.Linear`` on this device and dtype: ``PackedLinear`` (oneDNN,
    pre-packed) where oneDNN serves the dtype; for bfloat16 where it does not, ``DecodeLinear``
    (epd's packed kernel, which there widens bfloat16 to float32: registers for a few rows, the
    float32 GEMM a block of panels at a time for many, docs/BENCHMARKS.md "bfloat16 on a CPU
    without AVX-512") when it is built; None elsewhere (CUDA, or nothing better than
    ``F.linear``)."""
    if torch.device(device).type != "cpu":
        return None
    if onednn_serves(dtype):
        return PackedLinear
    if dtype == torch.bfloat16 and fused.decode_ops():
        return DecodeLinear
    return None


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the linear layers get a packed replacement on this device and dtype
    (``linear_maker``). Elsewhere (CUDA) ``F.linear`` stays."""
    return linear_maker(device, dtype) is not None


def prepack_linears(module: torch.nn.Module, make=None) -> int:
    """Replace every ``nn.Linear`` under ``module`` by ``make(weight, bias)`` (default: what
    ``linear_maker`` picks for the module's device and dtype), in place; returns how many. For
    inference only: a packed weight has no gradient."""
    if make is None:
        weight = next(module.parameters())
        make = linear_maker(weight.device, weight.dtype)
        if make is None:
            return 0
    count = 0
    for parent in module.modules():
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, make(child.weight, child.bias))
                count += 1
    return count


class DecodeLinear(torch.nn.Module):
    """``nn.Linear`` for a decode step's few rows: the weight laid out once in panels of 16 output
    columns (``torch.ops.epd_decode.pack``) and multiplied by epd's kernel, which reads each
    weight vector once for all the rows (AVX-512: bfloat16 with ``vdpbf16ps``, float32 with FMAs;
    AVX2: bfloat16 widened to float32 in registers, float32 FMAs, and for more than 48 rows the
    weight widened a block at a time for the float32 GEMM).

    Why: oneDNN's pre-packed GEMM, the best library kernel here, reads the weights of a
    batch-8 bfloat16 decode step at well under the memory bandwidth, and splits each product
    over the threads up front, so a thread that loses its core (to a co-located role, the
    router, a neighbour) holds up the whole product; this kernel's threads claim small tasks
    from a shared counter. Whole bfloat16 decode steps of qwen3.5-0.8b: batch 8 92.7/105.3 ms
    against oneDNN's 112.3/110.5, 130.9/120.6 against 150.3/154.9 with other processes taking a
    fifth of the cores; at 256 rows it is level with oneDNN product by product
    (docs/BENCHMARKS.md, "The few-row kernel as the default"). A decode runner uses it unless
    ``EPD_DECODE_LINEAR=0``. Any number of rows is correct (8 at a time over the same panels; on
    a CPU with AMX, bfloat16 products of 5 rows or more on the tiles, ``fused.decode_tiles``).
    On a CPU without AVX-512 BF16 it is also every bfloat16 runner's and the vision tower's
    linear layer (``linear_maker``): there oneDNN has no bfloat16 kernels. Needs
    ``fused.decode_ops()``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.register_buffer("weight", torch.ops.epd_decode.pack(weight.detach()), persistent=False)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(torch.ops.epd_decode.linear, x)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()`` in one pass: the same values (rounded to the layer's dtype as its
        product rounds), written as float32 by the kernel rather than copied after it (the LM
        head's logits: ~2 ms of a 16-row step on 2 cores for the copy)."""
        return self._product(torch.ops.epd_decode.linear_float, x)

    def _product(self, op, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # a view for decode's [B, 1, K] inputs
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = op(rows, self.weight, self.out_features, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_decode_pack(weight: torch.Tensor) -> bool:
    """Whether ``DecodeLinear`` serves this weight (a CPU, bfloat16 or float32, an even input
    width in bfloat16, the kernel built)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return False
    return (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0) and fused.decode_ops()


class MergedLinear(torch.nn.Module):
    """Linear layers that read the same input, as one product over their stacked weights (what
    vLLM's ``MergedColumnParallelLinear``/``QKVParallelLinear`` do): one call and one pass over
    the input instead of several. ``forward`` returns each layer's output, views of one tensor
    (``[..., out_i]``, rows strided by the sum). ``make`` builds the product from the stacked
    weight (``PackedLinear``, ``DecodeLinear``, or a plain ``nn.Linear``)."""

    def __init__(self, linears: list[torch.nn.Linear], make) -> None:
        super().__init__()
        if any(linear.bias is not None for linear in linears):
            raise ValueError("MergedLinear merges layers without bias")
        self.sizes = [linear.out_features for linear in linears]
        self.linear = make(torch.cat([linear.weight.detach() for linear in linears]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm (float32 math, ``(1 + weight)``) of ``residual + x`` for ``[rows, dim]``
    rows, in one call; ``residual`` becomes ``residual + x`` in place (rounded to its dtype, as
    torch's add). ``x`` None: the norm of ``residual`` alone. Needs ``fused.decode_ops()``."""
    return torch.ops.epd_decode.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (a gated MLP's activation) as the two torch ops compute it, rounded
    where they round, in one pass on a CPU for bfloat16 and float32 where ``fused.decode_ops()``
    is built; the torch ops otherwise. ``gate`` and ``up`` may be strided views (the merged
    gate/up product's halves)."""
    width = gate.shape[-1]
    if (gate.device.type == "cpu" and gate.dtype in (torch.bfloat16, torch.float32) and up.dtype == gate.dtype
            and up.shape == gate.shape and width > 0 and not torch.is_grad_enabled() and fused.decode_ops()):
        rows_gate, rows_up = gate.reshape(-1, width), up.reshape(-1, width)
        if rows_gate.stride(-1) == 1 and rows_up.stride(-1) == 1:
            return torch.ops.epd_decode.silu_mul(rows_gate, rows_up).view(gate.shape)
    return F.silu(gate) * up


def can_attend_paged(query: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether ``paged_decode_attention`` serves this step (a CPU, bfloat16 or float32, a head dim
    that is a multiple of 16, the kernels built)."""
    return (query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float32)
            and pool.dtype == query.dtype and query.shape[-1] % 16 == 0 and fused.decode_ops())


def paged_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, runs: torch.Tensor,
                           offsets: torch.Tensor, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention for every slot in one call: ``query [B, heads, 1, dim]`` (or
    ``[B, heads, dim]``; rotated) against the paged pool ``keys``/``values`` ``[rows, kv_heads,
    dim]``, slot ``s`` reading the row runs ``runs[offsets[s]:offsets[s + 1]]`` (``[R, 2]``
    (start, stop)). Grouped-query as ``decode_attention``; float32 math in any dtype (what
    ``decode_attention`` computes, one request at a time, with a conversion and four small ops
    per request). Returns ``[B, heads, 1, dim]`` in the query's dtype; with ``gate`` (the merged
    projection's query part ``[B, heads * 2 * dim]``: per head its query, then its gate) the
    gated output ``out * sigmoid(gate)``, ``[B, heads * dim]``, as Qwen3.5's attention gates it."""
    rows = query.reshape(query.shape[0], query.shape[1], -1).contiguous()
    out = torch.ops.epd_decode.attend(rows, keys, values, runs, offsets, scale, gate)
    return out if gate is not None else out.unsqueeze(2)


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Float32 logits ``[B, V]`` -> (each row's first maximum's index ``[B]`` int64, whether the
    row is all finite ``[B]`` bool) in one pass, where ``argmax`` and a finite check read them
    apart; None when the decode kernels are not built (the caller uses torch). A row that is not
    finite has no meaningful index."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or not fused.decode_ops():
        return None
    return torch.ops.epd_decode.greedy_rows(logits if logits.stride(1) == 1 else logits.contiguous())


def first_maxima(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_rows``' (index, finite) on any device: the kernel where it serves, else torch's
    ``argmax`` (its first maximum too) and a finite check."""
    rows = greedy_rows(logits)
    if rows is not None:
        return rows
    # a row's min and max are finite exactly when every value is (NaN propagates through both);
    # amin and amax apart, as ATen vectorizes each (one aminmax pass is not)
    low, high = logits.amin(dim=-1), logits.amax(dim=-1)
    return logits.argmax(dim=-1), torch.isfinite(low) & torch.isfinite(high)


class GreedyScreen:
    """The LM head of greedy rows, screened: each row's first-maximum index over the vocabulary as
    the full head's logits give it, reading an int8 copy of the head (half the bytes of
    bfloat16, a quarter of float32) instead of the head.

    The C++ screen multiplies the rows by the int8 copy and bounds each logit (the copy's
    rounding, the rows' own, the float32 sums'); only the columns whose upper bound reaches a
    row's best lower bound can hold its maximum (with bfloat16 logits, whose upper bound rounds
    to the lower bound's rounded value or above: ties after rounding stay in). Those columns are
    multiplied by the head's own kernel (``linear_float``), so their logits are bit for bit the
    full head's, and the first maximum among them (ascending) is the full head's first maximum
    (``epd/csrc/greedy_screen.h`` has the bounds). Why: the head is a third of the bytes a decode
    step streams (508 of ~1,500 MB for qwen3.5-0.8b in bfloat16).

    Two ways, as the CPU allows (``fused.decode_screen_kind``): on AMX-INT8 tiles
    (``torch.ops.epd_decode.screen``: two int8 levels of the rows, a few dozen columns left a
    row, multiplied as the head's whole panels), or on AVX-512 VNNI registers
    (``screen_vector``: one level, half the tiles' arithmetic, which on those CPUs costs as much
    as the bytes; ~60 columns left a row, gathered from the head's rows and packed).

    ``argmax`` returns None (the caller multiplies the whole head) when a row is not finite or
    too many columns remain (rows with no clear maximum, as an all-zero row)."""

    def __init__(self, head: "DecodeLinear", weight: torch.Tensor) -> None:
        if tuple(weight.shape) != (head.out_features, head.in_features):
            raise ValueError(f"the screen's weight {tuple(weight.shape)} is not the head's "
                             f"{(head.out_features, head.in_features)}")
        self.head = head
        self.tiles = fused.decode_screen_kind() == "tiles"
        # the head's rows, for the vector path's gather (the tied embedding table or the runner's
        # own head weight: no copy)
        self.weight = None if self.tiles else weight.detach()
        # the vector path's copy holds q + 128 (vpdpbusd's unsigned operand)
        self.packed, self.scale, self.l1, self.l2, self.rounding = \
            torch.ops.epd_decode.pack_i8(weight.detach(), not self.tiles)
        self.screened = 0  # products answered from the screen
        self.full = 0  # ... and those that fell back to the whole head

    def columns(self, rows: torch.Tensor) -> torch.Tensor:
        """The head's columns that may hold a maximum of ``rows [B, K]`` (contiguous rows),
        ascending, each once; empty when the screen cannot decide."""
        bf16 = self.head.dtype == torch.bfloat16
        n = self.head.out_features
        if self.tiles:
            return torch.ops.epd_decode.screen(rows, self.packed, self.scale, self.l1, n, bf16)
        return torch.ops.epd_decode.screen_vector(rows, self.packed, self.scale, self.l1, self.l2, self.rounding,
                                                  n, bf16)

    def argmax(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``hidden [B, K]`` (final-normed) -> (each row's first-maximum index ``[B]`` int64, the
        rows' finite flags ``[B]``: all true), as ``greedy_rows(head.forward_float(hidden))``;
        None when the screen leaves too much (then nothing was computed for the head)."""
        rows = hidden.reshape(-1, self.head.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        columns = self.columns(rows)
        if columns.numel() == 0:
            self.full += 1
            return None
        self.screened += 1
        if self.tiles:
            panels, width = self.panels(columns)
            logits = torch.ops.epd_decode.linear_float(rows, self.head.weight.index_select(0, panels), width, None)
            index, finite = torch.ops.epd_decode.greedy_rows(logits)
            return panels[index // 16] * 16 + index % 16, finite
        logits = torch.ops.epd_decode.linear_float(rows, self.gathered(columns), columns.numel(), None)
        index, finite = torch.ops.epd_decode.greedy_rows(logits)
        return columns[index], finite

    def gathered(self, columns: torch.Tensor) -> torch.Tensor:
        """The head's rows ``columns`` packed as the few-row kernel's panels: each column's logit
        from them is bit for bit the head's (the kernel sums each output lane alone, in the same
        order, whichever panel and lane holds the column)."""
        return torch.ops.epd_decode.pack(self.weight, columns)

    def panels(self, columns: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The head's panels (of 16 columns) that hold ``columns`` (ascending), ascending, and
        their width in columns (the head's last panel may be partial).

        ``argmax`` multiplies these whole panels, whole runs of the packed head (32 KiB a panel
        for the 0.8b; a gather of the single columns read a 64-byte line of a panel for every 4
        bytes it kept: with the product, 3.8 ms of a 16-row step against 3.1-3.3 for the panels,
        docs/BENCHMARKS.md). Every logit of those panels is exact, and a column the screen left
        out is below its row's maximum in every row (strictly: the screen drops only a column
        whose upper end is under the best lower end, or rounds under it), so the first maximum
        over the panels' columns in ascending order is the first maximum of the whole head."""
        panels = torch.unique_consecutive(torch.div(columns, 16, rounding_mode="floor"))
        width = panels.numel() * 16
        if int(panels[-1]) == self.head.weight.shape[0] - 1:
            width -= -self.head.out_features % 16
        return panels, width


def can_screen(head, weight: torch.Tensor) -> bool:
    """Whether ``GreedyScreen`` serves this LM head: epd's few-row kernel holds it, the CPU and
    build have AMX-INT8 or AVX-512 VNNI, ``EPD_GREEDY_SCREEN`` is not ``0``."""
    return (isinstance(head, DecodeLinear) and weight.device.type == "cpu"
            and os.environ.get("EPD_GREEDY_SCREEN", "1") != "0" and fused.decode_screens())


def attention_decode_inputs(query_gate: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_norm, k_norm,
                            cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            write: torch.Tensor) -> torch.Tensor:
    """A full-attention layer's decode inputs in one call, from its merged projection's parts
    (``query_gate [B, heads * 2 * dim]``, ``key``/``value`` ``[B, kv_heads * dim]``, rows may be
    strided): the per-head ``q_norm``/``k_norm`` (Qwen3.5 RMSNorms), the partial rotary embedding
    ``cos``/``sin`` ``[B, rotary_dim]`` as transformers' ``apply_rotary_pos_emb`` computes it,
    rounded where it rounds; keys and values are written into the pools' rows ``write [B]``.
    Returns the rotated queries ``[B, heads, dim]``."""
    return torch.ops.epd_decode.attention_inputs(query_gate, key, value, q_norm.weight, k_norm.weight, q_norm.eps,
                                                 cos, sin, keys, values, write)
