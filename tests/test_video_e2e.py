"""(slow: a stack of its own) Video clips through a real `epd serve` stack (Ray local, embedded redis-server, gRPC on loopback),
two encoder replicas and clips split into chunks of one temporal patch: greedy tokens and the prompt
identical to transformers' Qwen3_5ForConditionalGeneration.generate fed by transformers' own video
processor (bench.oracle) for one clip, a clip and an image, two clips and a per-request fps; a second
question about a clip encodes nothing; a follow-up turn reuses the clip's prefix; hostile clips are
refused with INVALID_ARGUMENT within a couple of seconds and the next request is fine."""

from __future__ import annotations

import base64
import json
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest

from bench.synthetic import make_audio, make_clip, make_image
from epd import client
from epd.v1 import epd_pb2
from tests.conftest import serving

CLIP = make_clip(160, 128, 24, fps=8, seed=1)  # 3 s: 6 frames sampled at 2 fps, 3 temporal patches of 4x5 tokens
CLIP2 = make_clip(96, 64, 10, fps=5, seed=2)  # 2 s: 4 frames, 2 temporal patches
IMAGE = make_image(96, 64, seed=3)
BLOCK = 16
pytestmark = pytest.mark.slow  # a stack of its own (~1.5 min on a quiet machine); tests/test_video.py has the quick ones


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with serving(tiny_model_dir, "--encoders", "2", "--video-chunk-patches", "1", "--prefix-block-size", str(BLOCK),
                 "--http-port", str(port), "--served-model-name", "tiny",
                 log_path=str(tmp_path_factory.mktemp("logs") / "serve-video.log")) as server:
        server.http = f"http://127.0.0.1:{port}"
        yield server


def part(kind, value, **overrides):
    if kind == "video":
        return epd_pb2.ContentPart(video=epd_pb2.VideoPart(data=value, **overrides))
    if kind == "image":
        return epd_pb2.ContentPart(image=value)
    return epd_pb2.ContentPart(text=value)


def run(stack, content, max_tokens=16, history=()):
    messages = [*history, epd_pb2.ChatMessage(role="user", content=content)]
    request = client.chat_request(messages, max_tokens=max_tokens, temperature=0.0)
    request.return_prompt_token_ids = True
    result = client.GenerateResult()
    result.prompt_token_ids = []
    for event in client.stream(stack.address, request, timeout_s=180):
        if event.WhichOneof("event") == "summary":
            result.summary = event.summary
            continue
        result.prompt_token_ids.extend(event.chunk.prompt_token_ids)
        result.token_ids.extend(event.chunk.token_ids)
        result.text += event.chunk.text
    return result


def oracle_parts(content):
    out = []
    for p in content:
        kind = p.WhichOneof("part")
        if kind == "video":
            clip = {"type": "video", "video": p.video.data}
            if p.video.HasField("fps"):
                clip["fps"] = p.video.fps
            out.append(clip)
        elif kind == "image":
            out.append({"type": "image", "image": p.image})
        else:
            out.append({"type": "text", "text": p.text})
    return out


