"""Fuzzing the real router: a running `epd serve` of the tiny model gets thousands of generated
requests (every field of GenerateRequest: roles, mixed text and image parts, empty parts, control
tokens and odd Unicode in text, images of odd sizes and formats, mutated and truncated image bytes,
sampling and logits-processing values in and far out of range, stop strings and stop tokens,
max_pixels, thinking, request ids, completion prompts as text or token ids, cache salts, names).

Only OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED or UNAUTHENTICATED may come back; INTERNAL, UNKNOWN,
any other status, or no answer within a generous deadline fails the test. Afterwards the stack
still reports SERVING and answers a normal request exactly as transformers does.

The stack runs with small output limits (`--max-tokens-limit 6 --default-max-tokens 3`), so a
request the router accepts costs a few decode steps: 2,000 examples in the default suite (fixed
seed: `derandomize`, no example database), 20,000 more behind the slow marker.
"""

from __future__ import annotations

import io
import random
import struct

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from bench.synthetic import make_image
from epd import rpc
from epd.tokenizer_build import SPECIAL_TOKENS, THINK_TOKENS
from epd.v1 import epd_pb2, epd_pb2_grpc
from tests.conftest import serving

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.UNAUTHENTICATED}
DEADLINE_S = 120.0  # far beyond any request here: a call without an answer by then is a hang
MAX_TOKENS_LIMIT = 6


@pytest.fixture(scope="module")
def fuzz_stack(tiny_model_dir, tmp_path_factory):
    with serving(tiny_model_dir, "--encoders", "1", "--max-tokens-limit", str(MAX_TOKENS_LIMIT),
                 "--default-max-tokens", "3", "--max-images-per-request", "4",
                 log_path=str(tmp_path_factory.mktemp("logs") / "fuzz-serve.log")) as server:
        channel = rpc.channel(server.address)
        yield server, epd_pb2_grpc.RouterStub(channel)
        channel.close()


# ---------------------------------------------------------------- images


def _encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _oriented_jpeg(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _encode(Image.open(io.BytesIO(make_image(96, 40, seed=orientation))), "JPEG", exif=exif.tobytes())


def _base_images() -> list[bytes]:
    """Valid files of every accepted format and many modes and shapes, each small."""
    rgb = Image.open(io.BytesIO(make_image(48, 32, seed=1))).convert("RGB")
    frames = [Image.new("P", (20, 12), i) for i in range(3)]
    animated = io.BytesIO()
    frames[0].save(animated, "GIF", save_all=True, append_images=frames[1:])
    palette = rgb.quantize(16)
    palette.info["transparency"] = 2
    return [
        make_image(64, 64, seed=2),
        make_image(1, 1, seed=3),  # enlarged to the minimum
        make_image(300, 2, seed=4),  # aspect 150:1, allowed
        make_image(2, 500, seed=5),  # aspect 250:1, refused
        _encode(rgb, "JPEG", quality=30),
        _encode(rgb.convert("CMYK"), "JPEG"),
        _encode(rgb.convert("L"), "JPEG"),
        _encode(rgb, "WEBP"),
        _encode(rgb.convert("RGBA"), "WEBP", lossless=True),
        _encode(rgb, "BMP"),
        _encode(rgb.convert("1"), "BMP"),
        _encode(rgb.convert("RGBA"), "PNG"),
        _encode(rgb.convert("LA"), "PNG"),
        _encode(rgb.convert("I;16"), "PNG"),
        _encode(rgb.convert("1"), "PNG"),
        _encode(palette, "PNG"),
        _encode(palette, "GIF"),
        animated.getvalue(),
        _encode(rgb, "TIFF"),  # a format the router refuses
        *(_oriented_jpeg(orientation) for orientation in (3, 6, 8, 0, 200)),
        struct.pack(">II", 0x89504E47, 0x0D0A1A0A) + b"\x00" * 40,  # a PNG signature and nothing else
        b"GIF89a" + b"\xff\xff\xff\x7f" + b"\x00" * 20,  # a GIF header claiming 65535x32767
    ]


BASE_IMAGES = _base_images()


@st.composite
def images(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(BASE_IMAGES)))
    how = draw(st.sampled_from(["as-is", "as-is", "as-is", "flip", "flip", "truncate", "splice", "random", "empty"]))
    if how == "truncate":
        del data[draw(st.integers(0, max(0, len(data) - 1))):]
    elif how == "flip":
        rng = random.Random(draw(st.integers(0, 2**32 - 1)))
        for _ in range(draw(st.integers(1, 8))):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif how == "splice":
        at = draw(st.integers(0, len(data)))
        data[at:at] = draw(st.binary(max_size=64))
    elif how == "random":
        data = bytearray(draw(st.binary(max_size=256)))
    elif how == "empty":
        data = bytearray()
    return bytes(data)


