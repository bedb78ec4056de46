"""Tests for epd.imaging: token table, parity with transformers, errors, keys."""

from __future__ import annotations

import io
import json
import random
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)

from epd.imaging import (
    ImageError,
    ImageInfo,
    ImageSettings,
    image_key,
    load_pixels,
    probe_image,
    smart_resize,
)

S = ImageSettings()
SCREENSHOT_CAP = 1280 * 32 * 32


# --------------------------------------------------------------------------- helpers


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def solid_png(width: int, height: int) -> bytes:
    return encode(Image.new("RGB", (width, height), (10, 120, 200)))


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode=mode)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb_png(width: int, height: int) -> bytes:
    """A ~100-byte PNG whose IHDR claims width x height RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat)
            + png_chunk(b"IEND", b""))


def reference(img: Image.Image, max_pixels: int = S.max_pixels) -> tuple[torch.Tensor, torch.Tensor]:
    proc = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": 65536, "longest_edge": max_pixels},
        image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=3, rescale_factor=1 / 255,
    )
    out = proc(images=[img], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


# --------------------------------------------------------------------------- token table


@pytest.mark.parametrize(
    "width,height,grid,tokens,resized",
    [
        (224, 224, (1, 16, 16), 64, (256, 256)),  # enlarged: below min_pixels
        (448, 448, (1, 28, 28), 196, (448, 448)),
        (896, 896, (1, 56, 56), 784, (896, 896)),
        (1280, 720, (1, 44, 80), 880, (1280, 704)),
    ],
)
def test_token_table(width, height, grid, tokens, resized):
    info = probe_image(solid_png(width, height), S)
    assert (info.width, info.height, info.format) == (width, height, "PNG")
    assert info.grid_thw == grid
    assert info.num_tokens == tokens
    assert (info.resized_width, info.resized_height) == resized
    assert info.merged_grid == (grid[1] // 2, grid[2] // 2)


def test_screenshot_with_and_without_cap():
    data = solid_png(1170, 2532)
    full = probe_image(data, S)
    assert (full.resized_height, full.resized_width) == hf_smart_resize(2532, 1170, 32, 65536, 16777216)
    assert (full.resized_width, full.resized_height) == (1184, 2528)
    assert full.num_tokens == 2923

    capped = probe_image(data, S.with_max_pixels(SCREENSHOT_CAP))
    assert (capped.resized_height, capped.resized_width) == hf_smart_resize(2532, 1170, 32, 65536, SCREENSHOT_CAP)
    assert capped.num_tokens == 1248 <= 1280
    assert capped.grid_thw == (1, 104, 48)


# --------------------------------------------------------------------------- smart_resize parity


def _sizes() -> list[tuple[int, int]]:
    rng = random.Random(1234)
    sizes = [(1, 1), (1, 200), (200, 1), (32, 6400), (6400, 32), (7, 1400), (50000, 250),
             (16, 16), (31, 33), (48, 48), (720, 1280), (2532, 1170), (4096, 4096), (20000, 20000)]
    for _ in range(3000):
        h = rng.randint(1, 20000)
        w = rng.randint(max(1, h // 200 + 1), min(20000, h * 200))
        sizes.append((h, w))
    return sizes


@pytest.mark.parametrize("max_pixels", [16777216, SCREENSHOT_CAP, 65536])
def test_smart_resize_matches_transformers(max_pixels):
    for h, w in _sizes():
        assert smart_resize(h, w, 32, 65536, max_pixels) == hf_smart_resize(h, w, 32, 65536, max_pixels), (h, w)


def test_smart_resize_aspect_ratio_limit():
    with pytest.raises(ValueError):
        hf_smart_resize(1, 201, 32, 65536, 16777216)
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(1, 201)
    with pytest.raises(ImageError, match="aspect ratio 250.0:1"):
        probe_image(solid_png(10000, 40), S)


# --------------------------------------------------------------------------- parity with transformers


def _cases() -> list[tuple[str, bytes, int]]:
    pal = noise(120, 90, seed=5).quantize(64)
    pal.info["transparency"] = 3
    grey = noise(333, 250, "L", seed=6)
    return [
        ("square", encode(noise(448, 448, seed=1)), S.max_pixels),
        ("wide", encode(noise(640, 200, seed=2)), S.max_pixels),
        ("tall", encode(noise(180, 700, seed=3)), S.max_pixels),
        ("small", encode(noise(60, 40, seed=4)), S.max_pixels),
        ("capped", encode(noise(700, 500, seed=7)), 65536 * 2),
        ("rgba", encode(noise(200, 150, "RGBA", seed=8)), S.max_pixels),
        ("gif", encode(pal, "GIF"), S.max_pixels),
        ("grey_jpeg", encode(grey, "JPEG", quality=85), S.max_pixels),
        ("webp", encode(noise(300, 200, seed=9), "WEBP"), S.max_pixels),
        ("bmp", encode(noise(100, 100, seed=10), "BMP"), S.max_pixels),
    ]


@pytest.mark.parametrize("name,data,max_pixels", _cases(), ids=[c[0] for c in _cases()])
def test_load_pixels_matches_transformers(name, data, max_pixels):
    settings = S.with_max_pixels(max_pixels) if max_pixels != S.max_pixels else S
    info = probe_image(data, settings)
    pixel_values, grid = load_pixels(data, settings)
    ref_values, ref_grid = reference(Image.open(io.BytesIO(data)), max_pixels)

    assert grid == info.grid_thw == tuple(ref_grid[0].tolist())
    assert pixel_values.dtype == torch.float32
    assert pixel_values.shape == (grid[1] * grid[2], 3 * 2 * 16 * 16)
    assert pixel_values.shape[0] == info.num_tokens * 4
    assert torch.equal(pixel_values, ref_values)


def test_capped_request_really_is_smaller():
    data = encode(noise(700, 500, seed=7))
    assert probe_image(data, S.with_max_pixels(65536 * 2)).num_tokens < probe_image(data, S).num_tokens


def test_sixteen_bit_greyscale_is_scaled_not_clipped():
    arr = np.full((64, 64), 128 * 256, dtype=np.uint16)  # mid grey in 16 bits
    data = encode(Image.fromarray(arr))
    pixel_values, _ = load_pixels(data, S)
    # 128/255 normalized with mean/std 0.5 is ~0.0039; PIL's clipping would give 1.0.
    assert pixel_values.abs().max().item() < 0.01


# --------------------------------------------------------------------------- errors


def test_empty():
    with pytest.raises(ImageError, match=r"image is empty \(0 bytes\)"):
        probe_image(b"", S)


def test_random_bytes():
    data = bytes(random.Random(0).randrange(256) for _ in range(2000))
    with pytest.raises(ImageError, match="not a recognized image format"):
        probe_image(data, S)
    with pytest.raises(ImageError, match="not a recognized image format"):
        load_pixels(data, S)


def test_tiff_refused():
    with pytest.raises(ImageError, match=r"unsupported image format 'TIFF'; supported: JPEG"):
        probe_image(encode(noise(32, 32), "TIFF"), S)


def test_truncated_png():
    data = encode(noise(256, 256, seed=11))
    cut = data[: len(data) * 2 // 3]
    assert probe_image(cut, S).grid_thw == (1, 16, 16)  # header is intact
    with pytest.raises(ImageError, match="corrupt or truncated"):
        load_pixels(cut, S)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_decompression_bomb_refused_from_header(monkeypatch):
    def no_decode(self):
        raise AssertionError("a bomb must not be decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    data = bomb_png(30000, 30000)
    assert len(data) < 200
    for fn in (probe_image, load_pixels):
        with pytest.raises(ImageError, match=r"image is 900000000 pixels, above the decode limit of 67108864"):
            fn(data, S)


def test_decode_limit_below_pil_limit_names_size():
    # Between our ceiling and PIL's: our own check fires with the full WxH message.
    data = bomb_png(9000, 8000)
    with _no_warnings():
        with pytest.raises(ImageError, match=r"image is 9000x8000 = 72000000 pixels, above the decode limit"):
            probe_image(data, S)
    small = ImageSettings(max_decoded_pixels=1000)
    with pytest.raises(ImageError, match=r"image is 100x100 = 10000 pixels, above the decode limit of 1000"):
        probe_image(solid_png(100, 100), small)


def test_pil_bomb_warning_never_escapes():
    # 100M pixels: above PIL's warning threshold (~89.5M) but below its error one.
    with _no_warnings():
        with pytest.raises(ImageError, match="above the decode limit"):
            probe_image(bomb_png(10000, 10000), S)


class _no_warnings:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self._log = self._cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        assert not [w for w in self._log if issubclass(w.category, Image.DecompressionBombWarning)]
        return False


@pytest.mark.parametrize("n", [1, 65535, 16777217, -5, 2.5])
def test_max_pixels_override_out_of_range(n):
    with pytest.raises(ImageError, match=r"max_pixels .* out of range; allowed: 65536\.\.16777216"):
        S.with_max_pixels(n)


def test_max_pixels_override_defaults():
    assert S.with_max_pixels(None) is S
    assert S.with_max_pixels(0) is S
    assert S.with_max_pixels(65536).max_pixels == 65536
    # A lowered setting cannot be raised again.
    with pytest.raises(ImageError):
        S.with_max_pixels(100000).with_max_pixels(200000)


# --------------------------------------------------------------------------- settings


def test_settings_validation_names_field():
    with pytest.raises(ValueError, match="patch_size"):
        ImageSettings(patch_size=0)
    with pytest.raises(ValueError, match="min_pixels"):
        ImageSettings(min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError, match="image_std"):
        ImageSettings(image_std=(0.5, 0.0, 0.5))
    with pytest.raises(ValueError, match="image_mean"):
        ImageSettings(image_mean=(0.5, 0.5))
    with pytest.raises(ValueError, match="resample"):
        ImageSettings(resample=9)
    with pytest.raises(ValueError, match="rescale_factor"):
        ImageSettings(rescale_factor=0)
    with pytest.raises(ValueError, match="max_decoded_pixels"):
        ImageSettings(max_decoded_pixels=10**12)


def test_from_preprocessor_config(tmp_path):
    cfg = {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
    }
    path = tmp_path / "preprocessor_config.json"
    path.write_text(json.dumps(cfg))
    assert ImageSettings.from_preprocessor_config(path) == S
    assert ImageSettings.from_preprocessor_config(str(path)) == S
    legacy = {"min_pixels": 3136, "max_pixels": 1003520, "patch_size": 14}
    got = ImageSettings.from_preprocessor_config(legacy)
    assert (got.min_pixels, got.max_pixels, got.patch_size) == (3136, 1003520, 14)
    with pytest.raises(ValueError, match="do_normalize"):
        ImageSettings.from_preprocessor_config({**cfg, "do_normalize": False})


def test_fingerprint():
    assert S.fingerprint() == ImageSettings().fingerprint()
    assert S.fingerprint() != ImageSettings(max_pixels=1 << 20).fingerprint()
    assert S.fingerprint() != ImageSettings(image_mean=(0.4, 0.5, 0.5)).fingerprint()
    # The decode ceiling decides acceptance only, not the pixels.
    assert S.fingerprint() == ImageSettings(max_decoded_pixels=1000).fingerprint()


# --------------------------------------------------------------------------- keys


def test_image_keys():
    a = encode(noise(64, 64, seed=1))
    b = encode(noise(64, 64, seed=2))
    key = image_key(a, S)
    assert len(key) == 64 and all(c in "0123456789abcdef" for c in key)
    assert image_key(a, S) == key
    assert image_key(bytes(a), ImageSettings()) == key
    assert image_key(b, S) != key
    assert image_key(a, S.with_max_pixels(SCREENSHOT_CAP)) != key


def test_image_info_properties():
    info = ImageInfo(1280, 720, "PNG", 1280, 704, (1, 44, 80))
    assert info.num_tokens == 880
    assert info.merged_grid == (22, 40)


# --------------------------------------------------------------------------- EXIF orientation


def with_orientation(img: Image.Image, orientation: int, fmt: str = "JPEG") -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(img, fmt, exif=exif.tobytes(), **({"quality": 90} if fmt == "JPEG" else {}))


def png_with_trailing_exif(img: Image.Image, orientation: int) -> bytes:
    """A PNG whose eXIf chunk comes after the pixel data (legal; Pillow reads it only on decode)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(img, "PNG")
    iend = data.rindex(b"IEND") - 4
    return data[:iend] + png_chunk(b"eXIf", exif.tobytes()[6:]) + data[iend:]  # tobytes starts with Exif\0\0


