"""epd/kernels.py against transformers' reference Gated DeltaNet and causal-conv1d functions, and
a check that the runner uses epd's kernels, not the reference ones.

float32 results must agree within 1e-4 (the two compute the same sums in a different order);
half precision within 2e-2, which is a few units in the last place of bfloat16 (8 bits of
mantissa) at the magnitudes here, since both round the same float32 result to the same dtype.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qm

from decode_svc.batch import DecodeBatch
from epd import fused, kernels, kernels_prefill, positions
from epd.lm import TextModelRunner

ATOL_FP32 = 1e-4
ATOL_HALF = 2e-2
LENGTHS = [1, 63, 64, 65, 200]


def _gdn_inputs(batch, length, k_heads=2, v_heads=4, dim=32, dtype=torch.float32, seed=0):
    """Random inputs shaped as Qwen3.5's GDN layer makes them: GQA (2 key heads, 4 value heads),
    log-decay g <= 0, beta in (0, 1), and an initial state of the scale a prompt leaves."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    query, key = rand(batch, length, k_heads, dim), rand(batch, length, k_heads, dim)
    value = rand(batch, length, v_heads, dim)
    g = -torch.rand(batch, length, v_heads, generator=gen) * 2
    beta = torch.rand(batch, length, v_heads, generator=gen)
    state = rand(batch, v_heads, dim, dim) * 0.5
    return [t.to(dtype) for t in (query, key, value)] + [g, beta.to(dtype), state]


def _reference_chunk(query, key, value, g, beta, state, l2norm=True):
    return qm.torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=state,
                                           output_final_state=True, use_qk_l2norm_in_kernel=l2norm)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunk_rule_matches_reference_fp32(length, with_state, chunk_size):
    query, key, value, g, beta, state = _gdn_inputs(batch=2, length=length, seed=length)
    state = state if with_state else None
    kept = None if state is None else state.clone()
    expected, expected_state = _reference_chunk(query, key, value, g, beta, state)
    out, out_state = kernels.chunk_gated_delta_rule(query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                                                    initial_state=state, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(out_state, expected_state, atol=ATOL_FP32, rtol=0)
    if state is not None:
        assert torch.equal(state, kept), "the caller's initial state must not be written"


def test_chunk_rule_without_l2norm_and_without_final_state():
    query, key, value, g, beta, state = _gdn_inputs(batch=1, length=65, k_heads=4, v_heads=4, seed=7)
    # unnormalised keys make the UT system ill-conditioned; scale them as a trained model would
    key = key * 0.1
    expected, _ = _reference_chunk(query, key, value, g, beta, state, l2norm=False)
    out, final = kernels.chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=state)
    assert final is None
    torch.testing.assert_close(out, expected, atol=ATOL_FP32, rtol=0)


