"""Image handling shared by the router and the encoder workers.

This module owns everything between "bytes a client sent" and "pixel_values the
ViT consumes" for Qwen3.5 vision-language models:

* the preprocessing settings (:class:`ImageSettings`) and their fingerprint,
* Qwen's ``smart_resize`` rule (sides rounded to multiples of patch*merge = 32,
  total pixels clamped to [min_pixels, max_pixels], aspect ratio preserved),
* the cheap header-only probe the router uses to count image tokens
  (:func:`probe_image`), which also refuses decompression bombs, unsupported
  formats and garbage before anything is decoded; it counts on the image as
  displayed, after its EXIF orientation (orientations 5-8 swap the sides),
* EXIF orientation applied before resizing, as transformers' ``load_image``
  does (``ImageOps.exif_transpose``): a portrait phone photo is upright,
* the full decode + resize + normalize + patchify done by encoder workers
  (:func:`load_pixels`), delegated to transformers' ``Qwen2VLImageProcessorPil``
  so the pixels are exactly those the reference pipeline produces,
* the content key of an (image, settings) pair (:func:`image_key`).

Every problem with client input is raised as :class:`ImageError` whose message
names the problem; it is meant to surface as gRPC INVALID_ARGUMENT.

torch and transformers are imported lazily: the router only probes headers and
should not pay for (or need) either.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import math
import re
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from PIL import Image, ImageOps, UnidentifiedImageError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "ALLOWED_FORMATS",
    "ImageError",
    "ImageInfo",
    "ImageSettings",
    "image_key",
    "load_pixels",
    "probe_image",
    "smart_resize",
]

# PIL plugin ids we accept. Everything else is refused before its plugin ever
# parses the bytes (fewer decoders exposed to untrusted input).
ALLOWED_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
# Multi-picture JPEGs (many phone cameras) open as MPO; the first picture is a
# plain JPEG, so it is the same format for our purposes.
_FORMAT_ALIASES = {"MPO": "JPEG"}
MAX_ASPECT_RATIO = 200  # same limit as transformers' smart_resize
_KEY_DOMAIN = b"epd.image_key.v1\x00"
_FINGERPRINT_DOMAIN = b"epd.image_settings.v1\x00"


class ImageError(ValueError):
    """Bad image input from a client; the message names the problem."""


# --------------------------------------------------------------------------- settings


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ImageSettings.{name} must be a positive int, got {value!r}")


def _as_float_triple(name: str, value: Any) -> tuple[float, float, float]:
    try:
        triple = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"ImageSettings.{name} must be 3 numbers, got {value!r}") from None
    if len(triple) != 3 or not all(math.isfinite(v) for v in triple):
        raise ValueError(f"ImageSettings.{name} must be 3 finite numbers, got {value!r}")
    return triple  # type: ignore[return-value]


@dataclass(frozen=True)
class ImageSettings:
    """Preprocessing settings; defaults are Qwen3.5's preprocessor_config.json."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    resample: int = 3  # PIL bicubic
    rescale_factor: float = 1 / 255
    # Decompression-bomb ceiling on the image's own size, before resizing.
    max_decoded_pixels: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels",
                     "max_pixels", "max_decoded_pixels"):
            _check_positive_int(name, getattr(self, name))
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"ImageSettings.min_pixels ({self.min_pixels}) must not exceed "
                             f"max_pixels ({self.max_pixels})")
        # Lists from JSON become tuples so the settings stay hashable (cache key).
        object.__setattr__(self, "image_mean", _as_float_triple("image_mean", self.image_mean))
        object.__setattr__(self, "image_std", _as_float_triple("image_std", self.image_std))
        if any(s == 0 for s in self.image_std):
            raise ValueError(f"ImageSettings.image_std must be non-zero, got {self.image_std}")
        if isinstance(self.resample, bool) or not isinstance(self.resample, int) \
                or self.resample not in range(6):
            raise ValueError(f"ImageSettings.resample must be a PIL resampling filter 0..5, "
                             f"got {self.resample!r}")
        rf = self.rescale_factor
        if isinstance(rf, bool) or not isinstance(rf, (int, float)) or not (math.isfinite(rf) and rf > 0):
            raise ValueError(f"ImageSettings.rescale_factor must be a positive number, got {rf!r}")
        object.__setattr__(self, "rescale_factor", float(rf))
        # PIL warns above MAX_IMAGE_PIXELS and refuses above twice that. Keeping our
        # ceiling at or below PIL's means anything PIL complains about is also above
        # ours, so PIL's check can never reject an image we would accept.
        pil_limit = Image.MAX_IMAGE_PIXELS
        if pil_limit is not None and self.max_decoded_pixels > pil_limit:
            raise ValueError(f"ImageSettings.max_decoded_pixels ({self.max_decoded_pixels}) must not "
                             f"exceed PIL.Image.MAX_IMAGE_PIXELS ({pil_limit})")

    @property
    def factor(self) -> int:
        """Side lengths are multiples of this (patch_size * merge_size)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_preprocessor_config(cls, path_or_dict: str | Path | Mapping[str, Any], **overrides: Any
                                 ) -> ImageSettings:
        """Read an HF ``preprocessor_config.json`` (a path or the parsed dict)."""
        if isinstance(path_or_dict, Mapping):
            cfg = dict(path_or_dict)
        else:
            cfg = json.loads(Path(path_or_dict).read_text())
        # We implement exactly resize -> rescale -> normalize; a config that turns
        # any step off describes a different pipeline, so refuse it loudly.
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if cfg.get(flag, True) is False:
                raise ValueError(f"preprocessor config sets {flag}=false, which is not supported")
        kwargs: dict[str, Any] = {}
        for name in ("patch_size", "merge_size", "temporal_patch_size", "image_mean",
                     "image_std", "resample", "rescale_factor"):
            if cfg.get(name) is not None:
                kwargs[name] = cfg[name]
        size = cfg.get("size") or {}
        if size.get("shortest_edge") is not None:
            kwargs["min_pixels"] = size["shortest_edge"]
        if size.get("longest_edge") is not None:
            kwargs["max_pixels"] = size["longest_edge"]
        # Legacy top-level keys win over `size`, as in Qwen2VLImageProcessor.__init__.
        for name in ("min_pixels", "max_pixels"):
            if cfg.get(name) is not None:
                kwargs[name] = cfg[name]
        kwargs.update(overrides)
        return cls(**kwargs)

    def with_max_pixels(self, n: int | None) -> ImageSettings:
        """Per-request max_pixels: may only lower the cost. None/0 keeps the default."""
        if n is None or n == 0:
            return self
        if isinstance(n, bool) or not isinstance(n, int) or not self.min_pixels <= n <= self.max_pixels:
            raise ImageError(f"max_pixels {n!r} is out of range; allowed: {self.min_pixels}.."
                             f"{self.max_pixels} (or 0 for the default)")
        return dataclasses.replace(self, max_pixels=n)

    def fingerprint(self) -> bytes:
        """Canonical bytes of every setting that changes the pixels fed to the ViT.

        max_decoded_pixels is left out: it only decides whether an image is
        accepted, never what an accepted image becomes.
        """
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "max_decoded_pixels"}
        # json writes floats with repr(), which round-trips exactly.
        return _FINGERPRINT_DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- resize rule


def smart_resize(height: int, width: int, factor: int = 32, min_pixels: int = 65536,
                 max_pixels: int = 16777216) -> tuple[int, int]:
    """Qwen's resize rule; identical results to transformers' Qwen2-VL smart_resize."""
    if height <= 0 or width <= 0:
        raise ImageError(f"image has a zero side ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageError(f"image aspect ratio {ratio:.1f}:1 ({width}x{height}) is above the "
                         f"limit of {MAX_ASPECT_RATIO}:1")
    # The arithmetic below mirrors transformers line for line (including Python's
    # round-half-to-even) so token counts agree with the reference pipeline.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# --------------------------------------------------------------------------- probe


@dataclass(frozen=True)
class ImageInfo:
    """What the header says about an image and what it will cost."""

    width: int
    height: int
    format: str
    resized_width: int
    resized_height: int
    grid_thw: tuple[int, int, int]
    merge_size: int = 2

    @property
    def num_tokens(self) -> int:
        """LLM tokens for this image: grid h*w / merge_size**2."""
        _, h, w = self.grid_thw
        return (h * w) // (self.merge_size ** 2)

    @property
    def merged_grid(self) -> tuple[int, int]:
        _, h, w = self.grid_thw
        return h // self.merge_size, w // self.merge_size


def _sniff_format(data: bytes) -> str | None:
    """Name the format from magic bytes only (no plugin parses the data)."""
    Image.init()
    prefix = data[:16]
    for fmt in Image.ID:
        _factory, accept = Image.OPEN[fmt]
        try:
            if accept is not None and accept(prefix) is True:
                return fmt
        except Exception:  # a plugin's accept() choking on junk just means "not me"
            continue
    return None


_ORIENTATION_TAG = 0x0112
_SWAPS_SIDES = (5, 6, 7, 8)  # transpose, rotate 270, transverse, rotate 90
_PNG_EXIF_CANDIDATES = 16  # eXIf chunks looked at from the end of a PNG (see _png_exif)


def _png_exif(data: bytes) -> bytes | None:
    """The payload of a PNG's last eXIf chunk, wherever it is (Pillow reads one after the pixel
    data only when it decodes them; the probe must not). Found by its type and checked by its CRC;
    only the last few candidates are looked at, so hostile bytes cost nothing. A chunk missed here
    makes the header disagree with the decode, which the encoder refuses (see ``load_pixels``)."""
    pos = len(data)
    for _ in range(_PNG_EXIF_CANDIDATES):
        pos = data.rfind(b"eXIf", 8, pos)
        if pos < 12:
            return None
        length = int.from_bytes(data[pos - 4 : pos], "big")
        end = pos + 4 + length
        if end + 4 <= len(data) and zlib.crc32(data[pos:end]) == int.from_bytes(data[end : end + 4], "big"):
            return data[pos + 4 : end]
    return None


def _orientation(img: Image.Image, data: bytes) -> int:
    """The EXIF orientation (1-8; 1 when there is none) that ``ImageOps.exif_transpose`` will apply,
    read without decoding pixels."""
    try:
        if img.format == "PNG":  # PngImageFile.getexif decodes the whole image to find trailing chunks
            exif = Image.Image.getexif(img)
            img._exif = None  # not cached: exif_transpose after the decode must read the trailing chunks too
            payload = _png_exif(data)
            if payload is not None:
                exif = Image.Exif()
                exif.load(b"Exif\x00\x00" + payload)
        else:
            exif = img.getexif()
        orientation = exif.get(_ORIENTATION_TAG, 1)
    except Exception as exc:  # noqa: BLE001 - whatever a plugin raises on hostile metadata
        raise ImageError(f"image EXIF data is corrupt: {type(exc).__name__}: {exc}") from None
    return orientation if isinstance(orientation, int) and 1 <= orientation <= 8 else 1


def _upright(img: Image.Image) -> Image.Image:
    """The decoded image turned by its EXIF orientation, exactly as transformers' ``load_image``."""
    try:
        ImageOps.exif_transpose(img, in_place=True)  # in place: no copy of an image that needs no turn
        return img
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ImageError(f"image EXIF data is corrupt: {type(exc).__name__}: {exc}") from None


