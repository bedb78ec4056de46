"""Tensor parallelism for the language model: one model held by N processes, each with a shard.

``shard_runner`` cuts a loaded ``TextModelRunner`` in place to rank ``r`` of ``N`` (Megatron's
layout, as vLLM and SGLang shard Qwen3.5):

* gated full attention: query heads (with their output gates) and K/V heads split in contiguous
  groups (so each query head keeps its GQA key head); ``o_proj`` becomes row-parallel.
* Gated DeltaNet: key heads and value heads split the same way (each value head keeps the key
  head it repeats); ``in_proj_qkv`` and the depthwise conv are cut per part (q, k, v),
  ``in_proj_z/b/a``, ``A_log`` and ``dt_bias`` per value head; ``out_proj`` row-parallel. The
  recurrent and conv state of a request is then a per-rank shard too (the runner reads every
  size from the modules).
* MLP: ``gate_proj``/``up_proj`` column-parallel, ``down_proj`` row-parallel; in a MoE block
  every routed expert's and the shared expert's intermediate columns split the same way, the
  router and the shared expert's gate stay whole (every rank routes identically), and the
  block's output is all-reduced once (routed + gated shared are both partial sums).
* LM head: vocab-parallel (each rank's rows of the head), logits all-gathered (exact: no sum).

Embedding, norms and the residual stream stay replicated. Row-parallel outputs are summed with
``torch.distributed.all_reduce`` (gloo on a CPU, NCCL on a GPU): float32 sums in another order
than one matmul's, so logits can differ from the one-process runner in the last bits
(tests/test_tensor_parallel.py measures it and checks greedy tokens are identical).

``bench.tp_driver.run_greedy`` is a driver for tests and benchmarks: N local processes (``python -m
bench.tp_driver``, gloo over loopback) each load the checkpoint, shard it, prefill one prompt and
decode greedily through ``decode_svc.batch.DecodeBatch`` + ``TextModelRunner.decode_step``.
``gather_state`` / ``split_state`` move a request's state between degrees (prefill TP=a, decode
TP=b: gathered to the whole state, then split), as the handoff would carry it.
The serving roles are ``prefill_svc.tensor_parallel`` and ``decode_svc.tensor_parallel`` (a
replica of N ranks each, over ``epd.tp_group``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from epd.lm import HybridState, TextModelRunner


class RowParallelLinear(torch.nn.Module):
    """``y = all_reduce(x_shard @ w_shard.T)``: a linear whose input features are split over ranks."""

    def __init__(self, weight: torch.Tensor, group=None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(_cast(weight).contiguous(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out


class AllReduceOutput(torch.nn.Module):
    """Runs ``module`` on this rank's shard and sums its output over the ranks (a MoE block)."""

    def __init__(self, module: torch.nn.Module, group=None) -> None:
        super().__init__()
        self.module = module
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead:
    """This rank's rows of the LM head; ``__call__`` gives every rank the whole vocabulary's logits."""

    def __init__(self, weight: torch.Tensor, world: int, group=None) -> None:
        self.weight = weight
        self.world = world
        self.group = group

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def _rows(weight: torch.Tensor, sizes: list[int], rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """This rank's slice of each consecutive part (``sizes`` along ``dim``), concatenated."""
    pieces, start = [], 0
    for size in sizes:
        if size % world:
            raise ValueError(f"a part of {size} does not split over {world} ranks")
        share = size // world
        pieces.append(weight.narrow(dim, start + rank * share, share))
        start += size
    return torch.cat(pieces, dim=dim).contiguous()


# The dtype the cut slices are converted to as they are cut (``shard_runner``'s ``dtype``): a rank
# then never holds a converted copy of the whole model. Set only for the duration of one cut.
_CAST: list[torch.dtype | None] = [None]


def _cast(t: torch.Tensor) -> torch.Tensor:
    return t if _CAST[0] is None or not t.is_floating_point() else t.to(_CAST[0])


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(_cast(t).contiguous(), requires_grad=False)


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = _param(weight)
    return layer


def _shard_attention(attn, config, rank: int, world: int, group) -> None:
    dim, heads, kv = attn.head_dim, config.num_attention_heads, config.num_key_value_heads
    if heads % world or kv % world:
        raise ValueError(f"{heads} query / {kv} K/V heads do not split over {world} ranks")
    attn.q_proj = _linear(_rows(attn.q_proj.weight, [heads * dim * 2], rank, world))  # per head: query, gate
    attn.k_proj = _linear(_rows(attn.k_proj.weight, [kv * dim], rank, world))
    attn.v_proj = _linear(_rows(attn.v_proj.weight, [kv * dim], rank, world))
    attn.o_proj = RowParallelLinear(_rows(attn.o_proj.weight, [heads * dim], rank, world, dim=1), group)


def _shard_gdn(gdn, rank: int, world: int, group) -> None:
    if gdn.num_k_heads % world or gdn.num_v_heads % world:
        raise ValueError(f"{gdn.num_k_heads} key / {gdn.num_v_heads} value heads do not split over {world} ranks")
    parts = [gdn.key_dim, gdn.key_dim, gdn.value_dim]  # q, k, v: the conv's channels in the same order
    gdn.in_proj_qkv = _linear(_rows(gdn.in_proj_qkv.weight, parts, rank, world))
    gdn.conv1d.weight = _param(_rows(gdn.conv1d.weight, parts, rank, world))
    gdn.in_proj_z = _linear(_rows(gdn.in_proj_z.weight, [gdn.value_dim], rank, world))
    gdn.in_proj_b = _linear(_rows(gdn.in_proj_b.weight, [gdn.num_v_heads], rank, world))
    gdn.in_proj_a = _linear(_rows(gdn.in_proj_a.weight, [gdn.num_v_heads], rank, world))
    gdn.A_log = _param(_rows(gdn.A_log, [gdn.num_v_heads], rank, world))
    gdn.dt_bias = _param(_rows(gdn.dt_bias, [gdn.num_v_heads], rank, world))
    gdn.out_proj = RowParallelLinear(_rows(gdn.out_proj.weight, [gdn.value_dim], rank, world, dim=1), group)
    gdn.num_k_heads //= world
    gdn.num_v_heads //= world
    gdn.key_dim //= world
    gdn.value_dim //= world
    gdn.conv_dim = gdn.key_dim * 2 + gdn.value_dim
    gdn.conv1d.in_channels = gdn.conv1d.out_channels = gdn.conv1d.groups = gdn.conv_dim


def _shard_mlp(mlp, rank: int, world: int, group=None, row_parallel: bool = True) -> None:
    """A SwiGLU MLP (dense, or a MoE block's shared expert)."""
    width = mlp.gate_proj.weight.shape[0]
    mlp.gate_proj = _linear(_rows(mlp.gate_proj.weight, [width], rank, world))
    mlp.up_proj = _linear(_rows(mlp.up_proj.weight, [width], rank, world))
    down = _rows(mlp.down_proj.weight, [width], rank, world, dim=1)
    mlp.down_proj = RowParallelLinear(down, group) if row_parallel else _linear(down)


def _shard_moe(block, rank: int, world: int) -> None:
    experts = block.experts
    width = experts.intermediate_dim
    experts.gate_up_proj = _param(_rows(experts.gate_up_proj, [width, width], rank, world, dim=1))  # gate | up
    experts.down_proj = _param(_rows(experts.down_proj, [width], rank, world, dim=2))
    experts.intermediate_dim = width // world
    _shard_mlp(block.shared_expert, rank, world, row_parallel=False)  # summed with the experts, below


@torch.inference_mode()
def shard_runner(runner: TextModelRunner, rank: int, world: int, group=None,
                 dtype: torch.dtype | None = None) -> TextModelRunner:
    """Cut ``runner`` (loaded whole, not pre-packed) in place to rank ``rank`` of ``world``.

    ``dtype``: convert to it on the way (each slice as it is cut, then the replicated parameters),
    for a runner loaded in the dtype its files store: safetensors maps them, so the whole model is
    never copied, only this rank's slices are."""
    _CAST[0] = dtype
    try:
        _shard(runner, rank, world, group)
    finally:
        _CAST[0] = None
    if dtype is not None and dtype != runner.dtype:
        tied = runner.lm_head_weight is runner.model.embed_tokens.weight
        for module in runner.model.modules():  # what stays whole: embedding, norms, routers, ...
            for name, param in list(module.named_parameters(recurse=False)):
                if param.is_floating_point() and param.dtype != dtype:
                    setattr(module, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))
        runner.lm_head_weight = runner.model.embed_tokens.weight if tied else runner.lm_head_weight.to(dtype)
    return runner