def test_chunk_rule_continues_across_calls():
    """Two calls carrying the state give what one call over the whole sequence gives (chunked
    prefill relies on it), and the same as the reference's single pass."""
    query, key, value, g, beta, _ = _gdn_inputs(batch=2, length=200, seed=3)
    expected, expected_state = _reference_chunk(query, key, value, g, beta, None)
    split = 77
    first, state = kernels.chunk_gated_delta_rule(
        *(t[:, :split] for t in (query, key, value)), g=g[:, :split], beta=beta[:, :split],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    second, state = kernels.chunk_gated_delta_rule(
        *(t[:, split:] for t in (query, key, value)), g=g[:, split:], beta=beta[:, split:], initial_state=state,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(torch.cat([first, second], dim=1), expected, atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(state, expected_state, atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [1, 65, 200])
def test_chunk_rule_matches_reference_half(dtype, length):
    query, key, value, g, beta, state = _gdn_inputs(batch=2, length=length, dtype=dtype, seed=11)
    expected, expected_state = _reference_chunk(query, key, value, g, beta, state)
    out, out_state = kernels.chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=state,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert out.dtype == dtype and out_state.dtype == torch.float32
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL_HALF, rtol=0)
    # the state never leaves float32 on either side
    torch.testing.assert_close(out_state, expected_state, atol=ATOL_FP32, rtol=0)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_step_matches_reference(batch, dtype):
    query, key, value, g, beta, state = _gdn_inputs(batch=batch, length=1, dtype=dtype, seed=batch)
    expected, expected_state = qm.torch_recurrent_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    updated = state.clone()
    out = kernels.recurrent_gated_delta_step(query, key, value, g, beta, updated)
    assert out.shape == expected.shape and out.dtype == dtype
    atol = ATOL_FP32 if dtype == torch.float32 else ATOL_HALF
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)
    torch.testing.assert_close(updated, expected_state, atol=ATOL_FP32, rtol=0)


def test_recurrent_steps_match_chunk_rule_over_a_sequence():
    """Decoding token by token continues a prefill exactly as the reference chunk rule runs the
    whole sequence at once."""
    query, key, value, g, beta, _ = _gdn_inputs(batch=2, length=40, seed=5)
    expected, expected_state = _reference_chunk(query, key, value, g, beta, None)
    prefill = 33
    out, state = kernels.chunk_gated_delta_rule(
        *(t[:, :prefill] for t in (query, key, value)), g=g[:, :prefill], beta=beta[:, :prefill],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    outs = [out]
    for t in range(prefill, 40):
        step = slice(t, t + 1)
        outs.append(kernels.recurrent_gated_delta_step(query[:, step], key[:, step], value[:, step], g[:, step],
                                                       beta[:, step], state))
    torch.testing.assert_close(torch.cat(outs, dim=1), expected, atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(state, expected_state, atol=ATOL_FP32, rtol=0)


def _conv_inputs(batch, length, channels=24, kernel=4, seed=0, time_major=True):
    gen = torch.Generator().manual_seed(seed)
    if time_major:  # as the runner passes it: the transposed view of a projection's output
        x = torch.randn(batch, length, channels, generator=gen).transpose(1, 2)
    else:
        x = torch.randn(batch, channels, length, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen) * 0.5
    bias = torch.randn(channels, generator=gen)
    window = torch.randn(batch, channels, kernel, generator=gen)
    return x, weight, bias, window


def _reference_conv(x, weight, bias, window):
    """transformers' causal_conv1d_fn over [window, x] (zeros before the first token when there is
    no window), keeping the last T outputs and the last K inputs, as the runner did before."""
    kernel = weight.shape[1]
    full = x if window is None else torch.cat([window, x], dim=-1)
    new_window = torch.nn.functional.pad(full, (max(0, kernel - full.shape[-1]), 0))[..., -kernel:]
    out = qm.causal_conv1d_fn(full, weight, bias, activation="silu")[..., -x.shape[-1]:]
    return out, new_window


@pytest.mark.parametrize("length", [1, 2, 3, 63, 64, 65, 200])
@pytest.mark.parametrize("with_window", [False, True])
@pytest.mark.parametrize("time_major", [False, True])
def test_causal_conv1d_matches_reference(length, with_window, time_major):
    x, weight, bias, window = _conv_inputs(batch=2, length=length, seed=length, time_major=time_major)
    window = window if with_window else None
    kept = None if window is None else window.clone()
    expected, expected_window = _reference_conv(x, weight, bias, window)
    out, new_window = kernels.causal_conv1d(x, weight, bias, "silu", window=window)
    assert out.shape == expected.shape and new_window.shape == expected_window.shape
    torch.testing.assert_close(out, expected, atol=ATOL_FP32, rtol=0)
    assert torch.equal(new_window, expected_window)
    if window is not None:
        assert torch.equal(window, kept), "the caller's window must not be written"


def test_causal_conv1d_without_bias_continues_across_calls():
    x, weight, _, _ = _conv_inputs(batch=2, length=70, seed=9)
    expected, expected_window = _reference_conv(x, weight, None, None)
    first, window = kernels.causal_conv1d(x[..., :2], weight, None, "silu")
    second, window = kernels.causal_conv1d(x[..., 2:], weight, None, "silu", window=window)
    torch.testing.assert_close(torch.cat([first, second], dim=-1), expected, atol=ATOL_FP32, rtol=0)
    assert torch.equal(window, expected_window)


def test_causal_conv1d_half():
    x, weight, bias, window = _conv_inputs(batch=2, length=65, seed=4)
    x, weight, bias, window = (t.bfloat16() for t in (x, weight, bias, window))
    expected, _ = _reference_conv(x, weight, bias, window)
    out, _ = kernels.causal_conv1d(x, weight, bias, "silu", window=window)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL_HALF, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_step_matches_reference_update(dtype):
    x, weight, bias, window = (t.to(dtype) for t in _conv_inputs(batch=3, length=1, seed=2))
    expected_window = window.clone()
    expected = qm.causal_conv1d_update(x, expected_window, weight, bias, "silu")
    time_major = window.transpose(1, 2).contiguous()  # [B, K, C]: how DecodeBatch keeps it
    out = kernels.causal_conv1d_step(x[..., 0], time_major, weight, bias, "silu")
    atol = ATOL_FP32 if dtype == torch.float32 else ATOL_HALF
    torch.testing.assert_close(out.float(), expected[..., 0].float(), atol=atol, rtol=0)
    assert torch.equal(time_major.transpose(1, 2), expected_window)  # shifted in place, as the reference does


# ---------------------------------------------------------------- which implementation runs

_REFERENCE = ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
              "causal_conv1d_update"]
_OURS = ["chunk_gated_delta_rule", "recurrent_gated_delta_step", "causal_conv1d", "causal_conv1d_step"]


@pytest.fixture
def calls(monkeypatch):
    """Make every transformers reference GDN/conv function fail if called, and count calls to
    epd's kernels."""
    counts = dict.fromkeys(_OURS, 0)

    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"the runner called transformers' reference {name}")
        return call

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    for name in _REFERENCE:
        monkeypatch.setattr(qm, name, forbidden(name))
    for name in _OURS:
        monkeypatch.setattr(kernels, name, counted(name, getattr(kernels, name)))
    return counts


def test_runner_uses_epd_kernels(tiny_model_dir, calls, monkeypatch):
    runner = TextModelRunner.load(tiny_model_dir)
    linear_layers = runner.layer_types.count("linear_attention")
    assert linear_layers > 0
    ids = torch.arange(3, 40)
    state = runner.new_state()
    pos, _ = positions.mrope_positions(len(ids), [])
    # the torch path of a prompt chunk (tests/test_kernels_prefill.py: the fused chunked rule)
    monkeypatch.setattr(kernels_prefill, "gdn_chunk_op", lambda: None)
    runner.forward(runner.embed(ids), pos, state)  # a prompt chunk
    assert calls["chunk_gated_delta_rule"] == linear_layers and calls["causal_conv1d"] == linear_layers

    one = torch.tensor([5])
    runner.forward(runner.embed(one), torch.full((3, 1), len(ids)), state)  # one token on top of it
    assert calls["recurrent_gated_delta_step"] == linear_layers
    assert calls["causal_conv1d"] == 2 * linear_layers

    batch = DecodeBatch(runner)
    for _ in range(2):
        batch.add(state.clone())
    monkeypatch.setenv(fused.ENV, "0")  # the torch path of a decode step (tests/test_fused.py: the fused op)
    runner.decode_step(batch, [7, 8], [state.num_tokens] * 2)
    assert calls["recurrent_gated_delta_step"] == 2 * linear_layers
    assert calls["causal_conv1d_step"] == linear_layers


# ---------------------------------------------------------------- pre-packed linear layers

needs_onednn = pytest.mark.skipif(not kernels.onednn_serves(torch.float32),
                                  reason="no oneDNN in this torch build")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 240])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, rows, bias):
    if not kernels.onednn_serves(dtype):
        pytest.skip(f"oneDNN has no {dtype} kernels on this CPU")
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 64, generator=gen) * 0.1).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(2, rows, 64, generator=gen).to(dtype)
    out = kernels.PackedLinear(weight, b)(x)
    assert out.shape == (2, rows, 96) and out.dtype == dtype
    tol = dict(atol=ATOL_FP32, rtol=0) if dtype == torch.float32 else dict(atol=ATOL_HALF, rtol=ATOL_HALF)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), **tol)


