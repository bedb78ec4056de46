"""The language-model runner shared by prefill and decode: it owns the weights and runs forwards.

Qwen3.5's language model is a hybrid: most layers are Gated DeltaNet (linear attention with a
fixed-size causal-conv state and recurrent state), every fourth is full attention with a growing
K/V cache. The runner walks transformers' own decoder modules (so the weights and the kernels are
the reference ones) but keeps every piece of per-request state in an explicit ``HybridState``
that the caller owns: nothing about a request is stored on the shared model object. That is what
lets prefill run in one process, the state travel as raw tensors, and decode continue in another.

Decode batches: ``TextModelRunner.decode_step`` advances many requests by one token with one pass
over the weights (projections, MLP and LM head run once for the whole batch) over any
``BatchBuffers``: what decode keeps (``decode_svc.batch.DecodeBatch``): paged K/V per full-attention
layer read through each request's block table, conv and recurrent states stacked per linear layer.

Mixed forwards: ``TextModelRunner.mixed_step`` runs prefill chunks and a decode batch's rows in
one pass over the weights (every token-wise op over the concatenated rows, the attention and
Gated DeltaNet cores apart per kind), what an engine with prefill and decode on one device steps
with; ``forward_many`` and ``decode_step`` are its two one-kind cases, one layer walk for all three.

The same runner serves the mixture-of-experts family (``qwen3_5_moe``): its decoder layers have the
same attention modules, and ``layer.mlp`` is transformers' sparse MoE block (router, experts run
grouped by expert, gated shared expert), called on every token of a forward or a decode step at once.

The runner does not decide anything (which request runs, when state is freed): it only computes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers.activations import SiLUActivation
from transformers.models.qwen3_5 import modeling_qwen3_5 as qm

from epd import core_share, fused, kernels, kernels_prefill


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

    def clone(self) -> HybridState:
        """A deep copy: its tensors share no storage with this state's (a later forward writes
        into the state it is given, so a kept snapshot is only ever handed out as a copy)."""
        tensors = {name: tensor.clone() for name, tensor in self.named_tensors()}
        return HybridState.from_named_tensors(len(self.keys), self.num_tokens, tensors)


class BatchBuffers(Protocol):
    """What ``decode_step`` needs of a batch (``decode_svc.batch.DecodeBatch``): full-attention K/V
    behind ``attend`` (paged: it stores a step's new K/V and attends each slot over its own
    tokens through its block table), per-layer linear-attention slot buffers (``[slots, ...]``; the active slots are the
    leading rows) and each active slot's cached-token count."""

    conv: list[torch.Tensor | None]  # [capacity, kernel, conv_dim] per linear-attention layer (time-major)
    recurrent: list[torch.Tensor | None]  # [capacity, v_heads, k_dim, v_dim] float32
    lengths: list[int]

    def __len__(self) -> int: ...

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more tokens in every active slot."""

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Store each slot's new ``[slots, kv_heads, 1, dim]`` K/V; return each slot's rotated
        ``query [slots, heads, 1, dim]`` attended over its tokens, ``[slots, heads, 1, dim]``."""

    def advance(self) -> None:
        """Every active slot holds one more token."""