def _shard(runner: TextModelRunner, rank: int, world: int, group) -> None:
    config = runner.model.config
    for index, layer in enumerate(runner.model.layers):
        if runner.layer_types[index] == "linear_attention":
            _shard_gdn(layer.linear_attn, rank, world, group)
        else:
            _shard_attention(layer.self_attn, config, rank, world, group)
        if hasattr(layer.mlp, "experts"):
            _shard_moe(layer.mlp, rank, world)
            layer.mlp = AllReduceOutput(layer.mlp, group)
        else:
            _shard_mlp(layer.mlp, rank, world, group)
    vocab = runner.lm_head_weight.shape[0]
    runner.lm_head = VocabParallelHead(_cast(_rows(runner.lm_head_weight, [vocab], rank, world)), world, group)


# --------------------------------------------------------------------------- handoff between TP degrees


def _conv_parts(gdn, world: int) -> list[int]:
    """The conv state's channel parts (q, k, v) of the whole model, from a rank's (or the whole) module."""
    return [gdn.key_dim * world, gdn.key_dim * world, gdn.value_dim * world]


@torch.inference_mode()
def gather_state(runner: TextModelRunner, state: HybridState, world: int, group=None) -> HybridState:
    """Every rank's shard of a request's state -> the whole state (on every rank): what a prefill
    with TP=N hands to a decode with another degree. K/V and recurrent states join along their
    head dimension; the conv window per q/k/v part."""
    def gather(t: torch.Tensor, dim: int, parts: list[int] | None = None) -> torch.Tensor:
        pieces = torch.split(t, parts, dim=dim) if parts else [t]
        joined = []
        for piece in pieces:
            out = [torch.empty_like(piece) for _ in range(world)]
            dist.all_gather(out, piece.contiguous(), group=group)
            joined.append(torch.cat(out, dim=dim))
        return torch.cat(joined, dim=dim)

    full = HybridState.empty(runner.num_layers)
    full.num_tokens = state.num_tokens
    for index, layer in enumerate(runner.model.layers):
        if runner.layer_types[index] == "linear_attention":
            gdn = layer.linear_attn
            full.conv[index] = gather(state.conv[index], 1, [gdn.key_dim, gdn.key_dim, gdn.value_dim])
            full.recurrent[index] = gather(state.recurrent[index], 1)
        else:
            full.keys[index] = gather(state.keys[index], 1)
            full.values[index] = gather(state.values[index], 1)
    return full


def split_state(runner: TextModelRunner, state: HybridState, rank: int, world: int) -> HybridState:
    """A whole state -> this rank's shard, for the sharded ``runner`` (decode with TP=N taking a
    state from a prefill with TP=1, or with another degree after ``gather_state``)."""
    shard = HybridState.empty(runner.num_layers)
    shard.num_tokens = state.num_tokens
    for index, layer in enumerate(runner.model.layers):
        if runner.layer_types[index] == "linear_attention":
            gdn = layer.linear_attn
            shard.conv[index] = _rows(state.conv[index], _conv_parts(gdn, world), rank, world, dim=1)
            shard.recurrent[index] = _rows(state.recurrent[index], [gdn.num_v_heads * world], rank, world, dim=1)
        else:
            heads = state.keys[index].shape[1]
            shard.keys[index] = _rows(state.keys[index], [heads], rank, world, dim=1)
            shard.values[index] = _rows(state.values[index], [heads], rank, world, dim=1)
    return shard
