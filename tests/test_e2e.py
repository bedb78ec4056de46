"""The full E/P/D path against real processes: `epd serve` (Ray local, embedded redis-server,
gRPC on loopback ports chosen at run time) checked token by token against transformers."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading

import grpc
import pytest
import torch
from PIL import Image

from bench.synthetic import make_image
from epd import client

SQUARE = make_image(448, 448, seed=1)
WIDE = make_image(640, 200, seed=2)
TALL = make_image(180, 500, seed=3)
SMALL = make_image(100, 80, seed=4)  # below min_pixels: enlarged
BIG = make_image(1024, 1024, seed=5)  # reduced by a per-request max_pixels
CAP = 128 * 32 * 32


def phone_portrait_jpeg(width: int = 640, height: int = 360, seed: int = 6) -> bytes:
    """A portrait phone photo as phones store it: landscape pixels plus EXIF orientation 6 (turn
    90 degrees clockwise to view)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    Image.open(io.BytesIO(make_image(width, height, seed=seed))).save(out, "JPEG", quality=90, exif=exif.tobytes())
    return out.getvalue()


ROTATED = phone_portrait_jpeg()

PARITY_CASES = [
    pytest.param("Hello! Who are you?", [], None, id="text-only"),
    pytest.param("What is in this picture?", [SQUARE], None, id="square"),
    pytest.param("Describe the scene.", [WIDE], None, id="wide"),
    pytest.param("Read the text.", [TALL], None, id="tall"),
    pytest.param("Tiny image?", [SMALL], None, id="below-min-pixels"),
    pytest.param("Summarise.", [BIG], CAP, id="max-pixels-capped"),
    pytest.param("Compare the three images.", [SQUARE, WIDE, TALL], None, id="three-images"),
    pytest.param("Which way is up?", [ROTATED], None, id="exif-rotated-phone-jpeg"),
]


def run(addr, prompt, images=(), max_pixels=None, **sampling) -> client.GenerateResult:
    return client.generate(addr, client.user_request(prompt, list(images), max_pixels=max_pixels, **sampling),
                           timeout_s=120)


@pytest.mark.parametrize("prompt,images,max_pixels", PARITY_CASES)
def test_greedy_parity_with_transformers(addr, oracle, prompt, images, max_pixels):
    expected, logits, prompt_len = oracle.generate(prompt, images, max_new_tokens=32, max_pixels=max_pixels)
    result = run(addr, prompt, images, max_pixels, max_tokens=32, temperature=0.0, logprobs=20)

    assert result.token_ids == expected
    assert result.summary.prompt_tokens == prompt_len
    # First-token logits: our logprobs are log_softmax(logits); compare the top 20 in fp32.
    reference = torch.log_softmax(logits, dim=-1)
    first = result.logprobs[0]
    ids = [t.token_id for t in first.top]
    assert ids == torch.topk(reference, 20).indices.tolist()
    ours = torch.tensor([t.logprob for t in first.top])
    assert torch.allclose(ours, reference[ids], atol=1e-4, rtol=0)
    assert result.summary.finish_reason in ("length", "eos")


def test_concurrent_requests_each_match_their_own_run(addr, oracle):
    """Requests of different prompt lengths and answer lengths share decode steps (continuous
    batching: they join and leave the batch at different steps); each matches its own run."""
    cases = [("One.", [SQUARE], 16), ("Two, a little longer prompt here.", [WIDE], 6), ("Three", [], 24),
             ("Four: tell me everything you can about these two.", [TALL, SMALL], 11), ("Five", [], 3)]
    expected = [oracle.generate(p, i, max_new_tokens=n)[0] for p, i, n in cases]
    results: list = [None] * len(cases)

    def worker(n):
        results[n] = run(addr, cases[n][0], cases[n][1], max_tokens=cases[n][2]).token_ids

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected


def test_summary_counts_image_tokens(addr):
    result = run(addr, "How many tokens?", [make_image(448, 448, seed=11)], max_tokens=1)
    assert result.summary.image_tokens == 196
    assert result.summary.images == 1
    assert result.summary.completion_tokens == 1
    assert result.summary.finish_reason in ("length", "eos")
    assert result.summary.ttft_s > 0


