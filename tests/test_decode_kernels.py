"""Decode's CPU kernels (epd/csrc/decode_ops.cpp via epd.fused.decode_ops): the few-row linear
layer (``kernels.DecodeLinear``) and the fused residual add + RMSNorm (``kernels.add_rms_norm``)
against the torch operations they replace, in float32 and bfloat16 at several row counts; the
merged projections (``lm.merge_projections``); a decode runner built on them against the
unpacked one; and the fallback when the kernels are off or cannot be built.

The kernels are compiled for real (g++ and ninja are on the project's machines; the build is
cached under the user's cache directory, so only the first run of a fresh machine pays ~10 s)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as qm

from decode_svc.batch import DecodeBatch
from epd import fused, kernels, lm, positions
from epd.lm import TextModelRunner
from tests.conftest import needs_compiler

pytestmark = needs_compiler


@pytest.fixture
def ops(fresh_fused):
    if not fused.decode_ops():
        pytest.skip("the decode kernels need AVX2 and FMA, or AVX-512 BF16 (this CPU or build has neither)")


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, inputs: int = 256) -> None:
    """float32: to float32 rounding of a sum of ``inputs`` products in another order (its error
    grows as the square root of their number: 1e-5 at 256, 3.4e-5 at 3,000); bfloat16: one
    rounding of the same float32 sum (a bfloat16 ulp is 2^-8 relative)."""
    if dtype == torch.float32:
        tolerance = 1e-5 * max(1.0, (inputs / 256) ** 0.5)
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 40, 49, 100])
@pytest.mark.parametrize("shape", [(96, 64), (37, 130), (2048, 256)])
def test_decode_linear_matches_f_linear(dtype, rows, shape, ops):
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if out_features == 37 else None
    x = torch.randn(rows, 1, in_features, generator=gen).to(dtype)
    layer = kernels.DecodeLinear(weight, bias)
    out = layer(x)
    assert out.shape == (rows, 1, out_features) and out.dtype == dtype
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(dtype)
    _close(out, want, dtype)
    # strided rows (a column slice of a wider tensor) are read in place, same answer
    wide = torch.cat([x[:, 0], torch.randn(rows, 5).to(dtype)], dim=1)[:, :in_features]
    assert torch.equal(layer(wide), out[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_wide_path_computes_what_the_few_row_kernel_does(dtype, rows, ops):
    """``linear_wide`` (the weight widened a block of panels at a time for the float32 GEMM: what
    ``linear`` runs for many rows on a CPU without AVX-512) against ``linear`` and ``F.linear``,
    with a bias and an output width that is not a whole number of panels, over several blocks
    (3,000 inputs: a block of the widened weight is 4 MiB, 21 panels)."""
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(1000, 3000, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(1000, generator=gen)
    x = torch.randn(rows, 3000, generator=gen).to(dtype)
    packed = torch.ops.epd_decode.pack(weight)
    wide = torch.ops.epd_decode.linear_wide(x, packed, 1000, bias)
    want = F.linear(x.float(), weight.float(), bias).to(dtype)
    _close(wide, want, dtype, inputs=3000)
    _close(wide, torch.ops.epd_decode.linear(x, packed, 1000, bias), dtype, inputs=3000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 67])
def test_packing_chosen_rows_is_packing_their_copy(dtype, width, ops):
    """``pack(W, rows)`` (the greedy screen's gather) is ``pack(W[rows])``: any order, repeats, a
    last partial panel, an odd bfloat16 width (its last pair half empty); a row out of range is
    an error, not a read past the weight."""
    gen = torch.Generator().manual_seed(width)
    weight = torch.randn(300, width, generator=gen).to(dtype)
    rows = torch.tensor([299, 0, 17, 17, 5, *range(100, 130), 298])
    assert torch.equal(torch.ops.epd_decode.pack(weight, rows), torch.ops.epd_decode.pack(weight[rows]))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.epd_decode.pack(weight, torch.tensor([3, 300]))


def test_without_onednn_bfloat16_every_bfloat16_linear_layer_is_packed_for_epds_kernel(tiny_model_dir, ops,
                                                                                        monkeypatch, request):
    """On a CPU where oneDNN has no bfloat16 kernels (AVX2 only: ATen's bfloat16 products run at
    ~20 GFLOP/s there), a bfloat16 runner, decode or not, and the vision tower's layers go to
    ``DecodeLinear``; float32 keeps oneDNN."""
    from epd import checkpoint, kernels_prefill

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    # kernels_prefill.available() is cached per process: what it finds under this pretence must
    # not outlive the test (the prefill operator would stay off for every later test)
    kernels_prefill.available.cache_clear()
    request.addfinalizer(kernels_prefill.available.cache_clear)
    assert kernels.linear_maker(torch.device("cpu"), torch.bfloat16) is kernels.DecodeLinear
    assert kernels.linear_maker(torch.device("cpu"), torch.float32) is kernels.PackedLinear
    monkeypatch.setenv(lm.DECODE_LINEAR_ENV, "0")  # not the few-row choice: the dtype's
    runner = TextModelRunner.load(tiny_model_dir, dtype="bfloat16")
    assert isinstance(runner.lm_head, kernels.DecodeLinear)
    assert not [m for m in runner.model.modules() if type(m) is torch.nn.Linear]
    reference = TextModelRunner.load(tiny_model_dir, dtype="bfloat16", prepack=False)
    ids = torch.randint(3, 200, (60,), generator=torch.Generator().manual_seed(0))  # 60 rows: the wide path
    got, want = (r.logits(r.forward(r.embed(ids), positions.mrope_positions(len(ids), [])[0], r.new_state()))
                 for r in (runner, reference))
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
    vision = checkpoint.build_vision_model(tiny_model_dir, dtype=torch.bfloat16, device="cpu")
    assert kernels.prepack_linears(vision) > 0
    kernels_prefill.use_for_vision(vision)
    assert isinstance(vision.patch_embed.proj.linear, kernels.DecodeLinear)
    assert not [m for m in vision.modules() if type(m) is torch.nn.Linear]


def test_decode_linear_refuses_what_it_does_not_serve(ops):
    assert not kernels.can_decode_pack(torch.zeros(4, 3, dtype=torch.bfloat16))  # odd width in bfloat16
    assert not kernels.can_decode_pack(torch.zeros(4, 4, dtype=torch.float16))
    assert kernels.can_decode_pack(torch.zeros(4, 3))
    layer = kernels.DecodeLinear(torch.zeros(16, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has 6 features, the weight 8"):
        torch.ops.epd_decode.linear(torch.zeros(2, 6, dtype=torch.bfloat16), layer.weight, 16, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_add_rms_norm_matches_the_residual_add_and_the_norm(dtype, rows, ops):
    gen = torch.Generator().manual_seed(rows)
    norm = qm.Qwen3_5RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256, generator=gen) * 0.2)
    norm = norm.to(dtype)
    residual = (torch.randn(rows, 256, generator=gen) * 3).to(dtype)
    x = torch.randn(rows, 256, generator=gen).to(dtype)
    want_sum = residual + x
    want = norm(want_sum)
    got = kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(residual, want_sum)  # the residual stream, exactly torch's add
    _close(got, want, dtype)
    assert torch.equal(kernels.add_rms_norm(None, residual, norm.weight, norm.eps), got)
    assert torch.equal(residual, want_sum)  # without x it is only read


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (8, 2, 256), (10, 2, 48), (3, 3, 16)])
def test_paged_attention_matches_one_request_at_a_time(dtype, heads, kv_heads, dim, ops):
    """Every slot in one call against ``decode_attention`` per slot, over the pool's rows: one run,
    several runs (a fragmented block table), one token; query heads per K/V head from 1 to 5 (the
    kernel takes them four at a time) and head dims that its register blocks do and do not divide."""
    gen = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(300, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    query = torch.randn(4, heads, 1, dim, generator=gen).to(dtype)
    slot_runs = [[(0, 17)], [(32, 64), (100, 101)], [(200, 201)], [(16, 48), (64, 80), (250, 300)]]
    runs = torch.tensor([run for slot in slot_runs for run in slot])
    offsets = torch.tensor([0, 1, 3, 4, 7])
    got = kernels.paged_decode_attention(query, keys, values, runs, offsets, dim**-0.5)
    assert got.shape == query.shape and got.dtype == dtype
    for slot, slot_run in enumerate(slot_runs):
        k, v = (torch.cat([pool[a:b] for a, b in slot_run]) for pool in (keys, values))
        want = kernels.decode_attention(query[slot : slot + 1], k, v, dim**-0.5)
        _close(got[slot : slot + 1], want, dtype)
    # gated (the o_proj input Qwen3.5's attention makes): out * sigmoid(gate), each rounded as torch rounds
    gate = torch.randn(4, heads * 2 * dim, generator=gen).to(dtype)
    gated = kernels.paged_decode_attention(query, keys, values, runs, offsets, dim**-0.5, gate)
    assert gated.shape == (4, heads * dim) and gated.dtype == dtype
    want = got.reshape(4, heads * dim) * torch.sigmoid(gate.view(4, heads, 2, dim)[:, :, 1].reshape(4, heads * dim))
    _close(gated, want, dtype)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.paged_decode_attention(query, keys, values, runs + 300, offsets, 1.0)


def test_merged_linear_gives_each_part(ops):
    gen = torch.Generator().manual_seed(0)
    parts = [torch.nn.Linear(64, n, bias=False) for n in (48, 16, 32)]
    with torch.no_grad():
        for part in parts:
            part.weight.copy_(torch.randn(part.weight.shape, generator=gen))
    x = torch.randn(3, 1, 64, generator=gen)
    for make in (kernels.PackedLinear, kernels.DecodeLinear):
        outs = kernels.MergedLinear(parts, make)(x)
        assert [o.shape[-1] for o in outs] == [48, 16, 32]
        for out, part in zip(outs, parts):
            _close(out, part(x).detach(), torch.float32)


def _decode_logits(runner: TextModelRunner, num_steps: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts' prefill logits and ``num_steps`` batched decode steps' logits, greedy."""
    states, first = [], []
    for seed in range(3):
        ids = torch.randint(3, 200, (7 + 5 * seed,), generator=torch.Generator().manual_seed(seed))
        state = runner.new_state()
        first.append(runner.logits(runner.forward(runner.embed(ids), positions.mrope_positions(len(ids), [])[0],
                                                  state)))
        states.append(state)
    batch = DecodeBatch(runner)
    for state in states:
        batch.add(state)
    tokens, steps = [int(f.argmax()) for f in first], []
    for step in range(num_steps):
        steps.append(runner.decode_step(batch, tokens, [s.num_tokens + step for s in states]))
        tokens = steps[-1].argmax(-1).tolist()
    return torch.stack(first), torch.stack(steps)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_runner_merges_and_uses_the_kernels_and_agrees_with_the_unpacked_one(dtype, tiny_model_dir, ops,
                                                                                      monkeypatch):
    norms = []
    real = kernels.add_rms_norm
    monkeypatch.setattr(kernels, "add_rms_norm", lambda *a: norms.append(1) or real(*a))
    monkeypatch.setenv(lm.DECODE_LINEAR_ENV, "1")
    runner = TextModelRunner.load(tiny_model_dir, dtype=dtype, decode=True)
    dense = TextModelRunner.load(tiny_model_dir, dtype=dtype, prepack=False)
    modules = list(runner.model.modules())
    assert not [m for m in modules if type(m) is torch.nn.Linear]
    assert not [m for m in modules if isinstance(m, kernels.PackedLinear)]
    assert isinstance(runner.lm_head, kernels.DecodeLinear)
    for layer, kind in zip(runner.model.layers, runner.layer_types):
        mixer = layer.linear_attn if kind == "linear_attention" else layer.self_attn
        merged = mixer.in_proj if kind == "linear_attention" else mixer.qkv_proj
        assert isinstance(merged.linear, kernels.DecodeLinear)
        assert len(merged.sizes) == (4 if kind == "linear_attention" else 3)
        assert isinstance(layer.mlp, lm.GatedMLP)
    assert runner.state_shapes(5) == dense.state_shapes(5)
    # the module path's decode steps, whose norms go through kernels.add_rms_norm (the decode plan
    # calls the op itself: test_the_decode_plan_is_the_module_path_bit_for_bit)
    runner.decode_plan = False
    got = _decode_logits(runner)
    # three prompts' prefills (two norms a layer; the final norm is the module's, on the last rows
    # only) and three decode steps (two a layer and the final one)
    calls = 3 * 2 * runner.num_layers + 3 * (2 * runner.num_layers + 1)
    assert len(norms) == calls
    monkeypatch.setenv(fused.ENV, "0")  # the reference: transformers' modules and the torch path
    want = _decode_logits(dense)
    assert len(norms) == calls
    tolerance = 2e-4 if dtype == "float32" else 6e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * float(b.abs().max()))
    assert torch.equal(got[1].argmax(-1), want[1].argmax(-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_attention_step_computes_what_the_torch_path_does(dtype, tiny_model_dir, ops, monkeypatch):
    """One full-attention layer's decode step through the two C++ calls and through the torch ops
    (per-head norms, ``apply_rotary_pos_emb``, the batch's K/V write, SDPA per slot, the gate) on
    the same batch: bfloat16 bit-identical (it rounds where torch rounds), float32 to rounding;
    the K/V written to the pool likewise."""
    runner = TextModelRunner.load(tiny_model_dir, dtype=dtype, decode=True)
    index = runner.layer_types.index("full_attention")
    attn = runner.model.layers[index].self_attn
    states = []
    for seed in range(3):
        ids = torch.randint(3, 200, (9 + 13 * seed,), generator=torch.Generator().manual_seed(seed))
        state = runner.new_state()
        runner.forward(runner.embed(ids), positions.mrope_positions(len(ids), [])[0], state)
        states.append(state)
    x = torch.randn(3, 1, runner.model.config.hidden_size, generator=torch.Generator().manual_seed(5)).to(runner.dtype)
    position_ids = torch.tensor([s.num_tokens for s in states]).view(1, 3, 1).expand(3, 3, 1)
    cos, sin = runner.model.rotary_emb(x, position_ids)
    outs, pools = [], []
    for use in (True, False):
        monkeypatch.setattr(lm, "_fused_attention", lambda *a, _use=use: _use)
        monkeypatch.setattr(kernels, "can_attend_paged", lambda *a, _use=use: _use)
        batch = DecodeBatch(runner)
        for state in states:
            batch.add(state.clone())
        batch.reserve(1)
        with torch.inference_mode():
            outs.append(lm._full_attention_step(attn, x, cos, sin, batch, index))
        rows = batch._rows(batch.tables[2], 0, batch.lengths[2] + 1)
        pools.append((batch.keys[index][rows], batch.values[index][rows]))
    if dtype == "bfloat16":
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])
    else:
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pools[0][0], pools[1][0], rtol=1e-5, atol=1e-5)
        assert torch.equal(pools[0][1], pools[1][1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_plan_is_the_module_path_bit_for_bit(dtype, tiny_model_dir, ops):
    """A decode step's layers as direct kernel calls (``lm._DecodePlan``) against the module path
    (``_decode_layers_fused``) on two copies of one batch, step after step, a request joining
    half way: the final-normed rows, every slot's conv and recurrent state and the K/V pools are
    equal bit for bit."""
    runner = TextModelRunner.load(tiny_model_dir, dtype=dtype, decode=True)
    plan = lm._DecodePlan.build(runner)  # kept for every step, as a served runner keeps it
    assert isinstance(plan, lm._DecodePlan)

    def prompt(seed: int):
        ids = torch.randint(3, 200, (7 + 11 * seed,), generator=torch.Generator().manual_seed(seed))
        state = runner.new_state()
        runner.forward(runner.embed(ids), positions.mrope_positions(len(ids), [])[0], state)
        return state

    states = [prompt(seed) for seed in range(3)]
    batches = [DecodeBatch(runner), DecodeBatch(runner)]
    for batch in batches:
        for state in states:
            batch.add(state.clone())
    tokens = [5, 6, 7]
    for step in range(5):
        if step == 2:  # a request joins both batches
            late = prompt(3)
            for batch in batches:
                batch.add(late.clone())
            tokens.append(8)
        if step == 3:  # a conv weight replaced: the plan's encoded constants are computed again
            gdn = runner.model.layers[runner.layer_types.index("linear_attention")].linear_attn
            gdn.conv1d.weight = torch.nn.Parameter(gdn.conv1d.weight.detach() * 1.5, requires_grad=False)
        places = [int(length) for length in batches[0].lengths]
        got = []
        for use, batch in zip((True, False), batches):
            runner.decode_plan = plan if use else False
            with torch.inference_mode():
                got.append(runner._decode_hidden(batch, tokens, places))
        assert plan.segments, "the plan did not run"  # encoded at its first run
        assert torch.equal(got[0], got[1]), step
        size = len(batches[0])
        for index in range(runner.num_layers):
            if runner.layer_types[index] == "linear_attention":  # the active slots (the rest is spare room)
                assert torch.equal(batches[0].conv[index][:size], batches[1].conv[index][:size])
                assert torch.equal(batches[0].recurrent[index][:size], batches[1].recurrent[index][:size])
            else:
                for slot in range(size):  # the rows each slot's tokens hold
                    rows = [b._rows(b.tables[slot], 0, b.lengths[slot]) for b in batches]
                    assert torch.equal(batches[0].keys[index][rows[0]], batches[1].keys[index][rows[1]])
                    assert torch.equal(batches[0].values[index][rows[0]], batches[1].values[index][rows[1]])
        tokens = kernels.greedy_rows(runner.logits(got[0]))[0].tolist()


def test_the_decode_plan_runs_its_layers_in_a_few_calls_and_names_a_bad_encoding(tiny_model_dir, ops):
    """The plan's layers go to C++ in ``lm.PLAN_CALLS`` calls at most, every layer once in order;
    a weight list that ends early is a clear error, not a crash."""
    runner = TextModelRunner.load(tiny_model_dir, decode=True)
    plan = lm._DecodePlan.build(runner)
    segments = plan._encoded()
    assert 1 < len(segments) <= lm.PLAN_CALLS
    assert [index for layers, *_ in segments for index, _ in layers] == list(range(runner.num_layers))
    layers, weights, ints, reals = segments[0]
    state = runner.new_state()
    runner.forward(runner.embed(torch.arange(3, 8)), positions.mrope_positions(5, [])[0], state)
    batch = DecodeBatch(runner)
    batch.add(state)
    batch.reserve(1)
    hidden = runner.model.config.hidden_size
    buffers = [t for index, kind in layers for t in ((batch.conv[index], batch.recurrent[index])
                                                      if kind == "gdn" else batch.paged(index)[:2])]
    rows = batch.paged(runner.layer_types.index("full_attention"))[2:]
    cos = sin = torch.zeros(1, runner.model.config.head_dim // 4)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="weight list ends early"):
        torch.ops.epd_decode.decode_layers(None, torch.zeros(1, hidden), cos, sin, weights[:-3], ints, reals,
                                           buffers, *rows)


def test_the_decode_plan_steps_aside_where_the_module_path_differs(tiny_model_dir, ops, monkeypatch):
    """No plan for a runner whose layers are not the few-row kernel's (oneDNN's merged
    products), and none for a step with the fused kernels turned off or with autograd on (where
    the module path takes torch's ops)."""
    onednn = TextModelRunner.load(tiny_model_dir, prepack=False)
    onednn.prepack_linears(merge=True)
    assert lm._DecodePlan.build(onednn) is None
    runner = TextModelRunner.load(tiny_model_dir, decode=True)
    plan = lm._DecodePlan.build(runner)
    batch = DecodeBatch(runner)
    hidden = torch.zeros(1, 1, runner.model.config.hidden_size)
    with torch.inference_mode():
        assert plan.serves(batch, hidden)
        monkeypatch.setenv(fused.ENV, "0")
        assert not plan.serves(batch, hidden)
        monkeypatch.delenv(fused.ENV)
    assert not plan.serves(batch, hidden)  # autograd on
    runner.prepack_linears(decode=True)  # new layers: the plan is built again at the next step
    assert runner.decode_plan is None


def test_merged_projections_on_onednn_agree_with_the_unpacked_runner(tiny_model_dir, ops):
    """A prefill runner keeps its projections apart on oneDNN; merged on oneDNN (what a decode
    runner does where the decode kernel is not built) the results are the same to rounding."""
    assert not [m for m in TextModelRunner.load(tiny_model_dir).model.modules() if isinstance(m, kernels.MergedLinear)]
    runner = TextModelRunner.load(tiny_model_dir, prepack=False)
    runner.prepack_linears(merge=True)
    assert not [m for m in runner.model.modules() if isinstance(m, kernels.DecodeLinear)]
    assert isinstance(runner.model.layers[0].mlp.gate_up_proj.linear, kernels.PackedLinear)
    assert isinstance(runner.lm_head, kernels.PackedLinear)
    got, want = _decode_logits(runner, 2), _decode_logits(TextModelRunner.load(tiny_model_dir, prepack=False), 2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4 * float(b.abs().max()))


def test_by_default_a_decode_runner_merges_onto_the_few_row_kernel(tiny_model_dir, ops, monkeypatch):
    monkeypatch.delenv(lm.DECODE_LINEAR_ENV, raising=False)
    runner = TextModelRunner.load(tiny_model_dir, decode=True)
    assert not [m for m in runner.model.modules() if isinstance(m, kernels.PackedLinear)]
    assert isinstance(runner.model.layers[0].mlp.gate_up_proj.linear, kernels.DecodeLinear)
    assert isinstance(runner.lm_head, kernels.DecodeLinear)
    # a prefill runner keeps oneDNN whatever the variable says
    prefill = TextModelRunner.load(tiny_model_dir)
    assert not [m for m in prefill.model.modules() if isinstance(m, kernels.DecodeLinear)]


@pytest.mark.skipif(not kernels.onednn_serves(torch.bfloat16), reason="oneDNN has no bfloat16 kernels on this CPU")
def test_on_a_cpu_with_amx_a_bfloat16_decode_runner_stays_on_onednn(tiny_model_dir, ops, monkeypatch):
    """AMX tiles make oneDNN's bfloat16 product faster than the few-row kernel's registers from 8
    rows up: on such a CPU a bfloat16 decode runner keeps oneDNN unless the kernel's build has its
    own tile path; float32 (no AMX tiles for it) keeps the few-row kernel, and
    ``EPD_DECODE_LINEAR`` still decides when it says 0 or 1."""
    monkeypatch.delenv(lm.DECODE_LINEAR_ENV, raising=False)
    monkeypatch.setattr(kernels, "amx_bf16", lambda: True)
    monkeypatch.setattr(fused, "decode_tiles", lambda: False)  # a build without the tile path
    runner = TextModelRunner.load(tiny_model_dir, dtype="bfloat16", decode=True)
    assert not [m for m in runner.model.modules() if isinstance(m, kernels.DecodeLinear)]
    assert isinstance(runner.model.layers[0].mlp.gate_up_proj.linear, kernels.PackedLinear)
    assert isinstance(runner.lm_head, kernels.PackedLinear)
    monkeypatch.setattr(fused, "decode_tiles", lambda: True)  # with it, the few-row kernel stays
    assert lm.decode_linear_default(torch.bfloat16)
    monkeypatch.setattr(fused, "decode_tiles", lambda: False)
    assert lm.decode_linear_default(torch.float32)
    monkeypatch.setenv(lm.DECODE_LINEAR_ENV, "1")
    assert lm.decode_linear_default(torch.bfloat16)
    monkeypatch.setattr(kernels, "amx_bf16", lambda: False)
    monkeypatch.delenv(lm.DECODE_LINEAR_ENV)
    assert lm.decode_linear_default(torch.bfloat16)
    monkeypatch.setenv(lm.DECODE_LINEAR_ENV, "0")
    assert not lm.decode_linear_default(torch.float32)


def test_amx_is_what_the_cpu_says():
    """``kernels.amx_bf16`` agrees with the kernel's CPU flags (where oneDNN serves bfloat16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags here")
    assert kernels.amx_bf16() == ("amx_bf16" in flags and "amx_tile" in flags
                                  and kernels.onednn_serves(torch.bfloat16))


def test_epd_decode_linear_0_puts_a_decode_runner_back_on_onednn(tiny_model_dir, ops, monkeypatch):
    monkeypatch.setenv(lm.DECODE_LINEAR_ENV, "0")
    runner = TextModelRunner.load(tiny_model_dir, decode=True)
    assert not [m for m in runner.model.modules() if isinstance(m, kernels.DecodeLinear)]
    assert isinstance(runner.model.layers[0].mlp.gate_up_proj.linear, kernels.PackedLinear)
    assert isinstance(runner.lm_head, kernels.PackedLinear)


def test_turned_off_a_decode_runner_keeps_onednn_and_the_torch_norms(tiny_model_dir, fresh_fused, monkeypatch):
    monkeypatch.setenv(fused.ENV, "0")
    monkeypatch.setenv(lm.DECODE_LINEAR_ENV, "1")
    calls = []
    monkeypatch.setattr(kernels, "add_rms_norm", lambda *a: calls.append(1))
    runner = TextModelRunner.load(tiny_model_dir, decode=True)
    assert not [m for m in runner.model.modules() if isinstance(m, kernels.DecodeLinear)]
    assert isinstance(runner.lm_head, kernels.PackedLinear)
    _decode_logits(runner, 1)
    assert calls == []


def test_a_failed_build_logs_one_warning_and_onednn_stays(tiny_model_dir, fresh_fused, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("decode_ops.cpp:1:1: error: this compiler compiles nothing")

    monkeypatch.setattr(fused, "compile_library", broken)
    monkeypatch.setenv(lm.DECODE_LINEAR_ENV, "1")
    monkeypatch.setattr(fused, "_state", {})  # as in a fresh process: nothing loaded yet
    with caplog.at_level(logging.WARNING, logger="epd.fused"):
        runner = TextModelRunner.load(tiny_model_dir, decode=True)
        assert not fused.decode_ops()
    warnings = [r for r in caplog.records if "decode CPU kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "compiles nothing" in warnings[0].getMessage()
    assert isinstance(runner.lm_head, kernels.PackedLinear)
    _decode_logits(runner, 1)


@pytest.mark.parametrize("vocab", [1, 7, 16, 37, 248320])
def test_greedy_rows_is_the_first_maximum_and_the_finite_check(vocab, ops):
    """One pass over a step's logits: torch.argmax's index (the first of equal maxima) for every
    finite row, and a row with a NaN or an infinity anywhere (in the vectorized part or the tail)
    reported not finite."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen) * 5
    logits[1] = logits[1].round()  # many ties: the first of them is the answer
    logits[2] = -float("inf")  # all -inf: index 0, as torch.argmax, and not finite
    logits[3, vocab // 2] = float("nan")
    logits[4, -1] = float("inf")  # in the tail when vocab is not a multiple of the vector
    logits[5, 0] = -float("inf")
    if vocab > 1:
        logits[6, vocab - 1] = logits[6].max() + 1  # the maximum in the last column
        logits[7, 1:] = logits[7, 0]  # a row of one value: index 0
    index, finite = kernels.greedy_rows(logits)
    want_finite = torch.isfinite(logits).all(dim=-1)
    assert finite.tolist() == want_finite.tolist()
    want = logits.argmax(dim=-1)
    assert index[want_finite].tolist() == want[want_finite].tolist()
    assert index[2].item() == 0
    # a view with strided rows (the step's logits may be a slice of a wider buffer)
    wide = torch.randn(3, vocab + 5, generator=gen)
    index, finite = kernels.greedy_rows(wide[:, :vocab])
    assert index.tolist() == wide[:, :vocab].argmax(dim=-1).tolist() and finite.all()


@pytest.mark.parametrize("rows", [5, 16, 17, 33, 600])
def test_the_amx_tile_paths_match_f_linear(rows, ops):
    """On a CPU with AMX the few-row kernel multiplies bfloat16 of 5 rows or more on the tiles:
    one tile of rows over four panels (5-16 rows), or 32 rows x 2 panels in tasks of 512 rows x 8
    panels, the last block's rows from a zero-padded copy (17 rows and more). Rows strided as a
    merged projection's views are, a width that is not a multiple of 16 columns, a bias; ``tiles``
    says whether this build runs them (EPD_DECODE_AMX=0, or no AMX: the register path)."""
    if not torch.ops.epd_decode.tiles():
        pytest.skip("no AMX tiles in this build or process")
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(150, 96, generator=gen) * 0.1).to(torch.bfloat16)  # 10 panels, 3 k steps of 32
    bias = torch.randn(150, generator=gen)
    wide = torch.randn(rows, 130, generator=gen).to(torch.bfloat16)
    x = wide[:, 7:103]  # rows 130 apart, each contiguous
    for layer, b in ((kernels.DecodeLinear(weight), None), (kernels.DecodeLinear(weight, bias), bias)):
        want = F.linear(x.float(), weight.float(), b)
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 150)
        _close(got, want, torch.bfloat16, inputs=96)
        assert torch.equal(layer.forward_float(x), got.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 37])
def test_decode_linear_float_output_is_the_product_then_float(dtype, rows, ops):
    """The LM head's one-pass float32 output: exactly ``layer(x).float()`` (the product rounded to
    the layer's dtype, then widened), for row counts across the kernel's blocks, a width that is
    not a multiple of its 16-column panels, and a bias."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(101, 64, generator=gen).to(dtype)
    bias = torch.randn(101, generator=gen).to(dtype)
    x = torch.randn(rows, 1, 64, generator=gen).to(dtype)
    for layer in (kernels.DecodeLinear(weight), kernels.DecodeLinear(weight, bias)):
        got = layer.forward_float(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 1, 101)
        assert torch.equal(got, layer(x).float())


@pytest.fixture
def screens(ops):
    if not fused.decode_screens():
        pytest.skip("the greedy screen needs AMX-INT8 or AVX-512 VNNI (this CPU or build has neither)")


def _full_argmax(head: kernels.DecodeLinear, x: torch.Tensor) -> torch.Tensor:
    return kernels.greedy_rows(head.forward_float(x))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 5, 16, 17, 33])
@pytest.mark.parametrize("shape", [(4099, 96), (20000, 1024)])
def test_the_greedy_screen_is_the_full_heads_first_maximum(dtype, rows, shape, screens):
    """kernels.GreedyScreen against the whole head's logits (the same kernel, greedy_rows' first
    maximum): equal indices for every row, with exact ties in the head (duplicated rows that are
    a row's maximum: the first one must win), an outlier feature, a vocabulary that is not whole
    panels and a width that is not whole int8 tile steps. Its exact product of the columns left
    is bit for bit the head's."""
    vocab, width = shape
    gen = torch.Generator().manual_seed(rows * 31 + vocab)
    weight = torch.randn(vocab, width, generator=gen) * 0.02
    # near duplicates of column 11, closer to it than the int8 copy can tell apart: which is the
    # largest only the exact product knows (a screen that dropped on its estimate alone fails)
    near = torch.arange(40, 40 + 60 * 7, 7)
    weight[near] = weight[11] + torch.randn(len(near), width, generator=gen) * 2e-4
    weight[vocab - 3] = weight[11]  # exact duplicates: their logits tie in every row
    weight[vocab // 2] = weight[11]
    weight = weight.to(dtype)
    head = kernels.DecodeLinear(weight)
    screen = kernels.GreedyScreen(head, weight)
    x = torch.randn(rows, width, generator=gen) * 3
    x[1 % rows] = weight[11].float() * 30 + x[1 % rows]  # near ties with some noise
    x[0] = weight[11].float() * 500  # row 0's maximum: column 11, its two copies or a near one
    if rows > 2:
        x[2, 5] *= 40  # an outlier feature
    x = x.to(dtype)
    got = screen.argmax(x)
    assert got is not None and screen.screened == 1 and screen.full == 0
    index, finite = got
    assert index.tolist() == _full_argmax(head, x).tolist() and finite.all()
    assert index[0].item() in [11, *near.tolist()]
    columns = screen.columns(x)
    assert 0 < columns.numel() < vocab // 4 and bool((columns[1:] > columns[:-1]).all())
    if screen.tiles:  # the exact product over the columns' whole panels
        panels, width = screen.panels(columns)
        assert bool((panels[1:] > panels[:-1]).all()) and set((columns // 16).tolist()) == set(panels.tolist())
        held = (panels[:, None] * 16 + torch.arange(16)).flatten()[:width]
        exact = torch.ops.epd_decode.linear_float(x, head.weight.index_select(0, panels), width, None)
    else:  # ... over the columns alone, gathered from the head's rows
        held = columns
        exact = torch.ops.epd_decode.linear_float(x, screen.gathered(columns), columns.numel(), None)
    assert torch.equal(exact, head.forward_float(x)[:, held])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_greedy_screen_reads_the_last_partial_panel_without_its_padding(dtype, screens):
    """Every logit below zero and the maximum in the head's last panel, which holds 3 columns of
    16: the screen multiplies that whole panel, and its 13 padding columns (zeros) must not
    count as logits of 0 (they would win)."""
    gen = torch.Generator().manual_seed(5)
    vocab, width = 4099, 64
    weight = -(torch.rand(vocab, width, generator=gen) + 0.5)
    weight[vocab - 2] = -0.01
    weight = weight.to(dtype)
    head = kernels.DecodeLinear(weight)
    screen = kernels.GreedyScreen(head, weight)
    x = (torch.rand(4, width, generator=gen) + 0.1).to(dtype)
    assert bool((head.forward_float(x) < 0).all())
    got = screen.argmax(x)
    assert got is not None and got[0].tolist() == [vocab - 2] * 4 == _full_argmax(head, x).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_greedy_screen_steps_aside_where_it_cannot_decide(dtype, screens):
    """A row with no clear maximum (all zeros: every logit 0, too many columns left) or a row that
    is not finite: the screen answers None and the caller multiplies the whole head, whose
    greedy_rows reports the row not finite; TextModelRunner.greedy does exactly that."""
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(9000, 64, generator=gen) * 0.02).to(dtype)
    head = kernels.DecodeLinear(weight)
    screen = kernels.GreedyScreen(head, weight)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    assert screen.argmax(x) is not None
    zero = x.clone()
    zero[1] = 0
    assert screen.argmax(zero) is None
    bad = x.clone()
    bad[2, 7] = float("nan")
    assert screen.argmax(bad) is None and screen.full == 2
    # rows so small that their int8 scale would be subnormal: no levels, and still a right answer
    tiny = x.clone()
    tiny[0] = torch.full((64,), 1e-39).to(dtype)
    tiny[0, 3] = 3e-39
    got = screen.argmax(tiny)
    assert got is None or got[0].tolist() == _full_argmax(head, tiny).tolist()
    with pytest.raises(ValueError, match="not the head's"):
        kernels.GreedyScreen(head, weight[:100])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_runner_screens_greedy_rows(dtype, tiny_model_dir, screens, monkeypatch):
    """A decode runner (prepack_linears(decode=True)) has the screen, and decode_step_greedy gives
    the tokens decode_step's logits give, step after step; EPD_GREEDY_SCREEN=0 turns it off."""
    runner = TextModelRunner.load(tiny_model_dir, dtype=dtype, decode=True)
    assert runner.greedy_screen is not None
    twin = TextModelRunner.load(tiny_model_dir, dtype=dtype, decode=True)
    vocab = runner.lm_head_weight.shape[0]
    batches, tokens = [], []
    for r in (runner, twin):
        batch = DecodeBatch(r)
        for slot in range(5):
            ids = torch.randint(0, vocab, (9 + slot,), generator=torch.Generator().manual_seed(slot))
            pos, _ = positions.mrope_positions(len(ids), [])
            state = r.new_state()
            r.forward(r.embed(ids), pos, state)
            batch.add(state)
        batches.append(batch)
    tokens = [7, 8, 9, 10, 11]
    for step in range(6):
        places = [9 + slot + step for slot in range(5)]
        index, finite = runner.decode_step_greedy(batches[0], tokens, places)
        logits = twin.decode_step(batches[1], tokens, places)
        assert index.tolist() == logits.argmax(-1).tolist() and finite.all()
        tokens = index.tolist()
    assert runner.greedy_screen.screened == 6
    monkeypatch.setenv("EPD_GREEDY_SCREEN", "0")
    assert TextModelRunner.load(tiny_model_dir, dtype=dtype, decode=True).greedy_screen is None