_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")


def _bomb_error(exc: BaseException, settings: ImageSettings) -> ImageError:
    m = _BOMB_PIXELS.search(str(exc))
    size = f"{m.group(1)} pixels" if m else "too large"
    return ImageError(f"image is {size}, above the decode limit of "
                      f"{settings.max_decoded_pixels} pixels")


def _open_header(data: bytes, settings: ImageSettings) -> Image.Image:
    """Open (header only) with the allowed plugins; map every failure to ImageError."""
    if not data:
        raise ImageError("image is empty (0 bytes)")
    try:
        # Escalate PIL's bomb *warning* to an exception so it cannot leak, and catch
        # it along with the bomb error. This scope changes only the filter for that
        # one warning class and only makes it stricter (Python 3.11's
        # catch_warnings is process-global, so a thread race can at worst leave the
        # stricter filter in place).
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=list(ALLOWED_FORMATS))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _bomb_error(exc, settings) from None
    except UnidentifiedImageError:
        pass
    except MemoryError:
        raise
    except Exception as exc:  # a plugin accepted the magic but the header is broken
        raise ImageError(f"image data is corrupt or truncated: {exc}") from None
    fmt = _sniff_format(data)
    if fmt is not None and _FORMAT_ALIASES.get(fmt, fmt) not in ALLOWED_FORMATS:
        raise ImageError(f"unsupported image format {fmt!r}; supported: {', '.join(ALLOWED_FORMATS)}")
    if fmt is not None:
        raise ImageError(f"image data is corrupt or truncated: {fmt} header could not be read")
    raise ImageError("image data is not a recognized image format (expected the raw bytes of a "
                     f"{', '.join(ALLOWED_FORMATS)} file, not base64 or a URL)")