def test_different_images_of_same_size_never_share_a_key(addr, oracle):
    a, b = make_image(448, 448, seed=21), make_image(448, 448, seed=22)
    both = run(addr, "Which differs?", [a, b], max_tokens=16, logprobs=5)
    swapped = run(addr, "Which differs?", [b, a], max_tokens=16, logprobs=5)
    same = run(addr, "Which differs?", [a, a], max_tokens=16, logprobs=5)
    assert both.summary.images_encoded == 2
    assert both.token_ids == oracle.generate("Which differs?", [a, b], max_new_tokens=16)[0]
    assert swapped.token_ids == oracle.generate("Which differs?", [b, a], max_new_tokens=16)[0]
    # If b were served a's embedding, [a, b] would be the request [a, a]; if keys mixed the two up,
    # [b, a] would be [a, b]. Each pair's first-token distributions must differ by far more than rounding.
    assert _distance(both, same) > 1e-3
    assert _distance(both, swapped) > 1e-3


def _distance(a: client.GenerateResult, b: client.GenerateResult) -> float:
    """How far apart two requests' first-token top-k logprobs are (inf when the top-k differ)."""
    da = {t.token_id: t.logprob for t in a.logprobs[0].top}
    db = {t.token_id: t.logprob for t in b.logprobs[0].top}
    if da.keys() != db.keys():
        return float("inf")
    return max(abs(da[token] - db[token]) for token in da)


def test_same_image_is_encoded_once(addr):
    image = make_image(320, 240, seed=31)
    first = run(addr, "Twice in one prompt.", [image, image], max_tokens=2)
    assert (first.summary.images, first.summary.images_encoded) == (2, 1)
    again = run(addr, "And once more.", [image], max_tokens=2)
    assert again.summary.images_encoded == 0
    capped = run(addr, "Same bytes, another pixel cap: another embedding.", [image], max_pixels=65536, max_tokens=2)
    assert capped.summary.images_encoded == 1


