"""`epd bench decode-step` on the tiny checkpoint: a complete, sane report (not a speed check)."""

from __future__ import annotations

import json

import pytest

from bench.decode_step import weight_bytes_per_step
from control import cli
from epd.lm import TextModelRunner


def test_decode_step_report_is_complete_and_consistent(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "step.json"
    assert cli.main(["bench", "decode-step", "--model", tiny_model_dir, "--batch-sizes", "1,4",
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "x floor" in capsys.readouterr().out  # the table
    runner = TextModelRunner.load(tiny_model_dir)
    assert report["weight_bytes_per_step"] == weight_bytes_per_step(runner)
    # every weight once, the tied LM head counted once as the head (the embedding lookup is not a read of it);
    # pre-packed linear weights are buffers, not parameters: count the parameters of an unpacked runner
    dense = TextModelRunner.load(tiny_model_dir, prepack=False)
    params = sum(p.numel() * p.element_size() for p in dense.model.parameters())
    assert report["weight_bytes_per_step"] == params
    assert report["gemv_bandwidth_gb_s"] > 0.1
    assert abs(report["floor_s"] - report["weight_bytes_per_step"] / (report["gemv_bandwidth_gb_s"] * 1e9)) < 1e-9
    assert [row["batch_size"] for row in report["steps"]] == [1, 4]
    for row in report["steps"]:
        assert row["step_s"] > 0
        assert abs(row["ratio_to_floor"] - row["step_s"] / report["floor_s"]) < 1e-9
    assert report["steps"][0]["ratio_to_batch1"] == 1.0
    assert report["machine"]["cpus"] >= 1 and report["dtype"] == "float32"


def test_decode_step_rejects_a_missing_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "decode-step", "--model", str(tmp_path), "--batch-sizes", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "epd bench decode-step: error:" in err and "not a checkpoint directory" in err


def test_the_preemption_bench_times_both_ways(tiny_model_dir):
    from bench.preemption import measure

    report = measure(tiny_model_dir, prompt_tokens=40, generated=20, repeats=1)
    assert report["state_bytes"] > 0 and report["replay_computes_tokens"] == 20
    assert report["swap_out_and_in_s"] > 0 and report["replay_prefill_s"] > 0
    assert report["replay_over_swap"] == report["replay_prefill_s"] / report["swap_out_and_in_s"]