def _info_for(img: Image.Image, settings: ImageSettings, data: bytes) -> ImageInfo:
    width, height = img.size
    if _orientation(img, data) in _SWAPS_SIDES:
        width, height = height, width  # what the model sees is the image turned upright
    fmt = _FORMAT_ALIASES.get(img.format or "", img.format or "")
    if fmt not in ALLOWED_FORMATS:  # defensive: Image.open was limited to these
        raise ImageError(f"unsupported image format {fmt!r}; supported: {', '.join(ALLOWED_FORMATS)}")
    pixels = width * height
    if pixels > settings.max_decoded_pixels:
        raise ImageError(f"image is {width}x{height} = {pixels} pixels, above the decode limit "
                         f"of {settings.max_decoded_pixels} pixels")
    rh, rw = smart_resize(height, width, settings.factor, settings.min_pixels, settings.max_pixels)
    grid = (1, rh // settings.patch_size, rw // settings.patch_size)
    return ImageInfo(width, height, fmt, rw, rh, grid, settings.merge_size)


def _open_checked(data: bytes, settings: ImageSettings) -> tuple[Image.Image, ImageInfo]:
    img = _open_header(data, settings)
    try:
        return img, _info_for(img, settings, data)
    except BaseException:
        img.close()
        raise


def probe_image(data: bytes, settings: ImageSettings) -> ImageInfo:
    """Header-only inspection: size, format, resized size and token count.

    Never decodes pixel data, so it is cheap even for huge images and refuses
    decompression bombs before any memory is spent on them.
    """
    img, info = _open_checked(data, settings)
    img.close()
    return info


# --------------------------------------------------------------------------- full decode


@functools.lru_cache(maxsize=64)
def _processor(settings: ImageSettings) -> Any:
    """One Qwen2VLImageProcessorPil per distinct settings (per-request max_pixels included)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=settings.patch_size,
        merge_size=settings.merge_size,
        temporal_patch_size=settings.temporal_patch_size,
        size={"shortest_edge": settings.min_pixels, "longest_edge": settings.max_pixels},
        image_mean=list(settings.image_mean),
        image_std=list(settings.image_std),
        resample=settings.resample,
        rescale_factor=settings.rescale_factor,
        do_resize=True, do_rescale=True, do_normalize=True, do_convert_rgb=True,
    )


def _to_8bit(img: Image.Image) -> Image.Image:
    """16/32-bit greyscale to 8-bit 'L' by scaling.

    PIL's own convert('RGB') clips these modes at 255, turning almost every
    16-bit PNG white. Everything else (P, PA, LA, RGBA, CMYK, 1, ...) is left to
    the processor's convert_to_rgb, which composites alpha onto white.
    """
    import numpy as np

    if img.mode.startswith("I;16") or img.mode == "I":
        arr = np.asarray(img).astype(np.int64)
        return Image.fromarray((np.clip(arr, 0, 65535) >> 8).astype(np.uint8), mode="L")
    if img.mode == "F":
        return Image.fromarray(np.clip(np.asarray(img), 0, 255).astype(np.uint8), mode="L")
    return img


def load_pixels(data: bytes, settings: ImageSettings) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Decode and preprocess one image into (pixel_values, grid_thw).

    pixel_values is float32 [num_patches, 3 * temporal_patch_size * patch_size**2],
    identical to Qwen2VLImageProcessorPil's output for the same image. Animated
    GIF/WebP use their first frame.
    """
    img, info = _open_checked(data, settings)
    try:
        try:
            # LOAD_TRUNCATED_IMAGES stays False (we never set it), so a cut body fails here.
            img.load()
        except MemoryError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise _bomb_error(exc, settings) from None
        except Exception as exc:
            raise ImageError(f"image data is corrupt or truncated: {exc}") from None
        out = _processor(settings)(images=[_to_8bit(_upright(img))], return_tensors="pt")
    finally:
        img.close()
    pixel_values = out["pixel_values"].float().contiguous()
    grid = tuple(int(v) for v in out["image_grid_thw"][0].tolist())
    # The header told the router how many tokens to reserve; the decode must agree. When it does
    # not, the file's header lies about its pixels: bad input, never worth a retry.
    if grid != info.grid_thw:
        raise ImageError(f"image header says {info.width}x{info.height} (grid {list(info.grid_thw)}) but its "
                         f"pixels decode to grid {list(grid)}")
    return pixel_values, grid  # type: ignore[return-value]


# --------------------------------------------------------------------------- keys


def image_key(data: bytes, settings: ImageSettings) -> str:
    """Hex sha256 of (domain tag, length-prefixed image bytes, settings fingerprint)."""
    return content_key(_KEY_DOMAIN, data, settings.fingerprint())


def content_key(domain: bytes, data: bytes, fingerprint: bytes, suffix: bytes = b"") -> str:
    """Hex sha256 of (``domain``, length-prefixed ``data``, length-prefixed ``fingerprint``,
    ``suffix``): the store key of media content under the settings that change its embeddings."""
    h = hashlib.sha256(domain)
    h.update(len(data).to_bytes(8, "big"))
    h.update(data)
    h.update(len(fingerprint).to_bytes(8, "big"))
    h.update(fingerprint)
    h.update(suffix)
    return h.hexdigest()