def test_can_prepack_only_on_cpu():
    assert not kernels.can_prepack(torch.device("cuda"), torch.float32)
    assert not kernels.can_prepack(torch.device("meta"), torch.float32)
    assert not kernels.can_prepack(torch.device("cpu"), torch.float16)


@needs_onednn
def test_runner_prepacks_every_linear_and_keeps_its_results(tiny_model_dir):
    packed = TextModelRunner.load(tiny_model_dir)
    dense = TextModelRunner.load(tiny_model_dir, prepack=False)
    linears = [m for m in dense.model.modules() if type(m) is torch.nn.Linear]
    assert linears
    assert not [m for m in packed.model.modules() if type(m) is torch.nn.Linear]
    assert sum(isinstance(m, kernels.PackedLinear) for m in packed.model.modules()) == len(linears)
    assert isinstance(packed.lm_head, kernels.PackedLinear)

    ids = torch.arange(3, 30)
    pos, _ = positions.mrope_positions(len(ids), [])
    logits = []
    for runner in (packed, dense):
        state = runner.new_state()
        first = runner.logits(runner.forward(runner.embed(ids), pos, state))
        batch = DecodeBatch(runner)
        batch.add(state)
        batch.add(state)
        step = runner.decode_step(batch, [int(first.argmax())] * 2, [len(ids)] * 2)
        logits.append((first, step))
    for got, want in zip(logits[0], logits[1]):
        torch.testing.assert_close(got, want, atol=ATOL_FP32, rtol=0)


