"""`epd bench`: the pure pieces (percentiles, image sizes, seeded workloads, request metrics) and
real runs: a local stack plus the transformers baseline in a subprocess (the CI smoke bench),
open-loop and multi-turn runs against the shared `epd serve`, and argument errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from bench.metrics import RequestRecord, Slo, percentiles, stage_figures, summarize
from bench.workload import (
    ImageSize,
    PromptMaker,
    WorkloadSpec,
    arrival_times,
    build_workload,
    parse_image_sizes,
    turns_per_conversation,
)
from control import cli

LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- pure pieces


def test_percentiles_interpolate_between_samples():
    figures = percentiles([float(v) for v in range(1, 101)])
    assert figures == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert percentiles([0.25]) == {"mean": 0.25, "p50": 0.25, "p90": 0.25, "p99": 0.25}
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_parse_image_sizes():
    assert parse_image_sizes("448x448,1280x720:3") == (ImageSize(448, 448, 1.0), ImageSize(1280, 720, 3.0))
    assert parse_image_sizes(" 64x32:0.5 ") == (ImageSize(64, 32, 0.5),)
    for bad, message in [("448", "expected WIDTHxHEIGHT[:WEIGHT], got '448'"), ("448x", "expected WIDTHxHEIGHT"),
                         ("axb", "expected WIDTHxHEIGHT"), ("0x10", "at least 1"),
                         ("10x10:0", "weight must be positive"), ("10x10,", "got ''")]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_image_sizes(bad)


def _spec(**overrides) -> WorkloadSpec:
    fields = dict(num_requests=12, images_per_request=2, image_sizes=(ImageSize(64, 64), ImageSize(96, 64, 3.0)),
                  prompt_tokens=20, repeat_ratio=0.3, turns=1, request_rate=None, seed=7)
    fields.update(overrides)
    return WorkloadSpec(**fields)


def test_workload_is_reproducible_by_seed():
    first, again = build_workload(_spec(), PromptMaker()), build_workload(_spec(), PromptMaker())
    assert first == again  # texts, image bytes, sizes, arrivals
    other = build_workload(_spec(seed=8), PromptMaker())
    assert [c.turns[0].text for c in other.conversations] != [c.turns[0].text for c in first.conversations]
    images = [image for c in first.conversations for image in c.turns[0].images]
    assert len(images) == 24 and first.num_unique_images + first.num_repeated_images == 24
    assert {(i.width, i.height) for i in images} <= {(64, 64), (96, 64)}
    # An image's index names its bytes: a repeat is the same bytes, a new image never is.
    by_index = {}
    for image in images:
        assert by_index.setdefault(image.index, image.data) == image.data
    assert len(set(by_index.values())) == first.num_unique_images


def test_repeat_ratio_bounds():
    none = build_workload(_spec(repeat_ratio=0.0), PromptMaker())
    assert none.num_repeated_images == 0 and none.num_unique_images == 24
    every = build_workload(_spec(repeat_ratio=1.0), PromptMaker())
    assert every.num_unique_images == 1 and every.num_repeated_images == 23
    text_only = build_workload(_spec(images_per_request=0, image_sizes=()), PromptMaker())
    assert all(c.turns[0].images == () for c in text_only.conversations)


def test_a_workload_with_clips_repeats_them_and_keeps_its_images():
    """Clips come from a stream of their own: adding them leaves the images and texts as they were;
    a repeated clip is the same bytes; each knows how many frames the server samples from it."""
    clips = _spec(num_requests=6, turns=2, videos_per_request=1, video_sizes=(ImageSize(64, 48),), video_seconds=3,
                  video_fps=4, repeat_ratio=0.5, num_warmup=1)
    workload = build_workload(clips, PromptMaker())
    assert workload == build_workload(clips, PromptMaker())
    plain = build_workload(_spec(num_requests=6, turns=2, repeat_ratio=0.5, num_warmup=1), PromptMaker())
    assert [(t.text, t.images) for c in workload.conversations for t in c.turns] == \
        [(t.text, t.images) for c in plain.conversations for t in c.turns]
    videos = [c.turns[0].videos[0] for c in workload.conversations]
    assert all(t.videos == () for c in workload.conversations for t in c.turns[1:])  # later turns resend them
    assert workload.num_unique_videos + workload.num_repeated_videos == len(videos) == 3
    assert {v.index: v.data for v in videos}.keys() == set(range(workload.num_unique_videos))
    assert len({v.data for v in videos}) == workload.num_unique_videos
    # 12 frames at 4 fps: 3 s, sampled at 2 fps -> 6 frames (transformers' rule, epd.video.sample_indices).
    assert {(v.num_frames, v.sampled_frames, v.width, v.height) for v in videos} == {(12, 6, 64, 48)}
    (warm,) = workload.warmup
    assert warm.videos[0].index == -1 and warm.videos[0].data not in {v.data for v in videos}


def test_a_clip_goes_as_a_video_part_and_as_a_video_url():
    from bench.load import chat_body, user_message
    from bench.workload import BenchVideo, Turn

    clip = BenchVideo(0, 64, 48, 8, 4.0, 4, b"\x00\x00\x00\x18ftypisom")
    message = user_message(Turn("what happens?", (), (clip,)))
    assert [p.WhichOneof("part") for p in message.content] == ["video", "text"]
    assert message.content[0].video.data == clip.data
    from epd.v1 import epd_pb2

    body = chat_body(epd_pb2.GenerateRequest(messages=[message]))
    assert body["messages"][0]["content"][0] == {"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64,AAAAGGZ0eXBpc29t"}}


def test_video_figures_per_frame_and_ttft_fresh_beside_from_the_store():
    def clip_request(ttft: float, encoded: int, encode_s: float, images_encoded: int = 0) -> RequestRecord:
        return _record(0.0, [ttft], 1, ttft, videos=1, video_tokens=40, video_frames=8, video_chunks=2,
                       video_chunks_encoded=encoded, images_encoded=images_encoded, stages={"encode_s": encode_s})

    rows = [clip_request(2.0, 2, 0.8), clip_request(3.0, 2, 1.6), clip_request(0.5, 0, 0.0),
            clip_request(2.5, 1, 0.4),  # half its chunks from the store: neither figure
            clip_request(4.0, 2, 3.0, images_encoded=1)]  # an image encoded too: encode_s is not the clip's alone
    video = stage_figures(rows)["video"]
    assert (video["videos"], video["chunks"], video["chunks_encoded"], video["video_tokens"]) == (5, 10, 7, 200)
    assert video["encode_ms_per_frame"]["p50"] == pytest.approx(150.0)  # 100 and 200 ms per frame
    assert video["ttft_s_clips_encoded"]["p50"] == pytest.approx(2.5)
    assert video["ttft_s_clips_from_store"]["p50"] == pytest.approx(0.5)
    assert "video" not in stage_figures([_record(0.0, [0.1], 1, 0.2)])


def test_conversations_split_the_requests():
    assert turns_per_conversation(5, 2) == [2, 2, 1]
    assert turns_per_conversation(6, 3) == [3, 3]
    workload = build_workload(_spec(num_requests=7, turns=3), PromptMaker())
    assert [len(c.turns) for c in workload.conversations] == [3, 3, 1]
    for conversation in workload.conversations:  # new images only in the first turn
        assert len(conversation.turns[0].images) == 2
        assert all(turn.images == () for turn in conversation.turns[1:])


def test_poisson_arrivals():
    times = arrival_times(4000, 20.0, seed=3)
    assert times == arrival_times(4000, 20.0, seed=3)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert all(gap > 0 for gap in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20.0, rel=0.1)
    # Exponential gaps: the standard deviation equals the mean.
    mean = sum(gaps) / len(gaps)
    assert (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 == pytest.approx(mean, rel=0.1)
    assert arrival_times(3, None, seed=3) == [0.0, 0.0, 0.0]


def test_prompt_fits_the_token_count(tiny_model_dir):
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    maker = PromptMaker.from_model_dir(tiny_model_dir)
    for target in (1, 17, 200):
        text = maker.make(random.Random(target), target)
        count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert target - 5 <= count <= target, (target, count)
    assert len(PromptMaker().make(random.Random(0), 30).split()) == 30


def _record(sent: float, token_times: list[float], tokens: int, done: float, **fields) -> RequestRecord:
    return RequestRecord(conversation=0, turn=0, sent_s=sent, token_times_s=token_times, output_tokens=tokens,
                         done_s=done, **fields)


def test_request_metrics_and_goodput():
    fast = _record(10.0, [10.1, 10.2, 10.4], 5, 10.5)  # the last chunk carries three tokens
    assert fast.ttft_s == pytest.approx(0.1)
    assert fast.itl_s == pytest.approx([0.1, 0.2])
    assert fast.e2e_s == pytest.approx(0.5)
    assert fast.tpot_s == pytest.approx(0.4 / 4)
    slow = _record(0.0, [2.0, 3.0], 2, 3.0)
    one_token = _record(0.0, [0.05], 1, 0.05)
    assert one_token.tpot_s is None and one_token.itl_s == []
    failed = _record(0.0, [], 0, 1.0, error="UNAVAILABLE: gone")

    figures = summarize([fast, slow, one_token, failed], duration_s=4.0, slo=Slo(ttft_s=0.5, tpot_s=0.5))
    assert (figures["num_requests"], figures["completed"], figures["failed"]) == (4, 3, 1)
    assert figures["errors"] == ["conversation 0 turn 0: UNAVAILABLE: gone"]
    assert figures["output_tokens_total"] == 8
    assert figures["throughput_tok_s"] == pytest.approx(2.0)
    assert figures["request_throughput"] == pytest.approx(0.75)
    assert figures["goodput"] == pytest.approx(2 / 4.0)  # fast and one_token meet both SLOs, slow misses TTFT
    assert figures["ttft_s"]["p50"] == pytest.approx(0.1)
    assert summarize([fast, slow], 4.0, Slo())["goodput"] == pytest.approx(0.5)  # no SLO: every success counts


def test_stage_ratios_are_medians_over_the_requests_they_apply_to():
    def with_stages(encoded: int, **stages) -> RequestRecord:
        return _record(0.0, [0.1], 1, 0.2, images_encoded=encoded, images_cached=1 - min(encoded, 1), stages=stages)

    # encoded, encode, store write, store read, prefill, handoff, handoff bytes
    rows = [(1, 1.0, 0.1, 0.1, 1.0, 0.5, 10), (1, 2.0, 0.2, 0.4, 2.0, 0.2, 10), (2, 1.0, 0.5, 0.5, 1.0, 0.3, 10),
            (0, 0.0, 0.0, 0.3, 1.0, 0.0, 0)]  # the last one: a cache hit, and no handoff
    records = [with_stages(n, encode_s=e, store_write_s=w, store_read_s=r, prefill_s=p, handoff_s=h, handoff_bytes=b)
               for n, e, w, r, p, h, b in rows]
    figures = stage_figures(records)
    assert figures["store_overhead_ratio"] == pytest.approx(0.3)  # median of 0.2, 0.3, 1.0
    assert figures["handoff_overhead_ratio"] == pytest.approx(0.3)  # median of 0.5, 0.1, 0.3
    assert (figures["images_encoded"], figures["images_cached"]) == (4, 1)
    assert stage_figures([with_stages(0, prefill_s=1.0)])["store_overhead_ratio"] is None


# ---------------------------------------------------------------- argument errors


@pytest.mark.parametrize("argv,message", [
    (["--image-sizes", "448"], "argument --image-sizes: expected WIDTHxHEIGHT[:WEIGHT], got '448'"),
    (["--request-rate", "2"], "argument --request-rate: not allowed with argument --concurrency"),
    (["--repeat-ratio", "1.5"], "argument --repeat-ratio: must be in [0, 1], got 1.5"),
    (["--output-tokens", "0"], "argument --output-tokens: must be in [1, 1000000], got 0"),
    (["--baseline", "transformers"], "--baseline transformers runs on local weights: give --model DIR"),
    (["--dtype", "bfloat16"], "--dtype configure the local stack: use them with --model"),
    (["--baseline-threads", "1"], "--baseline-threads applies to --baseline transformers"),
    (["--images-per-request", "2"], "image_sizes: --image-sizes is needed"),
    (["--videos-per-request", "1"], "video_sizes: --video-sizes is needed"),
    (["--videos-per-request", "17"], "argument --videos-per-request: must be in [0, 16], got 17"),
    (["--video-seconds", "0"], "argument --video-seconds: must be in (0, 3600], got 0"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    base = {"--addr": "127.0.0.1:1", "--num-requests": "2", "--concurrency": "1", "--images-per-request": "0",
            "--prompt-tokens": "4", "--output-tokens": "2"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *[item for pair in base.items() for item in pair]])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_mode_and_missing_model(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--addr", "h:1", "--num-requests", "1", "--images-per-request", "0",
                  "--prompt-tokens", "4", "--output-tokens", "2"])
    assert exit_info.value.code == 2
    assert "one of the arguments --concurrency --request-rate is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--model", str(tmp_path), "--num-requests", "1", "--concurrency", "1",
                  "--images-per-request", "0", "--prompt-tokens", "4", "--output-tokens", "2"])
    assert exit_info.value.code == 2
    assert "is not a checkpoint directory (no config.json)" in capsys.readouterr().err


def test_help_and_decode_step_wiring(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "--request-rate" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "decode-step", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: epd bench decode-step" in out and "--batch-sizes" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "decode-step", "--model", "m", "--batch-sizes", "1,x"])
    assert exit_info.value.code == 2
    assert "expected comma-separated integers like 1,4,16, got '1,x'" in capsys.readouterr().err


# ---------------------------------------------------------------- real runs


def _check_figures(figures: dict, num_requests: int, output_tokens: int) -> None:
    assert figures["failed"] == 0, figures["errors"]
    assert figures["num_requests"] == num_requests
    assert figures["output_tokens_total"] == num_requests * output_tokens
    assert figures["duration_s"] > 0 and figures["throughput_tok_s"] > 0 and figures["request_throughput"] > 0
    for key in LATENCIES:
        p = figures[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
    assert figures["tpot_s"]["p50"] <= figures["e2e_s"]["p50"]
    assert all(r["output_tokens"] == output_tokens for r in figures["requests"])


def test_smoke_bench_local_stack_with_transformers_baseline(tiny_model_dir, tmp_path):
    """The CI smoke bench: its own stack, the baseline after it, JSON and PNG, no process left; the
    stack takes EPD_API_KEY and the internal token given, and neither is in the report or the output."""
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    api_key, token = "bench-api-key-for-the-test-5150", "bench-internal-token-for-the-test-8086"
    (tmp_path / "token").write_text(token)
    argv = [sys.executable, "-m", "control.cli", "bench", "--model", tiny_model_dir, "--num-requests", "4",
            "--concurrency", "2", "--image-sizes", "64x64,96x64", "--images-per-request", "1", "--prompt-tokens", "24",
            "--output-tokens", "8", "--baseline", "transformers", "--json", str(out_json), "--plot", str(out_png),
            "--slo-ttft", "30", "--seed", "11", "--baseline-threads", "1",
            "--internal-token-file", str(tmp_path / "token")]
    env = {**os.environ, "EPD_API_KEY": api_key}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    seen: dict[int, psutil.Process] = {}
    names: set[str] = set()
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        try:  # every descendant it ever had: Ray, the roles, the embedded redis-server
            for p in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(p.pid, p)
                names.add(p.name())
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    stdout, stderr = proc.communicate()
    _, alive = psutil.wait_procs(list(seen.values()), timeout=20)
    for p in alive:
        p.kill()
    assert proc.returncode == 0, stderr[-4000:]
    assert alive == [], f"epd bench left processes behind: {alive}"
    assert any("redis-server" in n for n in names) and any("raylet" in n for n in names), names  # a real stack ran

    text = out_json.read_text()
    for secret in (api_key, token):  # the report, and everything the command and every role printed
        assert secret not in text and secret not in stdout and secret not in stderr, secret
    report = json.loads(text)
    security = report["config"]["stack"]["serve"]["security"]
    assert security["api_key"] == "***" and security["internal_token"] == "***"  # both set, neither shown
    for key in ("throughput_tok_s", "request_throughput", "ttft_s", "tpot_s", "itl_s", "e2e_s", "num_requests",
                "failed", "output_tokens_total", "duration_s", "goodput", "store_overhead_ratio",
                "handoff_overhead_ratio", "cached_tokens", "images_encoded", "images_cached", "config", "machine",
                "date", "baseline", "speedup_throughput", "ttft_ratio"):
        assert key in report, key
    _check_figures(report, 4, 8)
    _check_figures(report["baseline"], 4, 8)
    assert report["speedup_throughput"] > 0 and report["ttft_ratio"] > 0
    assert report["baseline"]["torch_threads"] == 1
    assert report["speedup_throughput"] == pytest.approx(
        report["throughput_tok_s"] / report["baseline"]["throughput_tok_s"])
    assert report["ratios"]["throughput_tok_s"] == pytest.approx(report["speedup_throughput"])
    e2e = report["e2e_s"]["p50"] / report["baseline"]["e2e_s"]["p50"]
    assert report["ratios"]["e2e_s"]["p50"] == pytest.approx(e2e)
    assert report["prompt_tokens_match"] is True
    for figures in (report, report["baseline"]):  # the load average while each system ran
        load = figures["load_avg"]
        assert load["samples"] >= 2 and 0 <= min(load["start"], load["end"]) <= load["max"]
    assert report["images_encoded"] == 4 and report["store_overhead_ratio"] > 0 and report["handoff_overhead_ratio"] > 0
    # The identical workload: each request's prompt is the same number of tokens in both systems.
    prompt_tokens = [r["prompt_tokens"] for r in report["requests"]]
    assert prompt_tokens == [r["prompt_tokens"] for r in report["baseline"]["requests"]]
    assert report["config"]["num_requests"] == 4 and report["config"]["image_sizes"] == ["64x64:1", "96x64:1"]
    assert report["config"]["baseline"] == "transformers" and report["config"]["slo_ttft_s"] == 30
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["memory_gib"] > 0
    assert "speedup (tok/s)" in stdout
    assert out_png.read_bytes()[:8] == PNG_SIGNATURE
    # The roofline: measured limits, the workload's bound by stage, and both systems' share of it.
    roof = report["roofline"]
    assert roof["limits"]["peak_flops"] > 1e9 and roof["limits"]["bandwidth"] > 1e8
    assert roof["roofline_s"] == pytest.approx(sum(roof["stages"].values())) and all(roof["stages"].values())
    assert roof["decode_steps"] == 2 * 7  # ceil(4 requests / 2 in flight) x (8 - 1) steps
    assert 0 < report["efficiency"] < 1 and 0 < report["baseline"]["efficiency"] < 1
    assert 0 < roof["ttft_work_ahead_s"]["p50"] <= roof["ttft_work_ahead_s"]["p99"]
    # Work ahead of a request: the encodes and prefills of the requests whose first token came
    # between its arrival and its own first token (itself included), from the rows of the report.
    firsts = [r["sent_s"] + r["ttft_s"] for r in report["requests"]]
    counts = [sum(r["sent_s"] <= f <= mine for f in firsts) for r, mine in zip(report["requests"], firsts)]
    assert 1 <= min(counts) and max(counts) <= 4
    per_request = (roof["stages"]["vision_s"] + roof["stages"]["prefill_s"]) / 4
    assert roof["ttft_work_ahead_s"]["p99"] == pytest.approx(per_request * float(np.percentile(counts, 99)))
    assert "roofline" in stdout and "efficiency" in stdout


def test_open_loop_with_repeated_images_hits_the_encoder_cache(addr, tmp_path):
    out_json = tmp_path / "rate.json"
    spec = _spec(num_requests=8, images_per_request=2, image_sizes=(ImageSize(80, 64),), prompt_tokens=12,
                 repeat_ratio=0.5, request_rate=5.0, seed=21)
    assert cli.main(["bench", "--addr", addr, "--num-requests", "8", "--request-rate", "5", "--image-sizes", "80x64",
                     "--images-per-request", "2", "--prompt-tokens", "12", "--output-tokens", "4",
                     "--repeat-ratio", "0.5", "--seed", "21", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    _check_figures(report, 8, 4)
    workload = build_workload(spec, PromptMaker())  # what the run sent: the same seed, the same images
    assert report["workload"]["repeated_images"] == workload.num_repeated_images > 0
    assert report["images_cached"] > 0
    # Every distinct image of a request was either encoded for it or found in the store.
    distinct = sum(len({image.index for image in c.turns[0].images}) for c in workload.conversations)
    assert report["images_encoded"] + report["images_cached"] == distinct
    assert report["images_encoded"] >= workload.num_unique_images
    assert report["duration_s"] >= workload.conversations[-1].arrival_s  # Poisson arrivals were honoured


def video_probe(data: bytes, model_dir: str):
    from epd import video
    from epd.modelinfo import ModelInfo

    return video.probe_video(data, ModelInfo.load(model_dir).video_settings())


def test_a_video_workload_reports_encode_per_frame_and_ttft_with_clips_from_the_store(addr, tiny_model_dir, tmp_path,
                                                                                     capsys):
    """Clips through the shared stack: every clip's chunks are encoded once, a repeated clip comes
    from the store (0 chunks encoded), and the report puts the two TTFTs side by side."""
    out_json = tmp_path / "video.json"
    spec = _spec(num_requests=4, images_per_request=0, image_sizes=(), prompt_tokens=8, repeat_ratio=0.5, seed=2,
                 videos_per_request=1, video_sizes=(ImageSize(64, 48),), video_seconds=2, video_fps=4)
    workload = build_workload(spec, PromptMaker())  # what the run sends: 3 clips, the first one twice
    assert (workload.num_unique_videos, workload.num_repeated_videos) == (3, 1)
    assert cli.main(["bench", "--addr", addr, "--num-requests", "4", "--concurrency", "1", "--images-per-request", "0",
                     "--videos-per-request", "1", "--video-sizes", "64x48", "--video-seconds", "2", "--video-fps", "4",
                     "--prompt-tokens", "8", "--output-tokens", "3", "--repeat-ratio", "0.5", "--seed", "2",
                     "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    _check_figures(report, 4, 3)
    video = report["video"]
    assert report["workload"]["unique_videos"] == 3 and report["workload"]["repeated_videos"] == 1
    assert video["videos"] == 4 and video["chunks"] == 4  # 4 frames sampled, 2 temporal patches: one chunk
    assert video["chunks_encoded"] == 3  # the repeat encodes nothing
    rows = report["requests"]
    assert [r["video_chunks_encoded"] for r in rows] == [1, 1, 0, 1]
    tokens = video_probe(workload.conversations[0].turns[0].videos[0].data, tiny_model_dir).num_tokens
    assert {(r["video_frames"], r["video_tokens"]) for r in rows} == {(4, tokens)}
    assert video["encode_ms_per_frame"]["p50"] > 0
    assert video["ttft_s_clips_encoded"]["p50"] > 0 and video["ttft_s_clips_from_store"]["p50"] > 0
    out = capsys.readouterr().out
    assert "clips 4: chunks encoded 3 of 4" in out and "with them from the store" in out


def test_multi_turn_resends_history(addr, tmp_path):
    out_json = tmp_path / "turns.json"
    assert cli.main(["bench", "--addr", addr, "--num-requests", "5", "--turns", "3", "--concurrency", "2",
                     "--image-sizes", "64x96", "--images-per-request", "1", "--prompt-tokens", "10",
                     "--output-tokens", "4", "--seed", "31", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    _check_figures(report, 5, 4)
    by_conversation: dict[int, list[dict]] = {}
    for row in report["requests"]:
        by_conversation.setdefault(row["conversation"], []).append(row)
    assert [len(rows) for _, rows in sorted(by_conversation.items())] == [3, 2]
    for rows in by_conversation.values():
        assert rows[0]["images_encoded"] == 1
        for before, after in zip(rows, rows[1:]):
            # Turn t+1 carries turn t's prompt, its answer and 10 new words (at least a token each) ...
            assert after["prompt_tokens"] > before["prompt_tokens"] + 10
            # ... and the first turn's image again, now served from the store.
            assert (after["images_encoded"], after["images_cached"]) == (0, 1)


def test_a_report_names_the_cpu_and_its_vector_instruction_sets():
    """The same machine type has come with and without AVX-512 BF16, which moves every bfloat16
    figure several-fold: a report says which it ran on."""
    from bench.run import VECTOR_FLAGS, machine

    flags = set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                break
    record = machine()
    assert record["cpu_flags"] == [f for f in VECTOR_FLAGS if f in flags]
    assert record["cpu_model"] and record["cpu_family"].isdigit()


def test_step_timeline_reads_a_replicas_metrics_interval_by_interval():
    """bench.step_timeline scrapes the Prometheus text a replica serves and turns its counters into
    per-interval deltas (steps, riding prompt tokens, mean rows), with the gauges at each end."""
    import http.server
    import threading

    from bench import step_timeline

    pages = iter([
        "epd_decode_steps_total 10\nepd_decode_batch_rows_total 40\nepd_decode_running_requests 4\n"
        "epd_decode_mixed_steps_total 1\nepd_decode_riding_prefill_tokens_total 200\n",
        'epd_decode_steps_total 15\nepd_decode_batch_rows_total 80\nepd_decode_running_requests 8\n'
        'epd_decode_mixed_steps_total 2\nepd_decode_riding_prefill_tokens_total 447\n'
        'epd_prefill_waiting_prompts 3\nepd_decode_requests_finished_total{reason="length"} 9\n',
    ])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = next(pages).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        samples = [(100.0, step_timeline.scrape(url)), (100.5, step_timeline.scrape(url))]
    finally:
        server.shutdown()
        server.server_close()
    assert "epd_decode_requests_finished_total" not in samples[1][1]  # labelled samples are left out
    [row] = step_timeline.rows(samples)
    assert row["t_s"] == 0.5 and row["steps"] == 5 and row["mixed_steps"] == 1 and row["riding_tokens"] == 247
    assert row["mean_rows"] == 8.0 and row["step_ms"] == 100.0 and row["running"] == 8
    assert row["waiting_prompts"] == 3 and row["prompt_tokens"] == 0
    assert "riding_tokens" in step_timeline.table([row])


def test_the_engine_step_bench_times_steps_of_the_whole_batch(tiny_model_dir):
    """``bench.decode_engine`` times steps of ``--batch`` rows: every prompt is prefilled before the
    first is submitted (submitted one by one between prefills, the early ones decoded and finished
    alone, and the timed steps were a row or two)."""
    from bench.decode_engine import time_engine_steps

    steps, wall, rows = time_engine_steps(tiny_model_dir, "float32", batch=4, tokens=6, prompt_tokens=40)
    assert steps >= 5 and wall > 0  # the first token comes from the prefill: 5 more steps at least
    assert rows / steps > 3.5  # (a step or two may run before the last request has joined)


def test_stack_tax_stops_every_process_under_it_and_resumes_them(monkeypatch):
    """``bench.stack_tax`` stops the stack as the processes under its own (Ray's daemons are the
    launcher's children, the actors theirs): a grandchild is found and stopped, and every one runs
    again after the block, also when the block raised."""
    from bench import stack_tax
    from epd.discovery import wait_until

    monkeypatch.setattr(stack_tax, "SETTLE_S", 0.05)
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60; wait"])
    try:
        assert wait_until(lambda: len(psutil.Process(parent.pid).children()) == 2, 10)
        tree = stack_tax.descendants(os.getpid())
        grandchildren = [c.pid for c in psutil.Process(parent.pid).children()]
        assert parent.pid in tree and set(grandchildren) <= set(tree)
        assert os.getpid() not in tree
        with pytest.raises(RuntimeError), stack_tax.stopped([parent.pid, *grandchildren]):
            assert all(psutil.Process(pid).status() == psutil.STATUS_STOPPED for pid in [parent.pid, *grandchildren])
            raise RuntimeError("a failed profile run")
        assert all(psutil.Process(pid).status() != psutil.STATUS_STOPPED for pid in [parent.pid, *grandchildren])
    finally:
        for child in psutil.Process(parent.pid).children():
            child.kill()
        parent.kill()
        parent.wait()


def test_stack_tax_reads_the_step_profiles_median(tiny_model_dir):
    """The line ``bench.decode_step_profile`` prints is the one ``bench.stack_tax`` parses: a real
    run on the tiny checkpoint gives a positive wall and CPU time, and (Linux keeps per-thread
    schedstat) how long its threads waited for a core."""
    from bench import stack_tax

    wall, cpu, waited = stack_tax.profile(tiny_model_dir, "float32",
                                          ["--batch", "2", "--context", "16", "--threads", "1", "--steps", "4"])
    assert wall > 0 and cpu > 0
    assert waited is not None and waited >= 0


def test_tokenizer_sizes_the_prompts_of_a_run_against_an_address(tiny_model_dir):
    """With --addr there is no checkpoint to count tokens with unless --tokenizer names one: the
    prompts are then as long as asked in the model's tokens, not one token a word."""
    from transformers import AutoTokenizer

    from bench.run import BenchConfig, prompt_maker

    spec = dict(addr="127.0.0.1:1", num_requests=2, concurrency=1, images_per_request=0, prompt_tokens=40,
                output_tokens=4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def counts(config):
        workload = build_workload(config.workload_spec(), prompt_maker(config))
        return [len(tokenizer(turn.text, add_special_tokens=False)["input_ids"])
                for conversation in workload.conversations for turn in conversation.turns]

    sized = counts(BenchConfig(**spec, tokenizer_dir=tiny_model_dir))
    assert all(35 <= count <= 40 for count in sized), sized
    estimated = counts(BenchConfig(**spec))  # 40 words: the tiny tokenizer splits words into several tokens
    assert all(count > 40 for count in estimated), estimated


def test_a_tokenizer_dir_that_does_not_load_is_one_line(tmp_path):
    from tests.conftest import epd
    from tests.test_cli_errors import assert_one_line_error

    args = ["bench", "--addr", "127.0.0.1:1", "--num-requests", "1", "--concurrency", "1",
            "--images-per-request", "0", "--prompt-tokens", "8", "--output-tokens", "2"]
    assert_one_line_error(epd(*args, "--tokenizer", str(tmp_path / "missing")), "epd bench: error:",
                          "--tokenizer", "not a directory")
    assert_one_line_error(epd(*args, "--tokenizer", str(tmp_path)), "epd bench: error:",
                          "--tokenizer", "no tokenizer loads from it")