@dataclass
class TextModelRunner:
    """Owns the language model's weights; runs prefill and decode forwards over a HybridState."""

    model: qm.Qwen3_5TextModel
    lm_head_weight: torch.Tensor  # [vocab, hidden]
    layer_types: list[str] = field(init=False)
    lm_head: Callable[[torch.Tensor], torch.Tensor] = field(init=False, repr=False)
    # greedy rows' LM head through an int8 screen (kernels.GreedyScreen), where a decode runner has one
    greedy_screen: kernels.GreedyScreen | None = field(init=False, repr=False)
    # a decode step's layers as direct kernel calls (_DecodePlan): None until the first decode
    # step builds it, False where it does not apply; prepack_linears drops it
    decode_plan: _DecodePlan | bool | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.layer_types = list(self.model.config.layer_types)
        self.lm_head = functools.partial(F.linear, weight=self.lm_head_weight)
        self.greedy_screen = None
        self.decode_plan = None

    @classmethod
    def load(cls, model_dir: str, dtype: str = "float32", device: str | None = None,
             prepack: bool = True, decode: bool = False) -> TextModelRunner:
        """Load the language model of ``model_dir`` in ``dtype`` (a name: float32, bfloat16, float16).

        ``prepack``: on a CPU, move every linear layer to oneDNN with pre-packed weights (``prepack_linears``); a no-op where
        ``kernels.can_prepack`` says it does not apply. ``decode``: the runner serves decode steps
        (a few rows per product): its projections are merged (``prepack_linears``).
        """
        from epd import checkpoint  # heavy: only a role that serves the LM needs it
        from epd.tensors import default_device, parse_dtype

        device = device or default_device()
        model, lm_head = checkpoint.build_text_model(model_dir, dtype=parse_dtype(dtype), device=device)
        runner = cls(model=model, lm_head_weight=lm_head)
        if prepack and kernels.can_prepack(runner.device, runner.dtype):
            runner.prepack_linears(decode=decode)
        if runner.device.type == "cpu":
            kernels_prefill.available()  # the chunk kernel's oneDNN operator, built or loaded now, not in a request
            kernels_prefill.gdn_chunk_op()  # and the fused chunked rule
        return runner

    def prepack_linears(self, decode: bool = False, head: bool = True, merge: bool | None = None,
                        few_rows: bool | None = None) -> None:
        """Every projection, MLP and (``head``) the LM head through oneDNN with pre-packed weights
        (measured 1.5-3.6x faster than ATen's MKL GEMM here, docs/bench/kernels.md), or, for
        ``decode`` with ``few_rows`` (default: ``decode_linear_default``), through epd's few-row
        kernel where it is built (``kernels.DecodeLinear``: built with OpenMP, its threads claiming
        tasks from a shared counter, it beat oneDNN on whole bfloat16 decode steps at batch 1 and 8
        on AVX-512 without AMX, and at 256 rows it is level, docs/BENCHMARKS.md).
        For ``decode`` (unless ``merge=False``) the projections that read the same input first
        become one product each (``merge_projections``; measured on decode steps only, so prefill
        keeps them apart). The LM head is packed as a copy: its tied embedding table still needs
        the dense layout for lookups. A tensor-parallel shard passes ``head=False`` (its head is
        the rank's vocabulary rows, ``VocabParallelHead``). A decode runner whose head is the
        few-row kernel's also screens greedy rows' head (``kernels.GreedyScreen``, where the CPU
        has AMX-INT8 or AVX-512 VNNI): ``decode_step_greedy``."""
        if few_rows is None:
            few_rows = decode_linear_default(self.dtype)
        self.decode_plan = None  # built again from the new layers at the next decode step
        make = _linear_maker(self.dtype, decode and few_rows)
        if decode if merge is None else merge:
            merge_projections(self.model, make)
        kernels.prepack_linears(self.model, make)
        if head:
            self.lm_head = make(self.lm_head_weight)
            if decode and kernels.can_screen(self.lm_head, self.lm_head_weight):
                self.greedy_screen = kernels.GreedyScreen(self.lm_head, self.lm_head_weight)

    def prepare_decode_kernels(self) -> bool:
        """Build (or load the cached builds of) the fused decode-step kernels now rather than in the
        first decode step (a fresh machine compiles for ~10 s each); whether decode steps will use
        the fused Gated DeltaNet step."""
        if self.device.type != "cpu" or self.dtype not in FUSED_DTYPES or not fused.enabled():
            return False
        fused.decode_ops()  # the norms and the paged attention (the linear layers chose at load)
        return fused.ops() is not None

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

    def state_shapes(self, num_tokens: int) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor of a one-request state holding ``num_tokens`` tokens, by name
        (``HybridState.named_tensors`` names): what a handed-off state must look like."""
        shapes: dict[str, tuple[int, ...]] = {}
        for index, layer in enumerate(self.model.layers):
            if self.layer_types[index] == "linear_attention":
                gdn = layer.linear_attn
                shapes[f"conv.{index}"] = (1, gdn.conv_dim, gdn.conv_kernel_size)
                shapes[f"recurrent.{index}"] = (1, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
            else:
                attn = layer.self_attn
                # this rank's, under tensor parallelism
                kv_features = attn.qkv_proj.sizes[1] if hasattr(attn, "qkv_proj") else attn.k_proj.out_features
                kv_heads = kv_features // attn.head_dim
                shapes[f"keys.{index}"] = shapes[f"values.{index}"] = (1, kv_heads, num_tokens, attn.head_dim)
        return shapes

    def kv_bytes_per_token(self) -> int:
        """Bytes of full-attention K/V one token holds, over every layer (the paged pool's unit)."""
        total = 0
        for name, shape in self.state_shapes(1).items():
            if name.startswith(("keys.", "values.")):
                total += shape[1] * shape[3] * self.state_dtype(name).itemsize
        return total

    def slot_state_bytes(self) -> int:
        """Bytes of one request's fixed-size linear-attention state (conv + recurrent, every layer)."""
        total = 0
        for name, shape in self.state_shapes(1).items():
            if name.startswith(("conv.", "recurrent.")):
                total += int(torch.Size(shape).numel()) * self.state_dtype(name).itemsize
        return total

    def state_dtype(self, name: str) -> torch.dtype:
        """The dtype of the state tensor ``name``: the model's, except the recurrent state, which
        transformers' gated delta rule keeps in float32."""
        return torch.float32 if name.startswith("recurrent.") else self.dtype

    @property
    def vocab_size(self) -> int:
        return self.model.embed_tokens.num_embeddings

    def check_state(self, state: HybridState) -> None:
        """Raise ValueError unless ``state`` is exactly a state of this model holding
        ``state.num_tokens`` tokens (names, shapes and dtypes): checked before anything is sized from it."""
        if not 1 <= state.num_tokens <= self.model.config.max_position_embeddings:
            raise ValueError(f"state holds {state.num_tokens} tokens; must be in "
                             f"[1, {self.model.config.max_position_embeddings}]")
        want = self.state_shapes(state.num_tokens)
        have = {name: tuple(tensor.shape) for name, tensor in state.named_tensors()}
        if have.keys() != want.keys():
            missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
            raise ValueError(f"state tensors do not match the model: missing {missing[:4]}, unexpected {extra[:4]}")
        dtypes = {name: tensor.dtype for name, tensor in state.named_tensors()}
        for name, shape in want.items():
            if have[name] != shape:
                raise ValueError(f"state tensor {name} has shape {list(have[name])}, expected {list(shape)}")
            if dtypes[name] != self.state_dtype(name):
                raise ValueError(f"state tensor {name} is {dtypes[name]}, expected {self.state_dtype(name)}")

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` ids -> ``[num_tokens, hidden]`` embeddings."""
        return self.model.embed_tokens(token_ids.to(self.device))

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, state: HybridState) -> torch.Tensor:
        """Run ``embeds [T, hidden]`` at ``positions [3, T]`` on top of ``state`` (updated in place).

        Returns the final-norm hidden state of the last token, ``[hidden]``.
        """
        return self.forward_many([(embeds, positions, state)])[0]

    @torch.inference_mode()
    def forward_many(self, chunks: list[tuple[torch.Tensor, torch.Tensor, HybridState]]) -> torch.Tensor:
        """Run several sequences' chunks in one forward: each ``(embeds [T_i, hidden], positions
        [3, T_i], state_i)`` on top of its own state (updated in place). Every token-wise product
        (projections, MLP, norms) runs once over all the chunks' tokens; attention and the Gated
        DeltaNet recurrence run per sequence. Returns the final-norm hidden state of each chunk's
        last token, ``[len(chunks), hidden]``."""
        return self.forward_rows(chunks)[0]

    @torch.inference_mode()
    def forward_rows(self, chunks: list[tuple[torch.Tensor, torch.Tensor, HybridState]],
                     every_row: frozenset[int] = frozenset()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``forward_many``, and also the final-norm hidden state of every token of the chunks
        numbered in ``every_row``, ``{i: [T_i, hidden]}`` (prompt logprobs need the LM head on
        every prompt row; the other chunks pay for their last row only)."""
        out = self.mixed_step(chunks, None, [], [], every_row=every_row)
        return out.last_hidden, out.rows

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> float32 ``[..., vocab]`` logits (the head's dtype's values)."""
        one_pass = getattr(self.lm_head, "forward_float", None)  # kernels.DecodeLinear's: no copy after
        return one_pass(hidden) if one_pass is not None else self.lm_head(hidden).float()

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Final-normed rows ``[B, hidden]`` -> (each row's first-maximum logit index ``[B]``, the
        rows' finite flags ``[B]``): through the greedy screen where the runner has one and it
        answers, otherwise from the whole head's logits."""
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if self.greedy_screen is not None:
            rows = self.greedy_screen.argmax(hidden)
            if rows is not None:
                return rows
        return kernels.first_maxima(self.logits(hidden))

    @torch.inference_mode()
    def decode_step(self, batch: BatchBuffers, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """Advance every request of ``batch`` (in slot order) by one token.

        ``token_ids[i]`` is slot i's last token and ``positions[i]`` its position (a text token's
        three M-RoPE components are equal). Returns float32 logits ``[batch, vocab]``.
        """
        return self.logits(self._decode_hidden(batch, token_ids, positions))

    @torch.inference_mode()
    def decode_step_greedy(self, batch: BatchBuffers, token_ids: list[int],
                           positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode_step`` for a batch whose every row takes the plain argmax: (each row's first
        maximum index, its finite flag), as ``greedy`` gives them, without the logits."""
        return self.greedy(self._decode_hidden(batch, token_ids, positions))

    def _decode_hidden(self, batch: BatchBuffers, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """``decode_step``'s forward: the final-normed rows ``[B, hidden]``, before the LM head."""
        size = len(batch)
        if size == 0:
            raise ValueError("decode_step needs one token and position per slot (0), got an empty batch")
        if not self._fused_norms():
            return self.mixed_step([], batch, token_ids, positions, decode_head=False).decode_hidden
        # a decode-only step with the C++ decode kernels: residual adds folded into the norms
        if len(token_ids) != size or len(positions) != size:
            raise ValueError(f"decode_step needs one token and position per slot ({size}), "
                             f"got {len(token_ids)} and {len(positions)}")
        batch.reserve(1)
        device = self.device
        hidden = self.model.embed_tokens(torch.tensor(token_ids, dtype=torch.long, device=device)).unsqueeze(1)
        position_ids = torch.tensor(positions, dtype=torch.long, device=device).view(1, size, 1).expand(3, size, 1)
        cos, sin = self.model.rotary_emb(hidden, position_ids)
        plan = self._decode_plan(batch, hidden)
        if plan is not None:
            return plan.run(batch, hidden.view(size, -1), cos.view(size, -1), sin.view(size, -1))
        return self._decode_layers_fused(batch, hidden, cos, sin)

    def _decode_plan(self, batch: BatchBuffers, hidden: torch.Tensor) -> _DecodePlan | None:
        """The runner's ``_DecodePlan`` where it serves this step (built at the first decode step
        after a load or ``prepack_linears``), else None: ``_decode_layers_fused`` runs instead.
        The switches that may change between steps (``EPD_FUSED_KERNELS``, a batch without paged
        pools) are asked again each step through the same predicates the module path asks."""
        if self.decode_plan is None:
            self.decode_plan = _DecodePlan.build(self) or False
        plan = self.decode_plan
        if plan is False or not plan.serves(batch, hidden):
            return None
        return plan

    @torch.inference_mode()
    def mixed_step(self, chunks: list[tuple[torch.Tensor, torch.Tensor, HybridState]], batch: BatchBuffers | None,
                   token_ids: list[int], positions: list[int], sample_chunks: frozenset[int] = frozenset(),
                   every_row: frozenset[int] = frozenset(),
                   splits: dict[int, Sequence[int]] | None = None, decode_head: bool = True) -> StepOutput:
        """Prefill chunks and a decode step in one forward: one pass over the weights for both.

        ``chunks`` as ``forward_many`` (each on top of its own state, updated in place); ``batch``
        with ``token_ids``/``positions`` as ``decode_step`` (every active slot advances one token;
        ``batch`` may be None or empty, with no tokens). Every token-wise op (embedding rows,
        norms, every projection, the MLP or MoE block) runs once over the chunks' tokens followed
        by the decode rows; only the mixing cores run apart: the chunked Gated DeltaNet and prefill
        attention per chunk, the fused (or recurrent) GDN step and paged decode attention for the
        batch. The LM head runs once, over the decode rows and the last rows of the chunks named
        in ``sample_chunks`` (those whose prompt ends there), nothing else. ``decode_head=False``
        leaves the decode rows out of it: their final-normed rows are ``StepOutput.decode_hidden``
        instead (for ``greedy``).

        ``splits``: chunk -> token offsets inside it (0 < offset < its length) where its state is
        wanted as well (prefix-cache snapshots, ``StepOutput.snapshots``). The mixing cores run
        such a chunk as consecutive pieces cut there, each on top of the one before (what two
        chunks in two forwards would compute); the token-wise ops still run once over every row.
        A piece's K/V, conv window and recurrent state are fresh tensors the next piece does not
        change, so a snapshot holds them without a copy."""
        size = 0 if batch is None else len(batch)
        if len(token_ids) != size or len(positions) != size:
            raise ValueError(f"decode_step needs one token and position per slot ({size}), "
                             f"got {len(token_ids)} and {len(positions)}")
        if size == 0 and not chunks:
            raise ValueError("mixed_step needs a prefill chunk or a decode row")
        if size:
            batch.reserve(1)
        lengths = [embeds.shape[0] for embeds, _, _ in chunks]
        snapshots: dict[int, list[HybridState]] = {}
        hidden = self._layers(chunks, batch if size else None, token_ids, positions,  # [1, ΣT + B, hidden]
                              splits or {}, snapshots)
        for (_, _, state), length in zip(chunks, lengths):
            state.num_tokens += length
        if size:
            batch.advance()
        ends = torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()
        rows = {i: self.model.norm(hidden[0, ends[i] - lengths[i]:ends[i]]) for i in every_row}
        last = (self.model.norm(hidden[0, torch.tensor([end - 1 for end in ends], dtype=torch.long, device=self.device)])
                if chunks else hidden.new_empty(0, hidden.shape[-1]))
        sampled = sorted(sample_chunks)
        heads = [last[sampled]] if sampled else []
        decode_rows = self.model.norm(hidden[0, sum(lengths):]) if size else None
        if decode_rows is not None and decode_head:
            heads.append(decode_rows)
        # [S + B, vocab]: one LM-head product for every row that samples
        logits = (self.logits(torch.cat(heads) if len(heads) > 1 else heads[0]) if heads
                  else torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device))
        return StepOutput(last_hidden=last, rows=rows,
                          chunk_logits={i: logits[k] for k, i in enumerate(sampled)},
                          decode_logits=logits[len(sampled):] if decode_head else None, snapshots=snapshots,
                          decode_hidden=None if decode_head else decode_rows)

    def _layers(self, chunks: list[tuple[torch.Tensor, torch.Tensor, HybridState]], batch: BatchBuffers | None,
                token_ids: list[int], positions: list[int], splits: dict[int, Sequence[int]],
                snapshots: dict[int, list[HybridState]]) -> torch.Tensor:
        """The layers over the chunks' tokens then the batch's decode rows: the last layer's output
        ``[1, ΣT + B, hidden]``, before the norm (states and batch not yet advanced). A chunk with
        ``splits`` runs its mixing cores piece by piece; the state after each piece but the last
        goes to ``snapshots[chunk]`` (``mixed_step``)."""
        device = self.device
        lengths, states, marks = [], [], []  # per piece of a chunk (a chunk without splits is one piece)
        for number, (embeds, _, state) in enumerate(chunks):
            length = embeds.shape[0]
            cuts = sorted(set(splits.get(number, ())))
            if cuts and not 0 < cuts[0] <= cuts[-1] < length:
                raise ValueError(f"chunk {number} of {length} tokens cannot be split at {cuts}")
            for start, end in zip([0, *cuts], [*cuts, length]):
                lengths.append(end - start)
                states.append(state)
                mark = None
                if end < length:  # the state after this piece: filled layer by layer
                    mark = HybridState.empty(self.num_layers)
                    mark.num_tokens = state.num_tokens + end
                    snapshots.setdefault(number, []).append(mark)
                marks.append(mark)
        parts = [embeds.to(device, self.dtype) for embeds, _, _ in chunks]
        position_parts = [pos.to(device) for _, pos, _ in chunks]
        if batch is not None:
            parts.append(self.model.embed_tokens(torch.tensor(token_ids, dtype=torch.long, device=device)))
            position_parts.append(torch.tensor(positions, dtype=torch.long, device=device).expand(3, -1))
        hidden = (torch.cat(parts) if len(parts) > 1 else parts[0]).unsqueeze(0)  # [1, N, hidden]
        position_ids = torch.cat(position_parts, dim=1) if len(position_parts) > 1 else position_parts[0]
        cos, sin = self.model.rotary_emb(hidden, position_ids.unsqueeze(1))  # [1, N, rotary_dim]
        mix = _Mix(lengths, states, batch, len(token_ids) if batch is not None else 0, marks)
        if self._fused_norms():
            return self._layers_fused(hidden, cos, sin, mix)
        for index, layer in enumerate(self.model.layers):
            core_share.rebalance()  # a step of seconds follows the encoder's comings and goings
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            if self.layer_types[index] == "linear_attention":
                hidden = _linear_attention(layer.linear_attn, hidden, mix, index)
            else:
                hidden = _full_attention(layer.self_attn, hidden, cos, sin, mix, index)
            hidden = residual + hidden
            hidden = hidden + _mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        return hidden

    def _layers_fused(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mix: _Mix) -> torch.Tensor:
        """``_layers``' loop with each residual add folded into the norm after it
        (``kernels.add_rms_norm``, as ``_decode_layers_fused``): the same values, one pass over the
        ``[N, hidden]`` rows per norm instead of the add and the norm's six."""
        rows = hidden.shape[1]
        residual = hidden.reshape(rows, -1).clone()  # updated in place: never the caller's embeddings
        out = None
        for index, layer in enumerate(self.model.layers):
            core_share.rebalance()
            normed = _add_norm(out, residual, layer.input_layernorm).view(1, rows, -1)
            if self.layer_types[index] == "linear_attention":
                out = _linear_attention(layer.linear_attn, normed, mix, index)
            else:
                out = _full_attention(layer.self_attn, normed, cos, sin, mix, index)
            normed = _add_norm(out, residual, layer.post_attention_layernorm).view(1, rows, -1)
            out = _mlp(layer.mlp, normed)
        return (residual + out.reshape(rows, -1)).view(1, rows, -1)

    def _fused_norms(self) -> bool:
        """Whether the residual adds and decoder RMSNorms of every forward (decode steps, prefill
        chunks, mixed steps) run as one C++ call each (``kernels.add_rms_norm``): a CPU, the
        kernels built, transformers' Qwen3.5 RMSNorm."""
        if self.device.type != "cpu" or self.dtype not in FUSED_DTYPES or not fused.decode_ops():
            return False
        norms = [self.model.norm, *(n for layer in self.model.layers
                                    for n in (layer.input_layernorm, layer.post_attention_layernorm))]
        return all(type(n) in _RMS_NORMS for n in norms)

    def _decode_layers_fused(self, batch: BatchBuffers, hidden: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> torch.Tensor:
        """The decode step's layers with each residual add folded into the norm after it: the
        residual stream ``[B, hidden]`` is updated in place by ``add_rms_norm`` (``r += x``, then
        the norm of r), which computes what ``residual + hidden`` and the norm compute apart."""
        size = hidden.shape[0]
        residual = hidden.view(size, -1)  # the embedding rows: a temporary of this step
        out = None
        for index, layer in enumerate(self.model.layers):
            core_share.rebalance()
            normed = _add_norm(out, residual, layer.input_layernorm).view(size, 1, -1)
            if self.layer_types[index] == "linear_attention":
                out = _linear_attention_step(layer.linear_attn, normed, batch, index)
            else:
                out = _full_attention_step(layer.self_attn, normed, cos, sin, batch, index)
            normed = _add_norm(out, residual, layer.post_attention_layernorm).view(size, 1, -1)
            out = _mlp(layer.mlp, normed)
        batch.advance()
        return _add_norm(out, residual, self.model.norm)


PLAN_CALLS = 4  # a decode step's layers in this many C++ calls: the core share resized between them


class _DecodePlan:
    """A decode-only step's layers as direct calls of the C++ kernels (``torch.ops.epd_decode``
    and the fused Gated DeltaNet step) on weights, constants and shapes looked up once, rather
    than through the modules: the same ops on the same inputs in the same order as
    ``_decode_layers_fused`` (bit-identical, tests/test_decode_kernels.py), without the Python of
    ~200 module calls, reshapes and checks a step. Why: that Python was ~12 of a 109 ms 16-row
    bfloat16 step of qwen3.5-0.8b on two cores (its kernels alone, replayed: 97 ms), and while
    the forward thread runs it the team's other thread has nothing to do.

    The layers run as a few C++ calls (``epd_decode.decode_layers``, ``PLAN_CALLS`` runs of
    layers) rather than ~10 op calls a layer from Python: each op call gives the GIL up and takes
    it back, and on a served replica, where other Python threads (the gRPC loop making the tokens'
    messages, watches) hold it at times, every take-back can wait for them. A served pure-decode
    load of 8 rows: 67.0-68.9 ms a step against 71.4-71.6 with the calls from Python
    (docs/BENCHMARKS.md).

    It serves a runner whose decode layers are all what the fused path runs: the few-row kernel
    (``kernels.DecodeLinear``) under merged projections, Qwen3.5's RMSNorms, SiLU, the gated norm,
    a head dim the paged attention takes (``build`` says None otherwise), and a step whose batch
    lends paged pools with the fused kernels on (``serves``)."""

    def __init__(self, runner: TextModelRunner, layers: list[tuple], first_gdn, first_attention) -> None:
        self.layers = layers  # per layer: ("gdn", ...) or ("attention", ...), see build
        self.final_norm = (runner.model.norm.weight, float(runner.model.norm.eps))
        self.first_gdn, self.first_attention = first_gdn, first_attention  # what serves() asks about
        self.constants: list[tuple] = []  # the Gated DeltaNet layers' _gdn_constants the encoding holds
        self.segments: list[tuple] = []  # per decode_layers call: (layers, weights, ints, reals)

    def _encode(self) -> None:
        """The layers as ``torch.ops.epd_decode.decode_layers`` reads them (epd/csrc/decode_ops.cpp,
        ``LayerReader``: the same order), in ``PLAN_CALLS`` runs of consecutive layers."""
        constants, encoded = [], []
        for index, ((w1, eps1), (w2, eps2)), mixer, gate_up, down in self.layers:
            weights, ints, reals = [w1, w2], [], [eps1, eps2]

            def linear(layer: tuple) -> None:
                weight, width, bias = layer
                weights.extend((weight, bias))
                ints.append(width)
            if mixer[0] == "gdn":
                _, (in_proj, sizes), gdn, norm_weight, norm_eps, k_heads, k_dim, v_dim, o_proj = mixer
                taps, conv_bias, neg_a_exp, dt_bias = _gdn_constants(gdn)
                constants.append((gdn, taps))
                ints.append(0)
                linear(in_proj)
                ints.extend(sizes)
                weights.extend((taps, conv_bias, neg_a_exp, dt_bias, norm_weight))
                reals.append(norm_eps)
                ints.extend((k_heads, k_dim, v_dim))
            else:
                _, (qkv, sizes), q_weight, k_weight, eps, scale, o_proj = mixer
                ints.append(1)
                linear(qkv)
                ints.extend(sizes)
                weights.extend((q_weight, k_weight))
                reals.extend((eps, scale))
            linear(o_proj)
            linear(gate_up[0])
            ints.extend(gate_up[1])
            linear(down)
            encoded.append((index, mixer[0], weights, ints, reals))
        per_call, self.segments = -(-len(encoded) // PLAN_CALLS), []
        for lo in range(0, len(encoded), per_call):
            run = encoded[lo:lo + per_call]
            self.segments.append(([(index, kind) for index, kind, *_ in run],
                                  [weight for *_, weights, _, _ in run for weight in weights],
                                  [value for *_, ints, _ in run for value in ints],
                                  [value for *_, reals in run for value in reals]))
        self.constants = constants

    def _encoded(self) -> list[tuple]:
        """``segments``, encoded again where a Gated DeltaNet layer's constants were computed again
        (one of its weights replaced or changed in place: ``_gdn_constants``)."""
        if not self.segments or any(_gdn_constants(gdn)[0] is not taps for gdn, taps in self.constants):
            self._encode()
        return self.segments

    @staticmethod
    def _linear(module) -> tuple | None:
        """(packed weight, output width, bias) of a few-row kernel layer; None for anything else."""
        if type(module) is not kernels.DecodeLinear:
            return None
        return module.weight, module.out_features, module.bias

    @classmethod
    def _merged(cls, module) -> tuple | None:
        """A ``MergedLinear`` over the few-row kernel: (its ``_linear``, the parts' widths)."""
        if type(module) is not kernels.MergedLinear:
            return None
        linear = cls._linear(module.linear)
        return None if linear is None else (linear, list(module.sizes))

    @classmethod
    def build(cls, runner: TextModelRunner) -> _DecodePlan | None:
        if (runner.device.type != "cpu" or runner.dtype not in FUSED_DTYPES or not runner._fused_norms()
                or not fused.decode_ops() or fused.ops() is None):
            return None
        layers, first = [], {}
        for index, layer in enumerate(runner.model.layers):
            mlp = layer.mlp
            if type(mlp) is not GatedMLP or type(mlp.act_fn) not in _SILU:
                return None
            gate_up, down = cls._merged(mlp.gate_up_proj), cls._linear(mlp.down_proj)
            norms = ((layer.input_layernorm.weight, float(layer.input_layernorm.eps)),
                     (layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.eps)))
            if gate_up is None or down is None or len(gate_up[1]) != 2:
                return None
            if runner.layer_types[index] == "linear_attention":
                gdn = layer.linear_attn
                in_proj, out_proj = cls._merged(getattr(gdn, "in_proj", None)), cls._linear(gdn.out_proj)
                if (in_proj is None or out_proj is None or gdn.activation not in ("silu", "swish")
                        or type(gdn.norm) is not qm.Qwen3_5RMSNormGated):
                    return None
                first.setdefault("gdn", gdn)
                mixer = ("gdn", in_proj, gdn, gdn.norm.weight.contiguous(),
                         float(gdn.norm.variance_epsilon), gdn.num_k_heads, gdn.head_k_dim, gdn.head_v_dim, out_proj)
            else:
                attn = layer.self_attn
                qkv, o_proj = cls._merged(getattr(attn, "qkv_proj", None)), cls._linear(attn.o_proj)
                if (qkv is None or o_proj is None or attn.head_dim % 16 or type(attn.q_norm) not in _RMS_NORMS
                        or type(attn.k_norm) not in _RMS_NORMS):
                    return None
                first.setdefault("attention", attn)
                mixer = ("attention", qkv, attn.q_norm.weight, attn.k_norm.weight, float(attn.q_norm.eps),
                         float(attn.scaling), o_proj)
            layers.append((index, norms, mixer, gate_up, down))
        return cls(runner, layers, first.get("gdn"), first.get("attention"))

    def serves(self, batch: BatchBuffers, hidden: torch.Tensor) -> bool:
        """This step's switches, asked as the module path asks them (once for the step); with
        autograd on, ``kernels.silu_mul`` takes torch's ops, so the module path runs."""
        if torch.is_grad_enabled():
            return False
        if self.first_gdn is not None and _fused_gdn(self.first_gdn, hidden) is None:
            return False
        return self.first_attention is None or _fused_attention(self.first_attention, hidden, batch)

    def run(self, batch: BatchBuffers, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``_decode_layers_fused`` over ``residual [B, hidden]`` (the step's embedding rows,
        updated in place), ``cos``/``sin`` ``[B, rotary_dim]``: the final-normed rows. The layers
        run as ``PLAN_CALLS`` C++ calls (``epd_decode.decode_layers``), the core share resized
        between them."""
        layers_op, out, rows = torch.ops.epd_decode.decode_layers, None, (None, None, None)
        for layers, weights, ints, reals in self._encoded():
            core_share.rebalance()
            buffers = []
            for index, kind in layers:
                if kind == "gdn":
                    buffers += (batch.conv[index], batch.recurrent[index])
                else:
                    keys, values, *rows = batch.paged(index)
                    buffers += (keys, values)
            out = layers_op(out, residual, cos, sin, weights, ints, reals, buffers, *rows)
        batch.advance()
        return torch.ops.epd_decode.add_rms_norm(out, residual, *self.final_norm)


@dataclass
class StepOutput:
    """What ``TextModelRunner.mixed_step`` returns."""

    last_hidden: torch.Tensor  # [num_chunks, hidden]: each chunk's last row, final norm
    rows: dict[int, torch.Tensor]  # chunk -> [T_i, hidden] every row, final norm (the chunks in every_row)
    chunk_logits: dict[int, torch.Tensor]  # chunk -> float32 [vocab] of its last row (the chunks in sample_chunks)
    decode_logits: torch.Tensor | None  # float32 [batch, vocab], slot order (None: decode_head=False)
    # chunk -> its state at each of its splits, in order (``mixed_step``'s splits)
    snapshots: dict[int, list[HybridState]] = field(default_factory=dict)
    decode_hidden: torch.Tensor | None = None  # [batch, hidden] final-normed (mixed_step's decode_head=False)


@dataclass
class _Mix:
    """Who owns the rows of one mixed forward: the chunks' tokens first (piece i owns the next
    ``lengths[i]``, on top of ``states[i]``; a chunk cut at splits is consecutive pieces on one
    state), then one row per active slot of ``batch``."""

    lengths: list[int]
    states: list[HybridState]
    batch: BatchBuffers | None
    num_decode: int  # the batch's active slots (0 without one)
    marks: list[HybridState | None] = field(default_factory=list)  # per piece: a snapshot to fill after it

    def pieces(self):
        """(length, state, snapshot to fill after it or None) of each piece, in row order."""
        return zip(self.lengths, self.states, self.marks, strict=True)

_RMS_NORMS = (qm.Qwen3_5RMSNorm,)


def _add_norm(x: torch.Tensor | None, residual: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """``norm(residual + x)`` of ``[B, 1, hidden]`` (or None) onto the residual rows ``[B, hidden]``,
    which become ``residual + x``."""
    rows = None if x is None else x.reshape(residual.shape)
    return kernels.add_rms_norm(rows, residual, norm.weight, norm.eps)


DECODE_LINEAR_ENV = "EPD_DECODE_LINEAR"
"""``0``: a decode runner's linear layers use oneDNN's pre-packed GEMM instead of ``kernels.DecodeLinear``;
``1``: the few-row kernel whatever the CPU; unset: ``decode_linear_default``."""


def decode_linear_default(dtype: torch.dtype) -> bool:
    """Whether a decode runner's linear layers go on epd's few-row kernel (``kernels.DecodeLinear``)
    rather than oneDNN: ``EPD_DECODE_LINEAR`` when it says ``0`` or ``1``; otherwise yes, except
    for bfloat16 on a CPU with AMX (``kernels.amx_bf16``) where the kernel's build has no tile path
    (``fused.decode_tiles``): there oneDNN's tiles run a decode step of 8 rows or more, and every
    prefill chunk an aggregated step carries, faster than its registers (docs/BENCHMARKS.md, "A CPU
    with AMX")."""
    setting = os.environ.get(DECODE_LINEAR_ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    if dtype == torch.bfloat16 and kernels.amx_bf16():
        return fused.decode_tiles()
    return True


def _linear_maker(dtype: torch.dtype, few_rows: bool):
    """What builds the runner's linear layers from a weight: epd's few-row kernel when asked and
    it serves the dtype, otherwise ``kernels.linear_maker``'s choice (oneDNN's pre-packed GEMM,
    or for bfloat16 where oneDNN has no kernels epd's packed kernel again)."""
    probe = torch.empty(0, 2, dtype=dtype)
    if few_rows and kernels.can_decode_pack(probe):
        return kernels.DecodeLinear
    return kernels.linear_maker(probe.device, dtype)


def _project(module: torch.nn.Module, merged: str, names: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs of ``module``'s projections ``names`` for ``x``: one product where
    ``merge_projections`` stacked them (the attribute ``merged``), one each otherwise."""
    group = getattr(module, merged, None)
    if group is not None:
        return group(x)
    return tuple(getattr(module, name)(x) for name in names)


_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_GDN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


class GatedMLP(torch.nn.Module):
    """Qwen3.5's SwiGLU MLP with its gate and up projections as one product:
    ``down(act(gate(x)) * up(x))``, as transformers' ``Qwen3_5MLP``."""

    def __init__(self, mlp: torch.nn.Module, make) -> None:
        super().__init__()
        self.gate_up_proj = kernels.MergedLinear([mlp.gate_proj, mlp.up_proj], make)
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        if type(self.act_fn) in _SILU:  # one pass where the C++ kernels serve (bit-identical in bfloat16)
            return self.down_proj(kernels.silu_mul(gate, up))
        return self.down_proj(self.act_fn(gate) * up)


_SILU = (SiLUActivation, torch.nn.SiLU)


def _mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A decoder layer's MLP block: transformers' dense SwiGLU MLP with its activation and product
    as one pass (``kernels.silu_mul``, as ``GatedMLP``), any other block (MoE, merged) as it is."""
    if type(mlp) is qm.Qwen3_5MLP and type(mlp.act_fn) in _SILU:
        return mlp.down_proj(kernels.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    return mlp(x)


def merge_projections(model: torch.nn.Module, make) -> None:
    """Stack the projections that read the same input into one product each, in place (vLLM's
    merged column-parallel linears): full attention's q/k/v (``qkv_proj``), Gated DeltaNet's
    qkv/z/b/a (``in_proj``), a dense MLP's gate and up (``GatedMLP``). ``make`` builds each
    stacked product from its weight. Under tensor parallelism this runs on a rank's shard (each
    part already this rank's columns), so the merged layer is this rank's too."""
    for layer in model.layers:
        attn, gdn = getattr(layer, "self_attn", None), getattr(layer, "linear_attn", None)
        if attn is not None and all(type(getattr(attn, n, None)) is torch.nn.Linear for n in _ATTENTION_PROJECTIONS):
            attn.qkv_proj = kernels.MergedLinear([getattr(attn, n) for n in _ATTENTION_PROJECTIONS], make)
            for name in _ATTENTION_PROJECTIONS:
                delattr(attn, name)
        if gdn is not None and all(type(getattr(gdn, n, None)) is torch.nn.Linear for n in _GDN_PROJECTIONS):
            gdn.in_proj = kernels.MergedLinear([getattr(gdn, n) for n in _GDN_PROJECTIONS], make)
            for name in _GDN_PROJECTIONS:
                delattr(gdn, name)
        if type(layer.mlp) is qm.Qwen3_5MLP and all(
                type(getattr(layer.mlp, n)) is torch.nn.Linear for n in ("gate_proj", "up_proj")):
            layer.mlp = GatedMLP(layer.mlp, make)


def _attention_inputs(attn: qm.Qwen3_5Attention, x: torch.Tensor):
    """The token-wise part of gated attention for ``x [B, L, hidden]``: normed query and key,
    value ``[B, L, heads, dim]`` and the output gate ``[B, L, heads * dim]``."""
    batch, length, _ = x.shape
    head_dim = attn.head_dim
    query_gate, key, value = _project(attn, "qkv_proj", _ATTENTION_PROJECTIONS, x)
    query, gate = torch.chunk(query_gate.view(batch, length, -1, head_dim * 2), 2, dim=-1)
    key = attn.k_norm(key.view(batch, length, -1, head_dim))
    value = value.view(batch, length, -1, head_dim)
    return attn.q_norm(query), key, value, gate.reshape(batch, length, -1)


def _full_attention(attn: qm.Qwen3_5Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    mix: _Mix, index: int) -> torch.Tensor:
    """Gated full attention with partial M-RoPE over ``x [1, N, hidden]`` (rows as ``mix`` says):
    prefill attention per chunk (its K/V appended to its state), then one paged decode step for
    the batch's rows. The projections run once over all N rows."""
    queries, keys, values, gate = _attention_inputs(attn, x)
    outs, start = [], 0
    for length, state, mark in mix.pieces():
        part = slice(start, start + length)
        start += length
        outs.append(_prefill_attention(attn, queries[:, part], keys[:, part], values[:, part], cos[:, part],
                                       sin[:, part], state, index))
        if mark is not None:
            mark.keys[index], mark.values[index] = state.keys[index], state.values[index]
    if mix.num_decode:
        rows = slice(start, None)  # one row per slot -> [slots, 1, heads, dim]
        query, key = qm.apply_rotary_pos_emb(queries[0, rows].unsqueeze(2), keys[0, rows].unsqueeze(2),
                                             cos[0, rows].unsqueeze(1), sin[0, rows].unsqueeze(1))
        out = mix.batch.attend(index, query, key, values[0, rows].unsqueeze(2), attn.scaling)
        outs.append(out.transpose(1, 2).reshape(1, mix.num_decode, -1))
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return attn.o_proj(out * torch.sigmoid(gate))


def _prefill_attention(attn: qm.Qwen3_5Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, state: HybridState, index: int) -> torch.Tensor:
    """One chunk's attention (``[1, T, heads, dim]`` inputs) on top of its state's K/V, which it
    extends; ``[1, T, heads * dim]``."""
    length = query.shape[1]
    query, key = qm.apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    value = value.transpose(1, 2)
    past_keys, past_values = state.keys[index], state.values[index]
    if past_keys is not None:
        key = torch.cat([past_keys, key], dim=2)
        value = torch.cat([past_values, value], dim=2)
    state.keys[index], state.values[index] = key, value
    mask = None
    if length > 1 and past_keys is not None:
        # A chunk on top of cached tokens: each new token sees all the past and its own prefix.
        total = key.shape[2]
        mask = torch.ones(length, total, dtype=torch.bool, device=query.device).tril(total - length)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=length > 1 and mask is None,
                                         scale=attn.scaling, enable_gqa=True)
    return out.transpose(1, 2).reshape(1, length, -1)


def _gdn_projections(gdn: qm.Qwen3_5GatedDeltaNet, x: torch.Tensor):
    """Gated DeltaNet's input projections of ``x [..., hidden]``: the conv input ``[..., conv_dim]``,
    the output gate z ``[..., v_heads * v_dim]``, and in_proj_a's and in_proj_b's raw outputs
    ``[..., v_heads]``."""
    mixed, z, b, a = _project(gdn, "in_proj", _GDN_PROJECTIONS, x)
    return mixed, z, a, b


def _gdn_gates(gdn: qm.Qwen3_5GatedDeltaNet, a: torch.Tensor, b: torch.Tensor):
    """beta and the decay g from in_proj_a's and in_proj_b's outputs."""
    # float32 here because A may overflow to -inf in half precision (as transformers does).
    return b.sigmoid(), -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)


def _split_qkv(gdn: qm.Qwen3_5GatedDeltaNet, mixed: torch.Tensor):
    """The conv output ``[B, L, conv_dim]`` -> query, key ``[B, L, k_heads, k_dim]``, value."""
    batch, length, _ = mixed.shape
    query, key, value = torch.split(mixed, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
    return (query.reshape(batch, length, -1, gdn.head_k_dim), key.reshape(batch, length, -1, gdn.head_k_dim),
            value.reshape(batch, length, -1, gdn.head_v_dim))


def _linear_attention(gdn: qm.Qwen3_5GatedDeltaNet, x: torch.Tensor, mix: _Mix, index: int) -> torch.Tensor:
    """Gated DeltaNet over ``x [1, N, hidden]`` (rows as ``mix`` says): the projections and
    out_proj once over all N rows; the chunked rule per chunk (carrying each one's conv window and
    recurrent state in its own state), one recurrent step for the batch's rows (its slot buffers
    updated in place)."""
    mixed, z, a, b = (t[0] for t in _gdn_projections(gdn, x))  # [N, ...]
    cores, start = [], 0
    for length, state, mark in mix.pieces():
        part = slice(start, start + length)
        start += length
        cores.append(_gdn_prefill_core(gdn, mixed[part], z[part], a[part], b[part], state, index, x.device))
        if mark is not None:
            mark.conv[index], mark.recurrent[index] = state.conv[index], state.recurrent[index]
    if mix.num_decode:
        rows = slice(start, None)
        cores.append(_gdn_decode_core(gdn, mixed[rows], z[rows], a[rows], b[rows], mix.batch, index))
    core = torch.cat(cores) if len(cores) > 1 else cores[0]  # [N, v_heads * v_dim], gated-normed
    return gdn.out_proj(core.unsqueeze(0))


def _gdn_prefill_core(gdn: qm.Qwen3_5GatedDeltaNet, mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, state: HybridState, index: int, device: torch.device) -> torch.Tensor:
    """One chunk's conv and gated delta rule (projections ``[T, ...]``) on top of its state;
    returns the gated-normed core ``[T, v_heads * v_dim]``."""
    length = mixed.shape[0]
    beta, g = (t.unsqueeze(0) for t in _gdn_gates(gdn, a, b))  # [1, T, v_heads]
    conv = kernels_prefill.causal_conv1d if kernels_prefill.serves(mixed) else kernels.causal_conv1d
    conv_out, state.conv[index] = conv(  # [1, conv_dim, T], a view of time-major memory
        mixed.unsqueeze(0).transpose(1, 2), gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, gdn.activation,
        window=state.conv[index])
    query, key, value = _split_qkv(gdn, conv_out.transpose(1, 2))
    recurrent = state.recurrent[index]
    if recurrent is not None and length == 1:
        # the state may be a caller's snapshot (prefix cache): update a copy, never the original
        recurrent = recurrent.to(torch.float32, copy=True)
        core = kernels.recurrent_gated_delta_step(query, key, value, g, beta, recurrent)
    else:
        core, recurrent = _chunk_rule(mixed)(
            query, key, value, g=g, beta=beta, chunk_size=_gdn_chunk(device),
            initial_state=recurrent, output_final_state=True, use_qk_l2norm_in_kernel=True)
    state.recurrent[index] = recurrent
    if type(gdn.norm) is qm.Qwen3_5RMSNormGated:  # one C++ pass where it serves
        return kernels_prefill.gated_rms_norm(gdn.norm, core.reshape(length, -1), z)
    core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
    return core.reshape(length, -1)


def _gdn_decode_core(gdn: qm.Qwen3_5GatedDeltaNet, mixed: torch.Tensor, z: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, batch: BatchBuffers, index: int) -> torch.Tensor:
    """One token per slot (projections ``[B, ...]``): conv and recurrent slot states updated in
    place; returns the gated-normed core ``[B, v_heads * v_dim]``.

    On a CPU this is one fused C++ call (``epd.fused``) where it is built and applies
    (``_fused_gdn``); otherwise the torch path."""
    size = mixed.shape[0]
    op = _fused_gdn(gdn, mixed)
    if op is not None:
        return fused.gdn_decode_step(
            mixed, batch.conv[index][:size], _gdn_constants(gdn), a, b, z, gdn.norm.weight,
            gdn.norm.variance_epsilon, batch.recurrent[index][:size], gdn.num_k_heads, gdn.head_k_dim,
            gdn.head_v_dim, op=op)
    beta, g = (t.unsqueeze(1) for t in _gdn_gates(gdn, a, b))  # [B, 1, v_heads]
    conv_out = kernels.causal_conv1d_step(mixed, batch.conv[index][:size], gdn.conv1d.weight[:, 0],
                                          gdn.conv1d.bias, gdn.activation).unsqueeze(1)
    query, key, value = _split_qkv(gdn, conv_out)
    core = kernels.recurrent_gated_delta_step(query, key, value, g, beta, batch.recurrent[index][:size])
    core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
    return core.reshape(size, -1)


def _full_attention_step(attn: qm.Qwen3_5Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         batch: BatchBuffers, index: int) -> torch.Tensor:
    """One token per slot: the batch stores its K/V at the slot's length and attends each slot over
    its own tokens, through its block table. On a CPU with the decode kernels, a batch that lends
    its pools (``DecodeBatch.paged``) and a merged projection, everything between ``qkv_proj`` and
    ``o_proj`` is two C++ calls (``_fused_attention_step``)."""
    size = x.shape[0]
    if _fused_attention(attn, x, batch):
        return _fused_attention_step(attn, x, cos, sin, batch, index)
    query, key, value, gate = _attention_inputs(attn, x)
    query, key = qm.apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    out = batch.attend(index, query, key, value.transpose(1, 2), attn.scaling)
    out = out.transpose(1, 2).reshape(size, 1, -1)
    return attn.o_proj(out * torch.sigmoid(gate))


def _fused_attention(attn: qm.Qwen3_5Attention, x: torch.Tensor, batch: BatchBuffers) -> bool:
    return (x.device.type == "cpu" and x.dtype in FUSED_DTYPES and hasattr(attn, "qkv_proj")
            and hasattr(batch, "paged") and attn.head_dim % 16 == 0 and type(attn.q_norm) in _RMS_NORMS
            and type(attn.k_norm) in _RMS_NORMS and fused.decode_ops())


def _fused_attention_step(attn: qm.Qwen3_5Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          batch: BatchBuffers, index: int) -> torch.Tensor:
    """``_full_attention_step`` as two C++ calls: q/k norms, rotary and the K/V write
    (``kernels.attention_decode_inputs``), then every slot's attention and the output gate
    (``kernels.paged_decode_attention``): the same arithmetic, rounded where the torch path rounds."""
    size = x.shape[0]
    query_gate, key, value = attn.qkv_proj(x.reshape(size, -1))
    keys, values, write, runs, offsets = batch.paged(index)
    query = kernels.attention_decode_inputs(query_gate, key, value, attn.q_norm, attn.k_norm, cos.reshape(size, -1),
                                            sin.reshape(size, -1), keys, values, write)
    out = kernels.paged_decode_attention(query, keys, values, runs, offsets, attn.scaling, gate=query_gate)
    return attn.o_proj(out.view(size, 1, -1))


def _linear_attention_step(gdn: qm.Qwen3_5GatedDeltaNet, x: torch.Tensor, batch: BatchBuffers, index: int) -> torch.Tensor:
    """One token per slot of Gated DeltaNet, ``x [B, 1, hidden]`` -> ``[B, 1, hidden]``; conv and
    recurrent states are updated in place (a decode-only step's layer, ``_decode_layers_fused``)."""
    size = x.shape[0]
    return _linear_attention(gdn, x.reshape(1, size, -1), _Mix([], [], batch, size), index).reshape(size, 1, -1)


FUSED_DTYPES = (torch.bfloat16, torch.float32)
"""The dtypes whose decode steps use the fused Gated DeltaNet kernel (float32 too: the parity tests
pass with it and it agrees with the torch path to float32 rounding, tests/test_fused.py)."""


def _fused_gdn(gdn: qm.Qwen3_5GatedDeltaNet, x: torch.Tensor):
    """The fused decode-step op if it serves this layer and input (a CPU, a dtype of
    ``FUSED_DTYPES``, SiLU conv and gate activations, transformers' gated norm), else None."""
    if x.device.type != "cpu" or x.dtype not in FUSED_DTYPES or not fused.enabled():
        return None
    if gdn.activation not in ("silu", "swish") or type(gdn.norm) is not qm.Qwen3_5RMSNormGated:
        return None
    return fused.ops()


def _gdn_constants(gdn: qm.Qwen3_5GatedDeltaNet) -> tuple[torch.Tensor, ...]:
    """``fused.gdn_constants`` of the layer, computed once and kept on the module (computed again
    if one of its weights is replaced, or changed in place outside inference mode)."""
    params = (gdn.conv1d.weight, gdn.conv1d.bias, gdn.A_log, gdn.dt_bias)
    # an inference tensor (a shard loaded under inference mode) has no version counter, and
    # cannot be changed in place outside inference mode either
    key = tuple(None if p is None else (p.data_ptr(), 0 if p.is_inference() else p._version) for p in params)
    cached = gdn.__dict__.get("_epd_fused_constants")
    if cached is None or cached[0] != key:
        cached = key, fused.gdn_constants(gdn.conv1d.weight[:, 0], *params[1:])
        gdn.__dict__["_epd_fused_constants"] = cached
    return cached[1]


def _chunk_rule(x: torch.Tensor):
    """The chunked gated delta rule for a prefill chunk: on a CPU, in a dtype of
    ``kernels_prefill.GDN_CHUNK_DTYPES``, the fused C++ rule where it is built (and not turned off
    by ``EPD_PREFILL_KERNELS=0``); otherwise the torch path."""
    if x.device.type == "cpu" and x.dtype in kernels_prefill.GDN_CHUNK_DTYPES and kernels_prefill.gdn_chunk_op():
        return kernels_prefill.chunk_gated_delta_rule
    return kernels.chunk_gated_delta_rule


def _gdn_chunk(device: torch.device) -> int:
    """Chunk length of the chunked gated delta rule. Shorter chunks do less intra-chunk work per
    token but run more sequential steps: on a CPU 32 measured fastest for 240-512-token prompts
    (docs/bench/kernels.md); on a GPU the sequential steps are kernel launches, 64 as in FLA."""
    return 64 if device.type == "cuda" else 32