def test_prefill_computes_the_lm_head_for_the_last_token_only(tiny_model_dir):
    """A prompt's forward returns the last token's hidden state only, so its logits are one row
    of the LM head, not T rows (the head is a third of the model's FLOPs per row)."""
    runner = TextModelRunner.load(tiny_model_dir)
    rows = []
    head = runner.lm_head
    runner.lm_head = lambda hidden: rows.append(hidden.shape) or head(hidden)
    ids = torch.arange(3, 40)
    pos, _ = positions.mrope_positions(len(ids), [])
    logits = runner.logits(runner.forward(runner.embed(ids), pos, runner.new_state()))
    assert rows == [torch.Size([runner.model.config.hidden_size])]
    assert logits.shape == (runner.lm_head_weight.shape[0],)


def test_kernel_bench_reports_every_configuration(tiny_model_dir, tmp_path, monkeypatch):
    """`python -m bench.kernel_bench` on the tiny checkpoint: complete reports (not a speed check),
    and its reference configuration really runs transformers' functions."""
    import json

    from bench import kernel_bench

    used = set()
    for name in _REFERENCE:
        def spy(*args, _name=name, _fn=getattr(qm, name), **kwargs):
            used.add(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(qm, name, spy)
    out = tmp_path / "bench.json"
    assert kernel_bench.main(["--model", tiny_model_dir, "--prompt-tokens", "20", "--batch-sizes", "1,2",
                              "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert used == set(_REFERENCE)
    expected = {"reference", "epd_kernels"} | ({"epd_kernels_packed"} if kernels.can_prepack(
        torch.device("cpu"), torch.float32) else set())
    assert set(report["configs"]) == expected
    for row in report["configs"].values():
        assert set(row) == {"prefill_s", "prefill_kernel_s", "decode_b1_s", "decode_b1_kernel_s",
                            "decode_b2_s", "decode_b2_kernel_s"}
        assert all(value > 0 for value in row.values())
        assert row["prefill_kernel_s"] < row["prefill_s"]
    assert set(report["speedup_over_reference"]) == expected - {"reference"}

    assert kernel_bench.main(["--model", tiny_model_dir, "--micro", "8,16", "--prompt-tokens", "20",
                              "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())["ms"]) == {"gdn_reference", "gdn_epd_chunk8", "gdn_epd_chunk16",
                                                      "conv_reference", "conv_epd"}
    assert kernel_bench.main(["--model", tiny_model_dir, "--gemm", "1,4", "--rounds", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"1", "4"} and all(v["ms"] > 0 for row in rows.values() for v in row.values())
