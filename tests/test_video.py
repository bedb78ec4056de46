"""epd.video re-derives transformers 5.24's Qwen3.5 video processing; each test names the lines it
follows and compares with transformers' own code wherever that code runs without torchvision:

* ``Qwen3VLVideoProcessor.sample_frames`` (video_processing_qwen3_vl.py): fps sampling, min/max
  frames, 24 fps assumed when the file states none;
* ``video_processing_qwen3_vl.smart_resize`` + ``Qwen3VLVideoProcessor.resize``'s pixel budgets
  (whole clip; the per-frame cap of ``cap_pixels_per_frame``);
* ``Qwen3VLProcessor._calculate_timestamps`` (processing_qwen3_vl.py): one time per temporal patch;
* ``Qwen3VLVideoProcessor.patchify`` and the pixels of transformers' whole processor (bench.oracle:
  torchvision's two CPU kernels in plain torch; tests/test_video_reference.py checks the unmodified
  processor in a venv with torchvision);
* ``Qwen3VLProcessor.replace_video_token``: the prompt (timestamps, ``<|vision_start|>``, pads,
  ``<|vision_end|>``) built by PromptBuilder equals the one transformers writes;
* ``Qwen3_5Model.get_rope_index`` (modeling_qwen3_5.py): M-RoPE positions of video grids;
* ``vision_utils.get_vision_cu_seqlens``: the vision tower attends within each temporal patch, so a
  clip encoded in chunks gives the rows of one forward over it, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.synthetic import make_clip, make_image
from epd import limits, video
from epd.v1 import epd_pb2

CLIP = make_clip(160, 128, 24, fps=8, seed=1)


@pytest.fixture(scope="module")
def settings(tiny_model_dir):
    from epd.modelinfo import ModelInfo

    return ModelInfo.load(tiny_model_dir).video_settings()


def _transformers_processor(**kwargs):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(**kwargs)


@pytest.mark.parametrize("total,file_fps,fps,min_frames,max_frames", [
    (24, 8.0, 2.0, 4, 768), (300, 30.0, 2.0, 4, 768), (7, 24.0, 2.0, 4, 768), (3, 30.0, 2.0, 4, 768),
    (1000, 25.0, 2.0, 4, 16), (90, None, 2.0, 4, 768), (50, 10.0, 7.5, 2, 768), (2, 1.0, 0.5, 4, 768),
])
def test_frame_sampling_follows_sample_frames(total, file_fps, fps, min_frames, max_frames):
    from transformers.video_utils import VideoMetadata

    reference = _transformers_processor(fps=fps, min_frames=min_frames, max_frames=max_frames)
    expected = reference.sample_frames(VideoMetadata(total_num_frames=total, fps=file_fps))
    ours = video.sample_indices(total, file_fps, video.VideoSettings(fps=fps, min_frames=min_frames,
                                                                     max_frames=max_frames))
    assert ours == expected.tolist()


@pytest.mark.parametrize("frames,height,width,min_pixels,max_pixels,cap", [
    (6, 128, 160, 4096, 25165824, False), (6, 128, 160, 131072, 786432, False), (64, 720, 1280, 4096, 25165824, False),
    (4, 20, 500, 4096, 25165824, False), (7, 1080, 1920, 131072, 786432, False), (5, 33, 47, 4096, 1 << 20, False),
    (64, 720, 1280, 4096, 25165824, True), (3, 64, 64, 131072, 786432, True),
])
def test_resize_follows_smart_resize_and_the_clip_budget(frames, height, width, min_pixels, max_pixels, cap):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    ours = video.smart_resize(frames, height, width, video.VideoSettings(
        min_pixels=min_pixels, max_pixels=max_pixels, cap_pixels_per_frame=cap))
    budget = max_pixels
    if cap:  # Qwen3VLVideoProcessor.resize's per-frame cap, then smart_resize on the capped budget
        per_frame = max(min(768 * 32 * 32, max_pixels // frames), int(min_pixels * 1.05))
        budget = per_frame * frames
    assert ours == smart_resize(frames, height, width, temporal_factor=2, factor=32, min_pixels=min_pixels,
                                max_pixels=budget)


def test_a_single_frame_clip_is_refused_as_transformers_refuses_it():
    with pytest.raises(video.VideoError, match="at least 2"):
        video.smart_resize(1, 64, 64, video.VideoSettings())


@pytest.mark.parametrize("indices,fps", [([0, 5, 9, 14, 18, 23], 8.0), ([0, 3, 7], 24.0), (list(range(0, 40, 4)), 29.97)])
def test_timestamps_follow_calculate_timestamps(indices, fps):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    assert video.patch_timestamps(indices, fps) == Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)


def test_patchify_follows_transformers():
    frames = torch.randn(5, 3, 64, 96)
    s = video.VideoSettings()
    expected, *_ = _transformers_processor().patchify(frames[None], patch_size=16, merge_size=2, temporal_patch_size=2)
    assert torch.equal(video.patchify(frames, s), expected[0])


def test_pixels_and_chunks_equal_transformers_processor(tiny_model_dir, settings):
    from bench.oracle import video_inputs

    reference, _ = video_inputs(tiny_model_dir, [{"video": CLIP}])
    info = video.probe_video(CLIP, settings)
    assert info.grid_thw == tuple(reference["video_grid_thw"][0].tolist())
    whole, grid = video.load_chunk_pixels(CLIP, settings, 0, info.grid_thw[0])
    assert torch.equal(whole, reference["pixel_values_videos"])
    rows = info.grid_thw[1] * info.grid_thw[2]
    for first, count in video.chunks(info.grid_thw[0], 2):
        part, part_grid = video.load_chunk_pixels(CLIP, settings, first, count)
        assert part_grid == (count, *info.grid_thw[1:])
        assert torch.equal(part, whole[first * rows : (first + count) * rows])


def _builder(model_dir, **kwargs):
    from epd.modelinfo import ModelInfo
    from router_svc.prompt import PromptBuilder

    return PromptBuilder.load(model_dir, ModelInfo.load(model_dir), 64 * 1024 * 1024, **kwargs)


def _message(*parts):
    return [epd_pb2.ChatMessage(role="user", content=list(parts))]


def test_prompt_and_positions_equal_transformers(tiny_model_dir, oracle):
    image = make_image(96, 64, seed=3)
    clip2 = make_clip(96, 64, 10, fps=5, seed=2)
    builder = _builder(tiny_model_dir, video_chunk_patches=2)
    prompt = builder.build(_message(epd_pb2.ContentPart(video=epd_pb2.VideoPart(data=CLIP)),
                                    epd_pb2.ContentPart(image=image),
                                    epd_pb2.ContentPart(video=epd_pb2.VideoPart(data=clip2, fps=4.0)),
                                    epd_pb2.ContentPart(text="Compare.")), None, False)
    inputs = oracle.chat_inputs([{"role": "user", "content": [
        {"type": "video", "video": CLIP}, {"type": "image", "image": image},
        {"type": "video", "video": clip2, "fps": 4.0}, {"type": "text", "text": "Compare."}]}])
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    assert [clip.grid_thw for clip in prompt.videos] == [tuple(g) for g in inputs["video_grid_thw"].tolist()]
    assert [item.video.num_patches if item.video else 0 for item in prompt.images] == [2, 1, 0, 2, 2]
    from epd import positions
    from router_svc.prompt import request_images_proto

    pieces = positions.vision_pieces(prompt.token_ids, request_images_proto(prompt), oracle.image_token_id,
                                     oracle.video_token_id)
    ours, delta = positions.mrope_positions(len(prompt.token_ids), [p.span for p in pieces])
    expected, expected_delta = oracle.model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
        video_grid_thw=inputs["video_grid_thw"])
    assert torch.equal(ours, expected[:, 0])
    assert delta == int(expected_delta)


def test_chunked_encode_equals_one_forward(tiny_model_dir, settings):
    from epd import checkpoint

    clip = make_clip(192, 160, 40, fps=10, seed=4)  # 8 frames -> 4 temporal patches of 5x6 tokens
    vision = checkpoint.build_vision_model(tiny_model_dir, dtype=torch.float32, device="cpu")
    info = video.probe_video(clip, settings)
    with torch.inference_mode():
        pixels, grid = video.load_chunk_pixels(clip, settings, 0, info.grid_thw[0])
        whole = vision(pixels, grid_thw=torch.tensor([grid])).pooler_output
        for size in (1, 3):
            parts = []
            for first, count in video.chunks(info.grid_thw[0], size):
                pixels, grid = video.load_chunk_pixels(clip, settings, first, count)
                parts.append(vision(pixels, grid_thw=torch.tensor([grid])).pooler_output)
            assert torch.equal(torch.cat(parts), whole)


def test_keys_change_with_every_setting_that_changes_embeddings(settings):
    base = video.chunk_key(CLIP, settings, 0, 1)
    assert video.chunk_key(CLIP, settings, 0, 1) == base
    others = [video.chunk_key(CLIP, settings.with_overrides(fps=4.0), 0, 1),
              video.chunk_key(CLIP, settings.with_overrides(max_frames=8), 0, 1),
              video.chunk_key(CLIP, settings.with_overrides(max_pixels=8192), 0, 1),
              video.chunk_key(CLIP, settings, 1, 1), video.chunk_key(CLIP, settings, 0, 2),
              video.chunk_key(CLIP + b"\0", settings, 0, 1)]
    assert len({base, *others}) == 7


def test_caps_are_checked_from_the_header_before_decoding(settings):
    caps = limits.VideoLimits(max_duration_s=2.0)
    with pytest.raises(video.VideoError, match="max_duration_s"):
        video.probe_video(CLIP, settings, caps)
    with pytest.raises(video.VideoError, match="max_frame_pixels"):
        video.probe_video(CLIP, settings, limits.VideoLimits(max_frame_pixels=160 * 128 - 1))
    with pytest.raises(video.VideoError, match="max_total_frames"):
        video.probe_video(CLIP, settings, limits.VideoLimits(max_total_frames=23))
    with pytest.raises(video.VideoError, match="max_decoded_pixels"):
        video.probe_video(CLIP, settings, limits.VideoLimits(max_decoded_pixels=160 * 128 * 23))
    with pytest.raises(video.VideoError, match="fps"):
        settings.with_overrides(fps=61.0)
    streamed = make_clip(64, 48, 30, fps=10, faststart=True)
    cut = streamed[: len(streamed) * 2 // 3]
    info = video.probe_video(cut, settings)  # the header still says 30 frames
    with pytest.raises(video.VideoError, match="truncated"):
        video.load_chunk_pixels(cut, settings, 0, info.grid_thw[0])
    webm = make_clip(64, 48, 12, fps=6, codec="libvpx", container="webm")  # states no frame count: packets counted
    assert video.probe_video(webm, settings).total_frames == 12
    assert np.asarray(video.decode_frames(webm, [0, 11])).shape == (2, 48, 64, 3)


@pytest.mark.parametrize("codec,container,fps", [("mpeg4", "mp4", 8), ("libx264", "mp4", 25), ("mjpeg", "avi", 6),
                                                  ("libvpx", "webm", 6)])
def test_a_late_chunk_decodes_from_its_key_frame_to_the_same_pixels(codec, container, fps):
    """A chunk late in a clip seeks to the key frame before it (not frame 0): the frames equal the
    decoder's n-th outputs from the start (``read_video_pyav``'s numbering), B-frames (x264) included;
    a clip whose header states no constant-rate timeline (WebM: no frame count) decodes from frame 0."""
    import io

    import av

    data = make_clip(96, 64, 60, fps=fps, seed=4, codec=codec, container=container)
    with av.open(io.BytesIO(data)) as box:
        everything = [frame.to_ndarray(format="rgb24") for frame in box.decode(video=0)]
    assert len(everything) == 60
    for first in (1, 13, 29, 56):
        indices = [first, first + 1, first + 3]
        with av.open(io.BytesIO(data)) as box:
            seeked = video._decode_from_key_frame(box, indices)
        assert (seeked is None) == (container == "webm")
        assert np.array_equal(video.decode_frames(data, indices), np.stack([everything[i] for i in indices]))


# ---------------------------------------------------------------- through the shared stack (2 encoder replicas)


def test_a_clip_split_across_encoder_replicas_matches_transformers(addr, oracle):
    """A 5-patch clip is 2 chunks (router.video_chunk_patches 4) encoded on the stack's 2 replicas; a
    second question about it encodes nothing; a hostile clip is INVALID_ARGUMENT and the next request is fine."""
    import grpc

    from epd import client

    clip = make_clip(128, 96, 50, fps=10, seed=21)  # 5 s: 10 frames -> 5 temporal patches
    content = [epd_pb2.ContentPart(video=epd_pb2.VideoPart(data=clip)), epd_pb2.ContentPart(text="What moves?")]
    inputs = oracle.chat_inputs([{"role": "user", "content": [{"type": "video", "video": clip},
                                                              {"type": "text", "text": "What moves?"}]}])
    expected = oracle.generate_through_eos(inputs, 12)
    request = client.chat_request([epd_pb2.ChatMessage(role="user", content=content)], max_tokens=12,
                                  temperature=0.0, ignore_eos=True)
    first = client.generate(addr, request, timeout_s=180)
    assert first.token_ids == expected
    assert first.summary.prompt_tokens == inputs["input_ids"].shape[1]
    assert (first.summary.videos, first.summary.video_chunks, first.summary.video_chunks_encoded) == (1, 2, 2)
    again = client.generate(addr, request, timeout_s=180)
    assert again.token_ids == expected and again.summary.video_chunks_encoded == 0
    bad = client.chat_request([epd_pb2.ChatMessage(role="user", content=[
        epd_pb2.ContentPart(video=epd_pb2.VideoPart(data=clip[: len(clip) // 3])), epd_pb2.ContentPart(text="?")])],
        max_tokens=2)
    with pytest.raises(grpc.RpcError) as info:
        client.generate(addr, bad, timeout_s=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "video 0" in info.value.details()
    assert client.generate(addr, request, timeout_s=180).token_ids == expected