@pytest.mark.parametrize("content", [
    pytest.param([part("video", CLIP), part("text", "What happens in this clip?")], id="one-clip"),
    pytest.param([part("image", IMAGE), part("video", CLIP), part("text", "Does the picture appear in the clip?")],
                 id="clip-and-image"),
    pytest.param([part("video", CLIP), part("text", "and"), part("video", CLIP2), part("text", "Which is longer?")],
                 id="two-clips"),
    pytest.param([part("video", CLIP2, fps=4.0), part("text", "Count the frames.")], id="fps-override"),
])
def test_greedy_parity_and_prompt_with_transformers(stack, oracle, content):
    inputs = oracle.chat_inputs([{"role": "user", "content": oracle_parts(content)}])
    expected = oracle.generate_through_eos(inputs, 16)
    result = run(stack, content)
    assert result.prompt_token_ids == inputs["input_ids"][0].tolist()  # timestamps, placeholders, grid
    assert result.token_ids[: len(expected)] == expected[: len(result.token_ids)]
    assert result.token_ids == expected[: len(result.token_ids)] and len(result.token_ids) >= 1
    clips = [p for p in content if p.WhichOneof("part") == "video"]
    assert result.summary.videos == len(clips)
    grid = inputs["video_grid_thw"]
    assert result.summary.video_tokens == int((grid.prod(-1) // 4).sum())
    assert result.summary.video_chunks == int(grid[:, 0].sum())  # one chunk per temporal patch here


def test_second_question_about_a_clip_encodes_nothing_and_reuses_its_prefix(stack, oracle):
    clip = make_clip(128, 96, 16, fps=8, seed=11)
    first_content = [part("video", clip), part("text", "Describe it.")]
    first = run(stack, first_content, max_tokens=8)
    assert first.summary.video_chunks_encoded == first.summary.video_chunks == 2
    other = run(stack, [part("video", clip), part("text", "What colour is the bar?")], max_tokens=8)
    assert other.summary.video_chunks_encoded == 0  # every chunk from the store
    print(f"TTFT first {first.summary.ttft_s:.3f} s, second question {other.summary.ttft_s:.3f} s")
    history = [epd_pb2.ChatMessage(role="user", content=first_content),
               epd_pb2.ChatMessage(role="assistant", content=[part("text", first.text)])]
    follow = run(stack, [part("text", "And then?")], max_tokens=8, history=history)
    assert follow.summary.video_chunks_encoded == 0
    assert follow.summary.cached_tokens >= first.summary.prompt_tokens // BLOCK * BLOCK - BLOCK
    messages = [{"role": "user", "content": oracle_parts(first_content)}, {"role": "assistant", "content": first.text},
                {"role": "user", "content": "And then?"}]
    expected = oracle.generate_through_eos(oracle.chat_inputs(messages), 8)
    assert follow.token_ids == expected[: len(follow.token_ids)]


def _refused(stack, data, **overrides):
    start = time.perf_counter()
    with pytest.raises(grpc.RpcError) as info:
        run(stack, [part("video", data, **overrides), part("text", "what?")], max_tokens=2)
    elapsed = time.perf_counter() - start
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return info.value.details(), elapsed


def test_hostile_clips_are_refused_cleanly_and_the_service_keeps_serving(stack):
    header_cut = make_clip(64, 48, 30, fps=10, seed=5, faststart=True)  # index first: the cut file still opens
    cases = {
        "corrupt": (b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8, {}, "corrupt"),
        "truncated": (header_cut[: len(header_cut) * 2 // 3], {}, "truncated"),
        "audio-only": (make_audio(1.0), {}, "no video stream (audio only)"),
        "zero-length": (make_clip(64, 48, 0), {}, "no frames"),
        "zero-length-webm": (make_clip(64, 48, 0, codec="libvpx", container="webm"), {}, "corrupt"),
        "empty": (b"", {}, "empty"),
        "long-at-tiny-size": (make_clip(16, 16, 3700, fps=1), {}, "max_duration_s"),
        "huge-frames": (make_clip(4128, 4128, 2, fps=2), {}, "max_frame_pixels"),
        "fps-over-cap": (CLIP2, {"fps": 1000.0}, "fps"),
        "frames-over-cap": (CLIP2, {"max_frames": 100_000}, "max_frames"),
    }
    for name, (data, overrides, needle) in cases.items():
        message, elapsed = _refused(stack, data, **overrides)
        assert needle in message, (name, message)
        assert elapsed < 5.0, (name, elapsed)
    # A frame-count bomb across one request's clips: 2 x 400 frames sampled at 60 fps > 768.
    bomb = make_clip(32, 32, 400, fps=60, seed=9)
    with pytest.raises(grpc.RpcError) as info:
        run(stack, [part("video", bomb, fps=60.0, max_frames=768), part("video", bomb, fps=60.0, max_frames=768),
                    part("text", "?")], max_tokens=2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_frames_per_request" in info.value.details()
    ok = run(stack, [part("video", CLIP2), part("text", "still there?")], max_tokens=2)
    assert len(ok.token_ids) >= 1


def _post(stack, body):
    request = urllib.request.Request(f"{stack.http}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_video_url_on_the_http_front(stack, oracle):
    url = "data:video/mp4;base64," + base64.b64encode(CLIP2).decode()
    content = [{"type": "video_url", "video_url": {"url": url, "fps": 4}}, {"type": "text", "text": "What is it?"}]
    status, reply = _post(stack, {"model": "tiny", "messages": [{"role": "user", "content": content}],
                                  "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert status == 200, reply
    inputs = oracle.chat_inputs([{"role": "user", "content": [{"type": "video", "video": CLIP2, "fps": 4.0},
                                                              {"type": "text", "text": "What is it?"}]}])
    assert reply["choices"][0]["token_ids"] == oracle.generate_through_eos(inputs, 8)
    assert reply["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    bad = "data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode()
    status, reply = _post(stack, {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": bad}}, {"type": "text", "text": "?"}]}]})
    assert status == 400 and "video 0" in reply["error"]["message"], reply
    status, reply = _post(stack, {"model": "tiny", "max_tokens": 2, "mm_processor_kwargs": {"fps": 500},
                                  "messages": [{"role": "user", "content": [
                                      {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "?"}]}]})
    assert status == 400 and "fps" in reply["error"]["message"], reply


def test_a_clip_survives_an_encoder_replica_killed_mid_clip(stack, oracle):
    """40 chunks of one clip spread over the 2 encoder replicas; one replica is killed with SIGKILL
    while the request is still encoding: its chunks go to the other replica (encode is content-keyed,
    so a retry is safe) and the answer still equals transformers'."""
    import os
    import signal
    import threading

    from tests.conftest import epd_status, ray_address

    clip = make_clip(320, 256, 80, fps=2, seed=31)  # 40 s at 2 fps: 80 frames, 40 temporal patches
    content = [part("video", clip), part("text", "Summarise.")]
    inputs = oracle.chat_inputs([{"role": "user", "content": oracle_parts(content)}])
    expected = oracle.generate_through_eos(inputs, 6)
    victim = epd_status(ray_address(stack))["roles"]["encoder"][0]
    outcome: dict = {}

    def ask() -> None:
        try:
            outcome["result"] = run(stack, content, max_tokens=6)
        except grpc.RpcError as error:  # pragma: no cover - the assertion below shows it
            outcome["error"] = (error.code(), error.details())

    thread = threading.Thread(target=ask)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive(), "the request finished before the kill: nothing was tested"
    os.kill(victim["pid"], signal.SIGKILL)
    thread.join(timeout=300)
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]
    assert result.token_ids == expected[: len(result.token_ids)] and result.token_ids
    assert result.summary.video_chunks == 40
