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


def test_moe_floor_counts_only_the_experts_the_steps_chose(tiny_moe_model_dir, tmp_path):
    """A MoE model's floor: the dense bytes + the distinct experts its tokens chose x one expert's
    bytes. At batch 1 that is top_k per layer, the bytes epd.memory_plan counts per token; at
    batch 8 (prompts of their own) more experts are read, never more than all of them."""
    from epd import memory_plan

    out = tmp_path / "step.json"
    assert cli.main(["bench", "decode-step", "--model", tiny_moe_model_dir, "--batch-sizes", "1,8",
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    moe, (one, eight) = report["moe"], report["steps"]
    raw = memory_plan.read_raw_config(tiny_moe_model_dir)
    text = raw["text_config"]
    assert moe["moe_layers"] == text["num_hidden_layers"]
    assert moe["expert_bytes"] == 3 * text["hidden_size"] * text["moe_intermediate_size"] * 4
    assert one["experts_read_per_step"] == moe["moe_layers"] * text["num_experts_per_tok"]
    assert one["weight_bytes_read"] == memory_plan.active_bytes_per_token(raw, "float32")
    assert one["experts_read_per_step"] < eight["experts_read_per_step"] <= moe["moe_layers"] * text["num_experts"]
    for row in (one, eight):
        assert row["weight_bytes_read"] == moe["dense_bytes"] + row["experts_read_per_step"] * moe["expert_bytes"]
        assert abs(row["ratio_to_floor"] - row["step_s"] / row["floor_s"]) < 1e-9
    assert one["floor_s"] < eight["floor_s"] < report["floor_s"] * 1.0000001


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
