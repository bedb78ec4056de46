"""epd/kernels_prefill.py: the oneDNN operator builds here, its float32 products match
torch.matmul on the shapes and strides the Gated DeltaNet chunk kernel gives it (bit for bit at
the 0.8b's), the fused chunked gated delta rule matches the torch path, the vision
attention matches transformers' SDPA, and a failed build or a switch falls back to torch."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from epd import checkpoint, kernels, kernels_prefill

needs_operator = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="torch's mkldnn_matmul needs AVX-512 or AVX-NE-CONVERT on this CPU (whatever the dtype)")


@pytest.fixture
def fresh(monkeypatch):
    """``available()`` and ``gdn_chunk_op()`` recomputed for this test and for the ones after it."""
    kernels_prefill.available.cache_clear()
    kernels_prefill.gdn_chunk_op.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    kernels_prefill.available.cache_clear()
    kernels_prefill.gdn_chunk_op.cache_clear()


@needs_operator
def test_the_operator_builds_and_loads_on_this_machine():
    # CI's image has g++ and ninja: a build failure here would silently cost the speed-up
    assert kernels_prefill.available()
    assert kernels_prefill.cache_dir().is_dir()


def _chunked(seed=0, heads=4, chunks=3, chunk=8, dim=16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, chunks, chunk, dim, generator=gen) for _ in range(3)], gen


@pytest.mark.parametrize("dims", [(4, 8, 16), (16, 32, 128)])  # tiny; the 0.8b's (heads, chunk, head dim)
@torch.inference_mode()
def test_products_match_torch_on_the_chunk_kernels_views(dims):
    heads, chunk, dim = dims
    (query, key, value), gen = _chunked(heads=heads, chunk=chunk, dim=dim)
    key_t = key.transpose(-1, -2)
    state = torch.randn(1, heads, dim, dim, generator=gen)
    cases = [(key, key_t), (query, key_t), (key_t[:, :, 1], value[:, :, 1]), (query[:, :, 2], state),
             (key.transpose(-1, -2).contiguous().transpose(-1, -2)[:, :, 0], state)]
    results = []
    for a, b in cases:
        ours = kernels_prefill.matmul(a, b)
        assert ours.is_contiguous()
        results.append((ours, a @ b))
    for alpha in (1.0, -1.0):
        base = value[:, :, 0].contiguous()
        expected = base.clone().add_(query[:, :, 0] @ state, alpha=alpha)
        results.append((kernels_prefill.addmm_(base, query[:, :, 0], state, alpha=alpha), expected))
    for ours, expected in results:
        if dims == (16, 32, 128):  # measured bit-identical at the 0.8b's shapes (MKL and oneDNN sum alike)
            assert torch.equal(ours, expected)
        else:  # a K of 16 sums in another order: float32 rounding
            torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-5)


@torch.inference_mode()
def test_other_dtypes_and_shapes_go_to_torch():
    a, b = torch.randn(3, 5, 7).bfloat16(), torch.randn(3, 7, 2).bfloat16()
    assert torch.equal(kernels_prefill.matmul(a, b), a @ b)
    a2, b2 = torch.randn(5, 7), torch.randn(7, 2)  # 2-D: not a batched product
    assert torch.equal(kernels_prefill.matmul(a2, b2), a2 @ b2)


@needs_operator
def test_chunk_rule_is_the_same_with_and_without_the_operator(fresh):
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 70, 2, 32, generator=gen), torch.randn(1, 70, 2, 32, generator=gen)
    v = torch.randn(1, 70, 4, 32, generator=gen)
    g, beta = -torch.rand(1, 70, 4, generator=gen), torch.rand(1, 70, 4, generator=gen)
    state = torch.randn(1, 4, 32, 32, generator=gen)

    def run():
        with torch.inference_mode():
            return kernels.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=32, initial_state=state,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert kernels_prefill.available()
    with_operator = run()
    fresh.setenv("EPD_PREFILL_KERNELS", "0")
    kernels_prefill.available.cache_clear()
    assert not kernels_prefill.available()
    without = run()
    for a, b in zip(with_operator, without):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)


@needs_operator  # elsewhere nothing is built: the CPU check answers first
def test_a_failed_build_warns_once_and_falls_back(fresh, tmp_path, caplog):
    bad = tmp_path / "bad.cpp"
    bad.write_text("#error this operator does not compile\n")
    fresh.setattr(kernels_prefill, "_SOURCE", bad)
    fresh.setattr(kernels_prefill, "_NAME", "epd_prefill_broken_test")
    fresh.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="epd.kernels_prefill"):
        assert not kernels_prefill.available()
        assert not kernels_prefill.available()
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "torch.matmul" in warnings[0].getMessage()
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    with torch.inference_mode():
        assert torch.equal(kernels_prefill.matmul(a, b), a @ b)


@needs_operator  # elsewhere it hands every call to transformers' SDPA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [False, True])
@torch.inference_mode()
def test_vision_attention_matches_sdpa(dtype, blocks, monkeypatch):
    if blocks:  # several blocks of query rows per head, the last one short
        monkeypatch.setattr(kernels_prefill, "_SCORE_ELEMENTS", 37 * 50)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(50, 3, 3, 16, generator=gen).to(dtype).permute(1, 0, 2, 3)  # as the vision block splits it
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in qkv.unbind(0))
    ours, weights = kernels_prefill.vision_attention(None, query, key, value, None, scaling=0.25)
    expected = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), scale=0.25)
    assert weights is None and ours.dtype == dtype and ours.shape == (1, 50, 3, 16)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), expected.transpose(1, 2), rtol=0, atol=tolerance)


@pytest.mark.parametrize("length", [1, 15, 50, 301])
@pytest.mark.parametrize("dim", [16, 64, 80])
@torch.inference_mode()
def test_the_bfloat16_attention_kernel_is_sdpa_within_bfloat16s_rounding(length, dim):
    """``epd_gdn_chunk.vision_attention`` (AVX-512 BF16) against float32 attention on the same
    bfloat16 inputs: within what torch's own fused bfloat16 kernel is (it rounds the softmax's
    weights to bfloat16 too), for lengths that are not whole panels of keys or blocks of rows,
    head widths of one, four and five panels, strided views as the vision block gives them; and
    constant values come back exactly (the weights are divided by their own sum)."""
    op = kernels_prefill._bf16_attention_op()
    if op is None:
        pytest.skip("needs AVX-512 BF16 and the prefill kernels")
    gen = torch.Generator().manual_seed(length + dim)
    heads = 3
    qkv = torch.randn(length, 3, heads, dim, generator=gen).bfloat16().permute(1, 0, 2, 3) * 2
    query, key, value = (t.transpose(0, 1) for t in qkv.unbind(0))  # [heads, L, dim], strided
    got = op(query, key, value, dim ** -0.5)
    assert got.shape == (length, heads, dim) and got.dtype == torch.bfloat16
    exact = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), scale=dim ** -0.5).transpose(0, 1)
    torch_bf16 = F.scaled_dot_product_attention(query, key, value, scale=dim ** -0.5).transpose(0, 1)
    ours, theirs = (got.float() - exact).abs().max().item(), (torch_bf16.float() - exact).abs().max().item()
    assert ours <= 2 * theirs + 1e-2, (ours, theirs)
    constant = torch.full_like(value, 0.3).bfloat16()
    assert torch.equal(op(query, key, constant, 0.1), constant.transpose(0, 1).contiguous())
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(query[..., :8].contiguous(), key[..., :8].contiguous(), value[..., :8].contiguous(), 1.0)


@needs_operator
@torch.inference_mode()
def test_a_head_width_the_kernel_does_not_take_goes_the_float32_way():
    """A vision tower whose heads are 72 wide (the 9B's: 1,152 / 16) in bfloat16: the attention
    function does not hand it to the kernel (whole 16-lane panels only) and answers as SDPA."""
    gen = torch.Generator().manual_seed(72)
    query, key, value = (torch.randn(1, 2, 40, 72, generator=gen).bfloat16() for _ in range(3))
    ours, _ = kernels_prefill.vision_attention(None, query, key, value, None, scaling=72 ** -0.5)
    expected = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), scale=72 ** -0.5)
    torch.testing.assert_close(ours.float(), expected.transpose(1, 2), rtol=0, atol=1e-2)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_vision_tower_with_it_matches_sdpa(tiny_model_dir, dtype, amx, monkeypatch):
    """bfloat16 takes ``vision_attention`` where the operator is built, except on a CPU with AMX,
    whose tiles run SDPA's own fused kernel faster (as if this CPU had them or not)."""
    monkeypatch.setattr(kernels, "amx_bf16", lambda: amx)
    vision = checkpoint.build_vision_model(tiny_model_dir, dtype=dtype)
    grid = torch.tensor([[1, 4, 4], [1, 4, 8]])  # two images: attention stays within each
    pixels = torch.randn(48, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = vision(pixels, grid_thw=grid).pooler_output
    attention = vision.config._attn_implementation
    # float32 (the exactness mode) keeps transformers' SDPA; the patch embedding is a GEMM in both
    ours = dtype != torch.float32 and kernels_prefill.available() and not amx  # without the operator SDPA stays
    assert kernels_prefill.use_for_vision(vision) == ours
    assert vision.config._attn_implementation == (kernels_prefill.ATTENTION if ours else attention)
    assert isinstance(vision.patch_embed.proj, kernels_prefill.PatchProjection)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(vision(pixels, grid_thw=grid).pooler_output, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_patch_projection_is_the_convolution(tiny_model_dir, dtype):
    conv = checkpoint.build_vision_model(tiny_model_dir, dtype=dtype).patch_embed.proj
    pixels = torch.randn(10, *conv.weight.shape[1:], generator=torch.Generator().manual_seed(3)).to(dtype)
    ours = kernels_prefill.PatchProjection(conv)(pixels)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), conv(pixels).float(), rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="kernel is its stride"):
        kernels_prefill.PatchProjection(torch.nn.Conv3d(3, 4, kernel_size=2, stride=1))


def test_the_benchmarks_run_and_report(tiny_model_dir, capsys):
    import json
    from pathlib import Path

    from bench import gdn_chunk, prefill_ab, prefill_profile

    gdn_chunk.main(["--length", "40", "--heads", "2", "--dim", "16", "--rounds", "1", "--calls", "1"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["ms"]) == {"bfloat16", "float32"} and all(r["ratio"] > 0 for r in report["ms"].values())

    prefill_profile.main([tiny_model_dir, "--dtypes", "float32", "--cases", "prefill1,vision1", "--repeats", "1"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["case"] for r in report["results"]] == ["prefill1", "vision1"]
    assert all(r["cpu_s"] > 0 for r in report["results"])
    prefill_ab.main([tiny_model_dir, "--before", str(Path(__file__).resolve().parent.parent), "--rounds", "1"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for case in ("prefill", "vision"):
        assert len(report[case]["before_s"]) == len(report[case]["after_s"]) == 1 and report[case]["ratio_of_bests"] > 0


# ---------------------------------------------------------------- the fused chunked gated delta rule


def _gdn_case(length, k_heads, v_heads, dim, dtype, seed=0):
    """q/k/v as the runner gives them (strided views of one conv output row), g, beta, a state."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(1, length, (2 * k_heads + v_heads) * dim, generator=gen).to(dtype)
    query, key, value = torch.split(mixed, [k_heads * dim, k_heads * dim, v_heads * dim], dim=-1)
    query, key = query.reshape(1, length, k_heads, dim), key.reshape(1, length, k_heads, dim)
    value = value.reshape(1, length, v_heads, dim)
    g = -torch.rand(1, length, v_heads, generator=gen) * 0.7
    beta = torch.rand(1, length, v_heads, generator=gen).to(dtype)
    state = torch.randn(1, v_heads, dim, dim, generator=gen) * 0.1
    return query, key, value, g, beta, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length,k_heads,v_heads,dim", [(1, 2, 4, 16), (45, 2, 4, 32), (70, 4, 4, 24),
                                                          (247, 16, 16, 128)])  # the last: the 0.8b's layer
@pytest.mark.parametrize("with_state", [False, True])
@torch.inference_mode()
def test_fused_chunk_rule_matches_the_torch_path(dtype, length, k_heads, v_heads, dim, with_state):
    assert kernels_prefill.gdn_chunk_op() is not None  # CI's image builds it: a failure would cost the speed-up
    query, key, value, g, beta, state = _gdn_case(length, k_heads, v_heads, dim, dtype)
    initial = state.transpose(-1, -2).contiguous().transpose(-1, -2) if with_state else None  # any strides
    before = state.clone()
    kwargs = dict(chunk_size=32, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours, ours_state = kernels_prefill.chunk_gated_delta_rule(query, key, value, g, beta, **kwargs)
    expected, expected_state = kernels.chunk_gated_delta_rule(query, key, value, g, beta, **kwargs)
    assert ours.dtype == dtype and ours.shape == expected.shape and (initial is None or torch.equal(initial, before))
    # float32: the order of float32 sums; bfloat16: the output's rounding (the state stays float32)
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), expected.float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(ours_state, expected_state, rtol=1e-5, atol=2e-6)


@torch.inference_mode()
def test_fused_chunk_rule_continues_across_calls_and_without_l2norm():
    query, key, value, g, beta, _ = _gdn_case(80, 2, 4, 32, torch.float32, seed=5)
    whole, whole_state = kernels_prefill.chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=32,
                                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    first, state = kernels_prefill.chunk_gated_delta_rule(query[:, :50], key[:, :50], value[:, :50], g[:, :50],
                                                          beta[:, :50], chunk_size=32, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)
    second, state = kernels_prefill.chunk_gated_delta_rule(query[:, 50:], key[:, 50:], value[:, 50:], g[:, 50:],
                                                           beta[:, 50:], chunk_size=32, initial_state=state,
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, whole_state, rtol=1e-5, atol=1e-5)
    unnormed = [t * 0.2 for t in (query, key)]
    ours, none = kernels_prefill.chunk_gated_delta_rule(*unnormed, value, g, beta, chunk_size=16)
    expected, _ = kernels.chunk_gated_delta_rule(*unnormed, value, g, beta, chunk_size=16)
    assert none is None
    torch.testing.assert_close(ours, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_decay_strong_enough_for_subnormals_matches_and_leaves_the_threads_float_mode_alone(dtype):
    """Decays of e^-6 a token make e^cum subnormal within a 64-token chunk, which the fused rule
    flushes to zero (the CPU's FTZ/DAZ modes while it runs): the results still match the torch
    path, and the calling thread keeps subnormal arithmetic afterwards (its mode restored)."""
    query, key, value, _, beta, state = _gdn_case(130, 2, 4, 32, dtype, seed=7)
    g = torch.full((1, 130, 4), -6.0)
    kwargs = dict(chunk_size=64, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours, ours_state = kernels_prefill.chunk_gated_delta_rule(query, key, value, g, beta, **kwargs)
    expected, expected_state = kernels.chunk_gated_delta_rule(query, key, value, g, beta, **kwargs)
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.float(), expected.float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(ours_state, expected_state, rtol=1e-5, atol=2e-6)
    tiny = torch.tensor([1e-39])  # subnormal in float32
    assert float(tiny * 0.5) > 0 and float(tiny + 0.0) == pytest.approx(1e-39, rel=1e-3)


def test_the_fused_rule_refuses_inputs_it_does_not_serve():
    query, key, value, g, beta, state = _gdn_case(8, 2, 4, 16, torch.float32)
    op = kernels_prefill.gdn_chunk_op()
    with pytest.raises(RuntimeError, match="state must be float32"):
        op(query, key, value, g, beta, state.double(), 8, True)
    with pytest.raises(RuntimeError, match="multiple of key heads"):
        op(query[:, :, :1].expand(1, 8, 3, 16), key[:, :, :1].expand(1, 8, 3, 16), value, g, beta, state, 8, True)
    with torch.inference_mode():  # float16 is not the op's: the torch path runs
        half = [t.half() for t in (query, key, value)]
        out, _ = kernels_prefill.chunk_gated_delta_rule(*half, g, beta.half(), chunk_size=8)
        assert out.dtype == torch.float16


def test_the_runner_prefills_through_the_fused_rule_and_agrees_with_the_torch_path(tiny_model_dir, fresh):
    from epd import lm, positions

    runner = lm.TextModelRunner.load(tiny_model_dir)
    calls = []
    fused_rule = kernels_prefill.chunk_gated_delta_rule
    fresh.setattr(kernels_prefill, "chunk_gated_delta_rule", lambda *a, **k: calls.append(1) or fused_rule(*a, **k))
    embeds = runner.embed(torch.arange(70) % runner.vocab_size)
    pos, _ = positions.mrope_positions(70, [])
    ours = runner.forward(embeds, pos, runner.new_state())
    assert calls
    fresh.setenv("EPD_PREFILL_KERNELS", "0")
    kernels_prefill.gdn_chunk_op.cache_clear()
    calls.clear()
    expected = runner.forward(embeds, pos, runner.new_state())
    assert not calls
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_vision_mlps_gelu_rides_in_the_packed_first_layer(tiny_model_dir, dtype, fresh):
    if not kernels.onednn_serves(dtype):
        pytest.skip(f"oneDNN has no {dtype} kernels on this CPU (its layers are epd's, which take no post-op)")
    towers = []
    for switch in ("1", "0"):
        fresh.setenv("EPD_PREFILL_KERNELS", switch)
        vision = checkpoint.build_vision_model(tiny_model_dir, dtype=dtype)
        kernels.prepack_linears(vision)
        assert kernels_prefill.fuse_mlp_activations(vision) == (len(vision.blocks) if switch == "1" else 0)
        towers.append(vision)
    fused_mlp = towers[0].blocks[0].mlp
    assert isinstance(fused_mlp.linear_fc1, kernels_prefill.PackedLinearGelu)
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(4)).to(dtype)
    ours, plain = (tower(pixels, grid_thw=grid).pooler_output.float() for tower in towers)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours, plain, rtol=tolerance, atol=tolerance)


def _conv_case(channels, length, dtype, seed, with_window=True):
    gen = torch.Generator().manual_seed(seed)
    # the input projection's layout: time-major rows inside a wider product, viewed [1, C, T]
    rows = torch.randn(1, length, channels + 8, generator=gen)[..., :channels].to(dtype)
    weight = torch.randn(channels, 4, generator=gen) * 0.5
    bias = torch.randn(channels, generator=gen)
    window = torch.randn(1, channels, 4, generator=gen).to(dtype) if with_window else None
    return rows.transpose(1, 2), weight, bias, window


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels,length", [(96, 1), (96, 2), (96, 3), (40, 37), (6144, 65)])
@pytest.mark.parametrize("with_window", [False, True])
@torch.inference_mode()
def test_the_fused_conv_matches_the_torch_path(dtype, channels, length, with_window):
    if kernels_prefill.gdn_chunk_op() is None:
        pytest.skip("the fused prefill kernels are not built here")
    x, weight, bias, window = _conv_case(channels, length, dtype, seed=length + channels, with_window=with_window)
    kept = None if window is None else window.clone()
    for b in (bias, None):
        out, new_window = kernels_prefill.causal_conv1d(x, weight, b, "silu", window=window)
        want, want_window = kernels.causal_conv1d(x, weight, b, "silu", window=window)
        assert out.shape == want.shape and out.stride() == want.stride() and out.dtype == dtype
        assert torch.equal(new_window, want_window)  # the last K inputs, copied: exact
        if dtype == torch.float32:
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        else:  # the same float32 sums; SiLU's exp may move a value across a bfloat16 rounding boundary
            assert (out != want).float().mean() < 1e-3
            torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
    if window is not None:
        assert torch.equal(window, kept), "the caller's window must not be written"
    plain, _ = kernels_prefill.causal_conv1d(x, weight, bias, None, window=window)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(plain.float(), kernels.causal_conv1d(x, weight, bias, None, window=window)[0].float(),
                               rtol=tolerance, atol=tolerance)


@torch.inference_mode()
def test_the_fused_conv_continues_across_chunks():
    if kernels_prefill.gdn_chunk_op() is None:
        pytest.skip("the fused prefill kernels are not built here")
    x, weight, bias, _ = _conv_case(64, 70, torch.float32, seed=3, with_window=False)
    whole, whole_window = kernels_prefill.causal_conv1d(x, weight, bias, "silu")
    first, window = kernels_prefill.causal_conv1d(x[..., :2], weight, bias, "silu")
    second, window = kernels_prefill.causal_conv1d(x[..., 2:], weight, bias, "silu", window=window)
    torch.testing.assert_close(torch.cat([first, second], dim=-1), whole, rtol=0, atol=0)
    assert torch.equal(window, whole_window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,heads", [(128, 16), (24, 3)])
@torch.inference_mode()
def test_the_fused_gated_norm_matches_transformers(dtype, dim, heads):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qm

    if kernels_prefill.gdn_chunk_op() is None:
        pytest.skip("the fused prefill kernels are not built here")
    gen = torch.Generator().manual_seed(dim)
    norm = qm.Qwen3_5RMSNormGated(dim, eps=1e-6)
    norm.weight.copy_(1 + torch.randn(dim, generator=gen) * 0.2)
    norm = norm.to(dtype)
    core = (torch.randn(53, heads * dim, generator=gen) * 2).to(dtype)
    z = torch.randn(53, heads * dim + 16, generator=gen).to(dtype)[:, :heads * dim]  # strided rows
    got = kernels_prefill.gated_rms_norm(norm, core, z)
    want = norm(core.reshape(-1, dim), z.reshape(-1, dim)).reshape(53, -1)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert (got != want).float().mean() < 1e-3
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 3584), (37, 3584), (5, 40)])
@torch.inference_mode()
def test_silu_mul_matches_the_two_torch_ops(dtype, rows, width):
    from epd import fused

    if not fused.decode_ops():
        pytest.skip("the C++ decode kernels are not built here")
    gen = torch.Generator().manual_seed(rows)
    gate, up = (torch.randn(1, rows, 2 * width, generator=gen) * 3).to(dtype).split(width, dim=-1)
    got = kernels.silu_mul(gate, up)
    want = F.silu(gate) * up
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # SiLU rounded to bfloat16, then the product rounded: torch's two roundings
        assert (got != want).float().mean() < 1e-3
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_the_vision_rotary_kernel_gives_transformers_tower_output_bit_for_bit(tiny_model_dir, dtype, fresh):
    grid = torch.tensor([[1, 4, 4], [1, 2, 6]])  # two images: attention runs once per image
    pixels = torch.randn(28, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(5)).to(dtype)
    outputs = []
    for switch in ("1", "0"):
        fresh.setenv("EPD_PREFILL_KERNELS", switch)
        kernels_prefill.gdn_chunk_op.cache_clear()
        vision = checkpoint.build_vision_model(tiny_model_dir, dtype=dtype)
        count = kernels_prefill.use_rotary_kernel(vision)
        if switch == "1" and count == 0:
            pytest.skip("the fused prefill kernels are not built here")
        assert count == (len(vision.blocks) if switch == "1" else 0)
        calls = []
        if count:
            real = torch.ops.epd_gdn_chunk.rotary
            fresh.setattr(kernels_prefill, "_rotary", lambda *a: calls.append(1) or real(*a))
        outputs.append(vision(pixels, grid_thw=grid).pooler_output)
        assert len(calls) == (2 * len(vision.blocks) if count else 0)  # the query and the key of each block
    assert torch.equal(outputs[0], outputs[1])