# ---------------------------------------------------------------- text and the rest

CONTROL = [*SPECIAL_TOKENS, *THINK_TOKENS, "<|im_", "start|>", "<|", "|>", "\U000f0000", "\U000f000060\U000f0000"]
ODD = ["\x00", "\u202e", "\ufeff", "\ufffd", "\u0301", "\U0001f600", "\U0010ffff", "\r\n", "\t", "e\u0301",
       "\u1100\u1161\u11a8", "{{ messages }}", "{% for %}", "ﷺ"]
# Rarely, text near and far past the context window (8192 tokens; ~655k characters is the bound
# past which the router refuses text without tokenizing it).
LONG = ["word " * 1500, "word " * 9000, "\u00e9" * 9000, "x" * 700_000]
TEXT = st.lists(st.one_of(st.text(st.characters(exclude_categories=("Cs",)), max_size=24),
                          st.sampled_from(CONTROL), st.sampled_from(ODD),
                          st.integers(0, 63).flatmap(lambda n: st.sampled_from(LONG) if n == 0 else st.just(""))),
                max_size=6).map("".join)
def _mostly(valid, invalid):
    """Usually ``valid`` (so that many requests get through to the model), one time in eight ``invalid``."""
    return st.integers(0, 7).flatmap(lambda n: invalid if n == 7 else valid)


# user twice as often: a conversation with no user turn is one refusal (the template's), often enough already
ROLES = _mostly(st.sampled_from(["user", "user", "system", "assistant"]), st.sampled_from(["", "User", "root"]))


@st.composite
def parts(draw) -> epd_pb2.ContentPart:
    kind = draw(st.sampled_from(["text", "text", "text", "image", "none"]))
    if kind == "text":
        return epd_pb2.ContentPart(text=draw(TEXT))
    if kind == "image":
        return epd_pb2.ContentPart(image=draw(images()))
    return epd_pb2.ContentPart()  # no part set at all


def _optional(strategy):
    return st.one_of(st.none(), strategy)


ANY_FLOAT = st.one_of(st.floats(width=32), st.sampled_from([float("nan"), float("inf"), -0.0, 1e-45, 3e38]))
INT32 = st.integers(-2**31, 2**31 - 1)


