"""The fused C++ Gated DeltaNet decode step (epd/csrc/gdn_decode.cpp via epd.fused) against the
torch path it replaces, on random layers and states; and the fallback when it cannot be built.

The kernel is compiled for real (g++ and ninja are on the project's machines; the build is cached
under the user's cache directory, so only the first run of a fresh machine pays ~10 s)."""

from __future__ import annotations

import logging
import time
import types

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qm
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from decode_svc.batch import DecodeBatch
from epd import fused, lm, positions
from epd.lm import TextModelRunner
from tests.conftest import needs_compiler


def _layer(k_heads, v_heads, k_dim, v_dim, dtype, bias=False, seed=0):
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(hidden_size=48, linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
                               linear_key_head_dim=k_dim, linear_value_head_dim=v_dim, linear_conv_kernel_dim=4,
                               num_hidden_layers=1, layer_types=["linear_attention"])
    gdn = qm.Qwen3_5GatedDeltaNet(config, 0)
    if bias:
        gdn.conv1d.bias = torch.nn.Parameter(torch.zeros(gdn.conv_dim))
    with torch.no_grad():
        for param in gdn.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
        gdn.A_log.copy_(torch.randn(v_heads) * 0.5)
        gdn.norm.weight.copy_(1 + 0.2 * torch.randn(v_dim))
    return gdn.to(dtype).eval()


def _steps(gdn, inputs, conv, recurrent, use_fused, monkeypatch):
    """Run ``_linear_attention_step`` over ``inputs`` (one [B, 1, hidden] per step) from copies of
    the states; returns the outputs and the final states."""
    monkeypatch.setenv(fused.ENV, "1" if use_fused else "0")
    buffers = types.SimpleNamespace(conv=[conv.clone()], recurrent=[recurrent.clone()])
    if use_fused:
        assert lm._fused_gdn(gdn, inputs[0]) is not None
    else:
        assert lm._fused_gdn(gdn, inputs[0]) is None
    with torch.inference_mode():
        outs = [lm._linear_attention_step(gdn, x, buffers, 0) for x in inputs]
    return outs, buffers.conv[0], buffers.recurrent[0]


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [
    (16, 16, 128, 128, 8),  # the 0.8b's heads (AVX-512 path with 8 vectors a row)
    (2, 4, 16, 32, 3),  # grouped: two value heads per key head
    (4, 4, 64, 64, 16),  # vLLM's other head size
    (1, 2, 8, 24, 1),  # a head dim no vector width divides (the scalar path)
], ids=lambda s: "x".join(map(str, s)))
def test_fused_step_matches_the_torch_path(dtype, shape, fresh_fused, monkeypatch):
    k_heads, v_heads, k_dim, v_dim, batch = shape
    gdn = _layer(k_heads, v_heads, k_dim, v_dim, dtype, bias=batch == 3)
    # every slot its own window and state; views of larger buffers, as DecodeBatch's leading rows
    conv = torch.randn(batch + 2, 4, gdn.conv_dim).to(dtype)[:batch]
    recurrent = (torch.randn(batch + 1, v_heads, k_dim, v_dim) * 0.1)[:batch]
    inputs = [torch.randn(batch, 1, gdn.hidden_size).to(dtype) for _ in range(3)]
    want, want_conv, want_state = _steps(gdn, inputs, conv, recurrent, False, monkeypatch)
    got, got_conv, got_state = _steps(gdn, inputs, conv, recurrent, True, monkeypatch)
    assert torch.equal(got_conv, want_conv)  # the window is shifted, never computed on
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-6)  # float32 in both modes
    assert not torch.equal(got_state, recurrent)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        if dtype == torch.float32:  # float32 rounding: a different summation order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
        else:  # rounded to bfloat16 where the torch path rounds: nearly every element identical
            assert (a != b).float().mean() < 0.03
            torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1e-2 * float(b.float().abs().max()))