def test_seeded_sampling_is_reproducible(addr):
    a = run(addr, "Tell a story.", [SQUARE], max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    b = run(addr, "Tell a story.", [SQUARE], max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    c = run(addr, "Tell a story.", [SQUARE], max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=8)
    assert a.token_ids == b.token_ids
    assert a.summary.seed == 7
    assert a.token_ids != c.token_ids


def test_stop_string_ends_the_text_before_it(addr):
    full = run(addr, "Say something long.", max_tokens=32, ignore_eos=True)
    text = full.text
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = run(addr, "Say something long.", max_tokens=32, ignore_eos=True, stop=[stop])
    assert cut.summary.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert stop not in cut.text


def test_ignore_eos_generates_exactly_max_tokens(addr):
    result = run(addr, "Count.", max_tokens=24, ignore_eos=True)
    assert len(result.token_ids) == 24
    assert result.summary.finish_reason == "length"


def _truncated_png() -> bytes:
    data = make_image(300, 300, seed=41)
    return data[: len(data) // 2]


def _bomb_png() -> bytes:
    out = io.BytesIO()
    Image.new("1", (9000, 9000)).save(out, format="PNG")  # 81M pixels, a few KB on disk
    return out.getvalue()


def _tiff() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(out, format="TIFF")
    return out.getvalue()


BAD_REQUESTS = [
    pytest.param(dict(images=[b"\x00not an image at all" * 10]), "not a recognized image format", id="corrupt-bytes"),
    pytest.param(dict(images=[b""]), "image 0: image is empty (0 bytes)", id="zero-byte-image"),
    pytest.param(dict(images=[_tiff()]), "unsupported image format 'TIFF'", id="unsupported-format"),
    pytest.param(dict(images=[_truncated_png()]), "corrupt or truncated", id="truncated-found-by-encoder"),
    pytest.param(dict(images=[_bomb_png()]), "above the decode limit", id="decompression-bomb"),
    pytest.param(dict(prompt="   "), "prompt is empty", id="empty-prompt"),
    pytest.param(dict(max_tokens=0), "max_tokens must be at least 1", id="max-tokens-zero"),
    pytest.param(dict(max_tokens=-5), "max_tokens must be at least 1", id="max-tokens-negative"),
    pytest.param(dict(max_tokens=100000), "max_tokens must be at most 4096", id="max-tokens-above-limit"),
    pytest.param(dict(prompt="token " * 20000), "longer than the context window", id="prompt-too-long"),
    pytest.param(dict(temperature=-1.0), "temperature must be", id="negative-temperature"),
    pytest.param(dict(temperature=float("nan")), "temperature must be", id="nan-temperature"),
    # The bound every front and epd generate share (epd.limits), in the same words.
    pytest.param(dict(temperature=1e9), "temperature must be in [0, 1e+06], got 1e+09", id="huge-temperature"),
    pytest.param(dict(top_p=1.5), "top_p must be in (0, 1]", id="top-p-above-one"),
    pytest.param(dict(top_k=-3), "top_k must be >= 0", id="negative-top-k"),
    pytest.param(dict(logprobs=99), "logprobs must be in [0, 20]", id="too-many-logprobs"),
    pytest.param(dict(images=[SQUARE], max_pixels=10), "max_pixels 10 is out of range", id="max-pixels-out-of-range"),
]


@pytest.mark.parametrize("bad,message", BAD_REQUESTS)
def test_bad_input_is_invalid_argument_and_loses_nothing(addr, bad, message):
    bad = dict(bad)
    prompt = bad.pop("prompt", "Hello")
    images = bad.pop("images", [])
    max_pixels = bad.pop("max_pixels", None)
    with pytest.raises(grpc.RpcError) as raised:
        run(addr, prompt, images, max_pixels, **bad)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in raised.value.details()
    good = run(addr, "Still serving?", [SMALL], max_tokens=4)
    assert len(good.token_ids) >= 1 and good.summary.finish_reason in ("length", "eos")


def test_cli_generate_json(addr, tmp_path, oracle):
    path = tmp_path / "square.png"
    path.write_bytes(SQUARE)
    out = subprocess.run(
        [sys.executable, "-m", "control.cli", "generate", "--addr", addr, "--prompt", "What is in this picture?",
         "--image", str(path), "--max-tokens", "8", "--temperature", "0", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("token_ids", "text", "prompt_tokens", "image_tokens", "finish_reason", "ttft_s"):
        assert key in result
    assert result["token_ids"] == oracle.generate("What is in this picture?", [SQUARE], max_new_tokens=8)[0]
    assert result["image_tokens"] == 196


def test_cli_generate_prompt_file_carries_what_a_command_line_cannot(addr, tmp_path, oracle):
    """--prompt-file: the same answer as --prompt; a 5 MB prompt (past what argv takes) reaches the
    router, which refuses it for the context window in one line; - reads stdin."""
    prompt = "What is in this picture?"
    (tmp_path / "prompt.txt").write_text(prompt)
    (tmp_path / "square.png").write_bytes(SQUARE)
    base = [sys.executable, "-m", "control.cli", "generate", "--addr", addr, "--image", str(tmp_path / "square.png"),
            "--max-tokens", "8", "--json"]
    out = subprocess.run([*base, "--prompt-file", str(tmp_path / "prompt.txt")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["token_ids"] == oracle.generate(
        prompt, [SQUARE], max_new_tokens=8)[0]
    out = subprocess.run([*base, "--prompt-file", "-"], input=prompt, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout.strip().splitlines()[-1])["text"], out.stderr
    (tmp_path / "huge.txt").write_text("word " * 1_000_000)  # 5 MB
    out = subprocess.run([*base, "--prompt-file", str(tmp_path / "huge.txt")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("INVALID_ARGUMENT: "), out.stderr
    assert "context window" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_cli_generate_failure_names_the_status(addr, tmp_path):
    path = tmp_path / "broken.png"
    path.write_bytes(b"definitely not a png")
    out = subprocess.run(
        [sys.executable, "-m", "control.cli", "generate", "--addr", addr, "--prompt", "x", "--image", str(path)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert out.stderr.startswith("INVALID_ARGUMENT: image 0:")


def test_stop_string_in_the_first_token(addr, oracle):
    """A stop string that the first token (sampled by prefill) already completes: the answer is
    empty and the handed-off decode slot is released at once."""
    for seed in range(50, 70):  # the first prompt whose first token has printable text
        image = make_image(224, 224, seed=seed)
        full = run(addr, "Begin.", [image], max_tokens=8, ignore_eos=True)
        first_text = oracle.tokenizer.decode(full.token_ids[:1], skip_special_tokens=True)
        if first_text.strip() and "\ufffd" not in first_text:
            break
    else:
        raise AssertionError("no first token with printable text among 20 images")
    cut = run(addr, "Begin.", [image], max_tokens=8, ignore_eos=True, stop=[first_text])
    assert cut.summary.finish_reason == "stop"
    assert cut.text == ""
    assert cut.token_ids == full.token_ids[:1]
    assert run(addr, "Still serving?", max_tokens=2).summary.completion_tokens == 2