@st.composite
def requests(draw) -> epd_pb2.GenerateRequest:
    messages = draw(st.lists(st.builds(
        lambda role, content, name: epd_pb2.ChatMessage(role=role, content=content, name=name),
        ROLES, st.lists(parts(), min_size=1, max_size=4), _mostly(st.just(""), TEXT)),
        min_size=1, max_size=4)) if draw(st.integers(0, 31)) else []
    sampling = epd_pb2.SamplingParams(
        stop=draw(st.lists(TEXT, max_size=3)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(_mostly(st.integers(0, 20), st.integers(0, 2**32 - 1))),
    )
    values = {
        "max_tokens": draw(_optional(_mostly(st.integers(1, MAX_TOKENS_LIMIT), INT32))),
        "temperature": draw(_optional(_mostly(st.floats(0, 2, width=32), ANY_FLOAT))),
        "top_p": draw(_optional(_mostly(st.floats(0, 1, exclude_min=True, width=32), ANY_FLOAT))),
        "top_k": draw(_optional(_mostly(st.integers(0, 50), INT32))),
        "seed": draw(_optional(st.integers(0, 2**64 - 1))),
        "min_p": draw(_optional(_mostly(st.floats(0, 1, width=32), ANY_FLOAT))),
        "presence_penalty": draw(_optional(_mostly(st.floats(-2, 2, width=32), ANY_FLOAT))),
        "frequency_penalty": draw(_optional(_mostly(st.floats(-2, 2, width=32), ANY_FLOAT))),
        "repetition_penalty": draw(_optional(_mostly(st.floats(0.5, 2, width=32), ANY_FLOAT))),
        # within any max_tokens a request may draw (a larger one is one more refusal, already covered)
        "min_tokens": draw(_optional(_mostly(st.integers(0, 1), st.integers(0, 2**32 - 1)))),
    }
    token = _mostly(st.integers(0, 300), INT32)
    sampling.stop_token_ids.extend(draw(st.lists(token, max_size=3)))
    for key, bias in draw(st.dictionaries(token, _mostly(st.floats(-100, 100, width=32), ANY_FLOAT), max_size=3)).items():
        sampling.logit_bias[key] = bias
    for name, value in values.items():
        if value is not None:
            setattr(sampling, name, value)
    request = epd_pb2.GenerateRequest(request_id=draw(TEXT), messages=messages, sampling=sampling,
                                      enable_thinking=draw(st.booleans()), cache_salt=draw(_mostly(st.just(""), TEXT)),
                                      return_prompt_token_ids=draw(st.booleans()))
    completion = draw(st.integers(0, 7))  # now and then a completion's prompt instead (or beside the messages)
    if completion == 1:
        request.prompt = draw(TEXT)
    elif completion == 2:
        request.prompt_token_ids.extend(draw(st.lists(token, max_size=8)))
    max_pixels = draw(_optional(_mostly(st.sampled_from([0, 65536, 65537, 200000]), st.integers(0, 2**64 - 1))))
    if max_pixels is not None:
        request.max_pixels = max_pixels
    return request


# ---------------------------------------------------------------- the property


def _call(stub, request: epd_pb2.GenerateRequest) -> grpc.StatusCode:
    """Send one request; its final status (OK once the summary has arrived)."""
    try:
        events = list(stub.Generate(request, timeout=DEADLINE_S))
    except grpc.RpcError as error:
        if error.code() not in ALLOWED:
            raise AssertionError(f"{error.code().name}: {error.details()}\nrequest: {_describe(request)}") from None
        return error.code()
    assert events and events[-1].HasField("summary"), f"no summary for {_describe(request)}"
    summary = events[-1].summary
    assert summary.finish_reason in ("eos", "stop", "length"), summary
    assert summary.completion_tokens <= MAX_TOKENS_LIMIT
    return grpc.StatusCode.OK


def _describe(request: epd_pb2.GenerateRequest) -> str:
    shown = epd_pb2.GenerateRequest()
    shown.CopyFrom(request)
    for message in shown.messages:
        for part in message.content:
            if part.WhichOneof("part") == "image":
                part.image = part.image[:48] + (f"...({len(part.image)} bytes)".encode() if len(part.image) > 48 else b"")
    return str(shown)[:4000]


COMMON = dict(derandomize=True, database=None, deadline=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])


def _check_healthy(fuzz_stack, oracle) -> None:
    server, stub = fuzz_stack
    assert rpc.is_serving(server.address), "the router stopped reporting SERVING"
    prompt = "After the storm: what is in this picture?"
    image = make_image(224, 160, seed=99)
    expected, _, prompt_len = oracle.generate(prompt, [image], max_new_tokens=MAX_TOKENS_LIMIT)
    request = epd_pb2.GenerateRequest(
        messages=[epd_pb2.ChatMessage(role="user", content=[epd_pb2.ContentPart(image=image),
                                                            epd_pb2.ContentPart(text=prompt)])],
        sampling=epd_pb2.SamplingParams(max_tokens=MAX_TOKENS_LIMIT))
    events = list(stub.Generate(request, timeout=DEADLINE_S))
    assert [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids] == expected
    assert events[-1].summary.prompt_tokens == prompt_len


def _run(fuzz_stack, oracle, max_examples: int) -> None:
    _, stub = fuzz_stack
    seen: dict[str, int] = {}

    @settings(max_examples=max_examples, **COMMON)
    @given(requests())
    def property_(request):
        code = _call(stub, request)
        seen[code.name] = seen.get(code.name, 0) + 1

    property_()
    print(f"fuzz: {sum(seen.values())} requests: {seen}")
    # The generator reaches both sides of the router: accepted requests and refused ones.
    assert seen.get("OK", 0) >= max_examples // 20 and seen.get("INVALID_ARGUMENT", 0) >= max_examples // 20, seen
    _check_healthy(fuzz_stack, oracle)


def test_generated_requests_get_only_allowed_statuses_and_the_router_stays_healthy(fuzz_stack, oracle):
    _run(fuzz_stack, oracle, max_examples=2000)


@pytest.mark.slow
def test_many_more_generated_requests(fuzz_stack, oracle):
    _run(fuzz_stack, oracle, max_examples=20000)
