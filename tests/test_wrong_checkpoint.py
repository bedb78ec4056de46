"""A checkpoint epd cannot serve is refused before Ray starts, in one line that says what the
directory holds and what is supported; a role whose constructor fails every time (here: the
weights are missing, which the pre-flight does not look at) stops the deployment with the error
after ``max_start_failures`` attempts, instead of being replaced forever (issue 21)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from tests.test_cli_errors import assert_one_line_error


@pytest.mark.parametrize("model_type,architecture", [
    ("llama", "LlamaForCausalLM"),
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),  # a MoE epd cannot serve (qwen3_5_moe it can)
])
def test_another_model_type_is_refused_in_seconds(tmp_path, tiny_model_dir, model_type, architecture):
    model = tmp_path / model_type
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type=model_type, architectures=[architecture])
    (model / "config.json").write_text(json.dumps(config))
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "control.cli", "serve", "--model", str(model)],
                         capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    line = assert_one_line_error(out, "epd serve: error:", f"model_type is {model_type!r} ({architecture})",
                                 "expected 'qwen3_5' or 'qwen3_5_moe'", "Qwen3.5")
    assert "ray at" not in out.stdout, line  # before Ray
    assert took < 10, took


def test_a_role_that_cannot_start_stops_the_deployment(tmp_path, tiny_model_dir):
    model = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, model)
    for weights in model.glob("*.safetensors*"):
        weights.unlink()
    proc = subprocess.Popen([sys.executable, "-m", "control.cli", "serve", "--model", str(model), "--encoders", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    children: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                children.update({p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.5)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, (proc.returncode, stderr[-3000:])
    assert "epd ready at" not in stdout
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("epd serve: stopped: ") and "failed to start 3 times in a row" in last, stderr[-3000:]
    assert "no model.safetensors or model.safetensors.index.json" in last, last
    assert "Traceback" not in last
    time.sleep(2)
    left = [p for p in children.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        p.kill()
    assert left == [], left