@needs_compiler
def test_the_runner_decodes_through_the_fused_op_and_agrees_with_the_torch_path(tiny_model_dir, fresh_fused, monkeypatch):
    """A whole batched decode step of the tiny checkpoint, fused (the default) and torch, float32
    and bfloat16: logits agree to rounding and the greedy tokens are the same."""
    calls = []
    real = fused.gdn_decode_step
    monkeypatch.setattr(fused, "gdn_decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    for dtype in ("float32", "bfloat16"):
        runner = TextModelRunner.load(tiny_model_dir, dtype=dtype)
        states = []
        for seed in range(3):
            ids = torch.randint(3, 200, (7 + 5 * seed,), generator=torch.Generator().manual_seed(seed))
            state = runner.new_state()
            runner.forward(runner.embed(ids), positions.mrope_positions(len(ids), [])[0], state)
            states.append(state)
        results = {}
        for use in (False, True):
            monkeypatch.setenv(fused.ENV, "1" if use else "0")
            batch = DecodeBatch(runner)
            for state in states:
                batch.add(state.clone())
            tokens, logits = [5, 6, 7], []
            for step in range(3):
                logits.append(runner.decode_step(batch, tokens, [s.num_tokens + step for s in states]))
                tokens = logits[-1].argmax(-1).tolist()
            results[use] = torch.stack(logits)
        linear = runner.layer_types.count("linear_attention")
        assert len(calls) == 3 * linear
        calls.clear()
        tolerance = 1e-4 if dtype == "float32" else 5e-2
        torch.testing.assert_close(results[True], results[False], rtol=tolerance, atol=tolerance)
        assert torch.equal(results[True].argmax(-1), results[False].argmax(-1))


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_a_failed_build_logs_one_warning_and_the_torch_path_runs(compiler, tmp_path, fresh_fused, monkeypatch, caplog):
    """No compiler, or one whose every compile fails (a fresh cache, so nothing built before can be
    loaded): ops() is None, one warning says why, and the decode step runs the torch path with the
    same results."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cxx = tmp_path / "c++"
    if compiler == "failing":  # answers version queries as g++ does, and fails every compile
        cxx.write_text('#!/bin/sh\ncase "$1" in --version|-v|-dumpversion) exec g++ "$@";; esac\n'
                       'echo "gdn_decode.cpp:1:1: error: this compiler compiles nothing" >&2\nexit 1\n')
        cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    # as in a fresh process: nothing loaded yet, under a name of its own (a library loaded by an
    # earlier test stays loaded, and torch's extension loader remembers names it has built)
    monkeypatch.setattr(fused, "_state", {})
    monkeypatch.setattr(fused, "library_name", lambda: "epd_gdn_unbuildable")
    with caplog.at_level(logging.WARNING, logger="epd.fused"):
        assert fused.ops() is None
        assert fused.ops() is None  # decided once per process
    warnings = [r for r in caplog.records if r.name == "epd.fused"]
    assert len(warnings) == 1 and "torch path" in warnings[0].getMessage()
    assert ("not found" if compiler == "missing" else "compiles nothing") in warnings[0].getMessage()
    if compiler == "failing":  # it did try, in the user's cache
        assert (tmp_path / "cache" / "epd" / "torch_extensions" / "epd_gdn_unbuildable" / "build.ninja").is_file()

    gdn = _layer(2, 4, 16, 32, torch.float32)
    x = torch.randn(2, 1, gdn.hidden_size)
    assert lm._fused_gdn(gdn, x) is None
    conv, recurrent = torch.randn(2, 4, gdn.conv_dim), torch.randn(2, 4, 16, 32) * 0.1
    got = _steps_without_env(gdn, [x], conv, recurrent)
    fused.reset()
    want, _, _ = _steps(gdn, [x], conv, recurrent, False, monkeypatch)
    assert torch.equal(got[0], want[0])


def _steps_without_env(gdn, inputs, conv, recurrent):
    buffers = types.SimpleNamespace(conv=[conv.clone()], recurrent=[recurrent.clone()])
    with torch.inference_mode():
        return [lm._linear_attention_step(gdn, x, buffers, 0) for x in inputs]


def test_turned_off_it_builds_nothing(tmp_path, fresh_fused, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(fused.ENV, "0")
    with caplog.at_level(logging.WARNING, logger="epd.fused"):
        assert fused.ops() is None
    assert not caplog.records and not (tmp_path / "cache").exists()


@needs_compiler
def test_the_op_refuses_inputs_it_does_not_serve(fresh_fused):
    op = fused.ops()
    assert op is not None
    batch, heads, dim = 2, 2, 16
    channels = 3 * heads * dim
    args = dict(mixed=torch.randn(batch, channels), window=torch.randn(batch, 4, channels),
                constants=fused.gdn_constants(torch.randn(channels, 4), None, torch.zeros(heads), torch.ones(heads)),
                a=torch.randn(batch, heads), b=torch.randn(batch, heads), z=torch.randn(batch, heads * dim),
                norm_weight=torch.ones(dim), norm_eps=1e-6, state=torch.zeros(batch, heads, dim, dim),
                k_heads=heads, k_dim=dim, v_dim=dim)
    assert fused.gdn_decode_step(**args).shape == (batch, heads * dim)
    for name, bad in [("state", torch.zeros(batch, heads, dim, dim, dtype=torch.float64)),
                      ("window", torch.randn(batch, channels, 4).transpose(1, 2)),  # not contiguous
                      ("mixed", torch.randn(batch, channels, dtype=torch.float16)),
                      ("z", torch.randn(batch, heads * dim + 1))]:
        with pytest.raises(RuntimeError, match="epd_gdn|Expected"):
            fused.gdn_decode_step(**{**args, name: bad})


def test_layer_constants_follow_the_weights_and_accept_inference_tensors():
    """The per-layer float32 constants are computed once, again when a weight changes in place or
    is replaced, and from weights that are inference tensors (a TP shard's, loaded under
    inference mode: no version counter)."""
    gdn = _layer(2, 4, 16, 32, torch.float32)
    first = lm._gdn_constants(gdn)
    assert lm._gdn_constants(gdn) is first
    with torch.no_grad():
        gdn.A_log.add_(1.0)
    second = lm._gdn_constants(gdn)
    assert second is not first and torch.equal(second[2], -gdn.A_log.detach().float().exp())
    with torch.inference_mode():
        shard = _layer(2, 4, 16, 32, torch.float32)
        gdn.conv1d.weight = torch.nn.Parameter(torch.randn_like(gdn.conv1d.weight))
    assert lm._gdn_constants(shard) is lm._gdn_constants(shard)
    assert torch.equal(lm._gdn_constants(gdn)[0], gdn.conv1d.weight[:, 0].t().float())


@needs_compiler
def test_the_layer_bench_times_both_paths(fresh_fused, capsys):
    from bench import gdn_decode

    assert gdn_decode.main(["--batch-sizes", "1,2", "--layers", "2", "--calls", "3"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "fused / torch" in line]
    assert len(lines) == 2 and all("torch path" in line for line in lines)


@pytest.mark.timeout(120)
def test_a_build_killed_part_way_does_not_hang_the_next_one(tmp_path, fresh_fused, monkeypatch):
    """A role killed while building leaves torch's ``lock`` file in the build directory; the next
    build (here a compiler that fails at once, in a fresh cache) removes it and goes on instead of
    waiting on it forever. Meanwhile a live builder (another process holding the build's flock) is
    waited for, and its directory's ``lock`` left alone until it is done."""
    import subprocess
    import sys

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cxx = tmp_path / "c++"
    cxx.write_text('#!/bin/sh\ncase "$1" in --version|-v|-dumpversion) exec g++ "$@";; esac\nexit 1\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setattr(fused, "_state", {})
    monkeypatch.setattr(fused, "library_name", lambda: "epd_gdn_killed_build")
    directory = tmp_path / "cache" / "epd" / "torch_extensions" / "epd_gdn_killed_build"
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # what a builder killed part-way leaves

    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(directory / '.epd-build.lock')!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(2)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        assert fused.ops() is None  # the build ran (and failed) once the holder let go
        assert time.monotonic() - started > 1.0  # it waited for the live builder
    finally:
        holder.kill()
        holder.wait()
    assert not (directory / "lock").exists()
    assert (directory / "build.ninja").is_file()  # it did try to build