def upright_reference(data: bytes, max_pixels: int = S.max_pixels):
    """What transformers' load_image does first: ImageOps.exif_transpose."""
    from PIL import ImageOps

    return reference(ImageOps.exif_transpose(Image.open(io.BytesIO(data))), max_pixels)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_before_resizing_as_transformers_does(fmt, orientation):
    data = with_orientation(noise(640, 360, seed=31), orientation, fmt)
    info = probe_image(data, S)
    turned = orientation in (5, 6, 7, 8)
    assert (info.width, info.height) == ((360, 640) if turned else (640, 360))
    pixel_values, grid = load_pixels(data, S)
    ref_values, ref_grid = upright_reference(data)
    assert grid == info.grid_thw == tuple(ref_grid[0].tolist())
    assert torch.equal(pixel_values, ref_values)
    if orientation != 1:  # the orientation really changes what the model sees
        assert not torch.equal(pixel_values, reference(Image.open(io.BytesIO(data)))[0])


def test_phone_portrait_jpeg_counts_tokens_on_the_upright_size():
    """A phone's portrait photo: stored 1280x720 landscape with orientation 6 (rotate 90 clockwise)."""
    data = with_orientation(noise(1280, 720, seed=32), 6)
    info = probe_image(data, S)
    assert (info.width, info.height) == (720, 1280)
    assert info.grid_thw == (1, 80, 44) and info.num_tokens == 880


def test_png_exif_after_the_pixel_data_is_found_by_the_header_probe():
    data = png_with_trailing_exif(noise(300, 160, seed=33), 8)
    assert data.index(b"eXIf") > data.index(b"IDAT")
    info = probe_image(data, S)
    assert (info.width, info.height) == (160, 300)
    pixel_values, grid = load_pixels(data, S)
    ref_values, ref_grid = upright_reference(data)
    assert grid == info.grid_thw == tuple(ref_grid[0].tolist())
    assert torch.equal(pixel_values, ref_values)


@pytest.mark.parametrize("value", [0, 9, 65535])
def test_out_of_range_orientation_is_ignored_as_transformers_does(value):
    data = with_orientation(noise(320, 200, seed=34), value)
    info = probe_image(data, S)
    assert (info.width, info.height) == (320, 200)
    pixel_values, _ = load_pixels(data, S)
    assert torch.equal(pixel_values, upright_reference(data)[0])


def test_corrupt_exif_is_an_image_error_not_a_crash():
    img = noise(320, 200, seed=35)
    for junk in (b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\xff\xff" + b"\x01" * 40, b"Exif\x00\x00" + b"\xff" * 64):
        data = encode(img, "JPEG", exif=junk)
        try:
            info = probe_image(data, S)
        except ImageError as error:
            assert "EXIF" in str(error)
            continue
        pixel_values, grid = load_pixels(data, S)
        assert grid == info.grid_thw
