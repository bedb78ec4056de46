"""Video clips for Qwen3.5: header probe, frame sampling, resizing, patches, timestamps, keys.

Qwen3.5 checkpoints process video with transformers' ``Qwen3VLVideoProcessor`` and write the prompt
with ``Qwen3VLProcessor``; this module is that pipeline, rule for rule, for transformers 5.24
(the version epd pins). Each rule names the lines it follows:

* metadata (``video_utils.read_video_pyav``): the container's ``frames`` count and
  ``average_rate`` of its first video stream, read from the header, nothing decoded;
* sampling (``video_processing_qwen3_vl.Qwen3VLVideoProcessor.sample_frames``):
  ``n = int(total / fps_of_file * fps)`` clamped to ``[min_frames, max_frames]`` and to ``total``,
  ``indices = linspace(0, total - 1, n).round()``; a file that states no rate is taken as 24 fps;
* resizing (``video_processing_qwen3_vl.smart_resize`` and ``Qwen3VLVideoProcessor.resize``): the
  pixel budget ``[shortest_edge, longest_edge]`` applies to the whole clip (frames x height x
  width), sides are multiples of ``patch * merge``; with ``cap_pixels_per_frame`` the per-frame cap
  of qwen-vl-utils; the frames are resized by torchvision's ``resize`` (bicubic, antialias), which
  on CPU is ``torch.nn.functional.interpolate`` on the uint8 frames (torchvision 0.28
  ``transforms/v2/functional/_geometry.resize_image``): done here with torch alone, so epd's venv
  needs no torchvision;
* rescale + normalize fused (``image_processing_backends.TorchvisionBackend.rescale_and_normalize``):
  ``(x - mean / rescale) / (std / rescale)`` in float32;
* patches (``Qwen3VLVideoProcessor.patchify``): the last frame repeated up to a whole temporal patch
  of 2 frames, one row per (temporal patch, merged row, merged column, 2x2 cell), temporal patch first;
* prompt (``processing_qwen3_vl.Qwen3VLProcessor.replace_video_token`` and
  ``_calculate_timestamps``): the chat template's ``<|video_pad|>`` becomes, per temporal patch,
  ``<{t:.1f} seconds>`` + ``<|vision_start|>`` + ``<|video_pad|>`` x (h * w / 4) + ``<|vision_end|>``,
  ``t`` the mean of the patch's two frame times (index / fps). transformers 5.24 replaces the pad
  token alone, so the template's own ``<|vision_start|>``/``<|vision_end|>`` stay around the whole
  clip; that is what epd writes too.

Decoding: frame ``i`` is the decoder's ``i``-th output frame (``read_video_pyav``); a chunk late in
a constant-rate clip seeks to the key frame before its first frame rather than decoding from the
start (frames decoded from a key frame are the same pixels), each frame's index then read from its
timestamp and checked against the timeline the header describes.

The vision tower attends within each temporal patch (``vision_utils.get_vision_cu_seqlens``: one
sequence per ``h * w`` patches of each of the ``t`` steps), so a clip's temporal patches can be
encoded in groups (chunks) on different replicas and concatenated in order: the same rows as one
forward over the clip. Each chunk has a store key of its own (clip bytes, every setting, its range).

Problems with client input raise :class:`VideoError` (INVALID_ARGUMENT at the gateway). PyAV and
torch are imported lazily: the HTTP front only needs the header probe.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from epd import imaging, limits

if TYPE_CHECKING:  # pragma: no cover
    import torch

ASSUMED_FPS = 24.0  # what transformers assumes for a file that states no frame rate
_KEY_DOMAIN = b"epd.video_key.v1\x00"
_FINGERPRINT_DOMAIN = b"epd.video_settings.v1\x00"
MAX_ASPECT_RATIO = 200


class VideoError(ValueError):
    """Bad video input from a client; the message names the problem."""


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class VideoSettings:
    """Video preprocessing settings: ``Qwen3VLVideoProcessor``'s class defaults, overridden by the
    checkpoint's ``video_preprocessor_config.json``, then by the request (``with_overrides``)."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 128 * 32 * 32  # size.shortest_edge: the whole clip's floor
    max_pixels: int = 32 * 32 * 768  # size.longest_edge: the whole clip's budget
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    cap_pixels_per_frame: bool = False  # transformers 5.24: None means False (with a warning)
    max_video_tokens: int = 768

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels",
                     "min_frames", "max_frames", "max_video_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"VideoSettings.{name} must be a positive int, got {value!r}")
        if not (isinstance(self.fps, (int, float)) and math.isfinite(self.fps) and self.fps > 0):
            raise ValueError(f"VideoSettings.fps must be a positive number, got {self.fps!r}")
        object.__setattr__(self, "fps", float(self.fps))
        object.__setattr__(self, "image_mean", tuple(float(v) for v in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(v) for v in self.image_std))
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or 0 in self.image_std:
            raise ValueError("VideoSettings.image_mean/image_std must be 3 numbers (std non-zero)")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_config(cls, source: str | Path | Mapping[str, Any] | None) -> VideoSettings:
        """From a ``video_preprocessor_config.json`` (path or dict); None or a missing file: defaults."""
        if source is None:
            return cls()
        if isinstance(source, Mapping):
            cfg = dict(source)
        else:
            path = Path(source)
            if not path.is_file():
                return cls()
            cfg = json.loads(path.read_text())
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_sample_frames"):
            if cfg.get(flag, True) is False:
                raise ValueError(f"video preprocessor config sets {flag}=false, which is not supported")
        if cfg.get("resample", 3) != 3:
            raise ValueError("video preprocessor config: only bicubic resampling (3) is supported")
        kwargs: dict[str, Any] = {}
        for name in ("patch_size", "merge_size", "temporal_patch_size", "fps", "min_frames", "max_frames",
                     "image_mean", "image_std", "rescale_factor", "max_video_tokens"):
            if cfg.get(name) is not None:
                kwargs[name] = cfg[name]
        if cfg.get("cap_pixels_per_frame") is not None:
            kwargs["cap_pixels_per_frame"] = bool(cfg["cap_pixels_per_frame"])
        size = cfg.get("size") or {}
        if size.get("shortest_edge") is not None:
            kwargs["min_pixels"] = size["shortest_edge"]
        if size.get("longest_edge") is not None:
            kwargs["max_pixels"] = size["longest_edge"]
        return cls(**kwargs)

    def with_overrides(self, fps: float | None = None, max_frames: int | None = None,
                       max_pixels: int | None = None, caps: limits.VideoLimits | None = None) -> VideoSettings:
        """A request's ``fps``, ``max_frames`` and ``max_pixels`` (clip budget), each within the server's caps;
        a value equal to the current setting (what the router forwards to the encoder) changes nothing."""
        caps = caps or limits.VideoLimits()
        changes: dict[str, Any] = {}
        if fps is not None and fps != 0 and float(fps) != self.fps:
            if not (math.isfinite(fps) and 0 < fps <= caps.max_fps):
                raise VideoError(f"video fps {fps!r} is out of range; allowed: (0, {caps.max_fps:g}]")
            changes["fps"] = float(fps)
        if max_frames is not None and max_frames != 0 and max_frames != self.max_frames:
            if not self.min_frames <= max_frames <= caps.max_frames_per_request:
                raise VideoError(f"video max_frames {max_frames} is out of range; allowed: {self.min_frames}.."
                                 f"{caps.max_frames_per_request} (limits.VideoLimits.max_frames_per_request)")
            changes["max_frames"] = int(max_frames)
        if max_pixels is not None and max_pixels != 0 and max_pixels != self.max_pixels:
            if not self.min_pixels <= max_pixels <= caps.max_clip_pixels:
                raise VideoError(f"video max_pixels {max_pixels} is out of range; allowed: {self.min_pixels}.."
                                 f"{caps.max_clip_pixels} (limits.VideoLimits.max_clip_pixels)")
            changes["max_pixels"] = int(max_pixels)
        return dataclasses.replace(self, **changes) if changes else self

    def fingerprint(self) -> bytes:
        """Canonical bytes of every setting that changes a clip's frames, pixels or grid."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return _FINGERPRINT_DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- the rules


def sample_indices(total_frames: int, file_fps: float | None, settings: VideoSettings) -> list[int]:
    """``Qwen3VLVideoProcessor.sample_frames`` with ``fps`` (its ``num_frames`` argument unused)."""
    import numpy as np

    file_fps = file_fps or ASSUMED_FPS
    num = int(total_frames / file_fps * settings.fps)
    num = min(max(num, settings.min_frames), settings.max_frames, total_frames)
    return [int(i) for i in np.linspace(0, total_frames - 1, num).round().astype(int)]


def smart_resize(num_frames: int, height: int, width: int, settings: VideoSettings) -> tuple[int, int]:
    """``video_processing_qwen3_vl.smart_resize`` after ``Qwen3VLVideoProcessor.resize``'s budget."""
    factor, temporal = settings.factor, settings.temporal_patch_size
    min_pixels, max_pixels = settings.min_pixels, settings.max_pixels
    if settings.cap_pixels_per_frame:
        frame_cap = settings.max_video_tokens * factor * factor
        per_frame = max(min(frame_cap, max_pixels // num_frames), int(min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    if num_frames < temporal:
        raise VideoError(f"video has {num_frames} frame(s) to sample; at least {temporal} are needed")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise VideoError(f"video aspect ratio {max(height, width) / min(height, width):.1f}:1 is above the "
                         f"limit of {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patch_timestamps(indices: list[int], file_fps: float | None, temporal: int = 2) -> list[float]:
    """``Qwen3VLProcessor._calculate_timestamps``: one time per temporal patch, in seconds."""
    fps = file_fps or ASSUMED_FPS
    indices = list(indices)
    if len(indices) % temporal:
        indices.extend(indices[-1] for _ in range(temporal - len(indices) % temporal))
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal - 1]) / 2 for i in range(0, len(times), temporal)]


# --------------------------------------------------------------------------- probe


@dataclass(frozen=True)
class VideoInfo:
    """What a clip's header says and what it will cost."""

    total_frames: int
    file_fps: float | None  # None: the file states none (24 is assumed)
    width: int
    height: int
    indices: tuple[int, ...]  # the frames sampled
    resized_height: int
    resized_width: int
    grid_thw: tuple[int, int, int]
    timestamps: tuple[float, ...]  # one per temporal patch
    merge_size: int = 2

    @property
    def duration_s(self) -> float:
        return self.total_frames / (self.file_fps or ASSUMED_FPS)

    @property
    def merged_grid(self) -> tuple[int, int]:
        _, h, w = self.grid_thw
        return h // self.merge_size, w // self.merge_size

    @property
    def tokens_per_patch(self) -> int:
        h, w = self.merged_grid
        return h * w

    @property
    def num_tokens(self) -> int:
        return self.grid_thw[0] * self.tokens_per_patch

    @property
    def decoded_pixels(self) -> int:
        """Pixels decoded to reach the last sampled frame (frames are decoded in order)."""
        return (self.indices[-1] + 1) * self.width * self.height


def _open(data: bytes):
    import av

    if not data:
        raise VideoError("video is empty (0 bytes)")
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except av.error.FFmpegError as error:
        raise VideoError(f"video data is corrupt or not a video container: {error.strerror or error}") from None
    except Exception as error:  # noqa: BLE001 - whatever a demuxer raises on hostile bytes
        raise VideoError(f"video data is corrupt or not a video container: {type(error).__name__}") from None
    if not container.streams.video:
        kinds = sorted({stream.type for stream in container.streams})
        container.close()
        if not kinds:  # a container whose muxer kept no stream: nothing was ever written to it
            raise VideoError("video has no frames (zero-length clip: the file holds no stream)")
        what = "audio only" if kinds == ["audio"] else "streams: " + ", ".join(kinds)
        raise VideoError(f"video file has no video stream ({what})")
    return container


def _count_packets(container, stream, cap: int) -> int:
    """Frames of a container that states no count (Matroska, WebM): its video packets, demuxed, not decoded."""
    import av

    count = 0
    try:
        for packet in container.demux(stream):
            if packet.size:
                count += 1
                if count > cap:
                    break
    except av.error.FFmpegError as error:
        raise VideoError(f"video data is corrupt or truncated: {error.strerror or error}") from None
    return count


def probe_video(data: bytes, settings: VideoSettings, caps: limits.VideoLimits | None = None) -> VideoInfo:
    """Header-only inspection: frames, rate, size; the frames sampled, the grid and the timestamps.
    Every cap is checked here, before anything is decoded."""
    caps = caps or limits.VideoLimits()
    container = _open(data)
    try:
        stream = container.streams.video[0]
        width, height = int(stream.codec_context.width or stream.width or 0), int(stream.height or 0)
        rate = stream.average_rate
        file_fps = float(rate) if rate else None
        total = int(stream.frames or 0) or _count_packets(container, stream, caps.max_total_frames)
    finally:
        container.close()
    if total <= 0:
        raise VideoError("video has no frames (zero-length clip)")
    if width <= 0 or height <= 0:
        raise VideoError(f"video has a zero side ({width}x{height})")
    if width * height > caps.max_frame_pixels:
        raise VideoError(f"video frames are {width}x{height} = {width * height} pixels, above the limit of "
                         f"{caps.max_frame_pixels} (limits.VideoLimits.max_frame_pixels)")
    if total > caps.max_total_frames:
        raise VideoError(f"video has {total} frames, above the limit of {caps.max_total_frames} "
                         "(limits.VideoLimits.max_total_frames)")
    duration = total / (file_fps or ASSUMED_FPS)
    if duration > caps.max_duration_s:
        raise VideoError(f"video lasts {duration:.1f} s, above the limit of {caps.max_duration_s:g} s "
                         "(limits.VideoLimits.max_duration_s)")
    indices = sample_indices(total, file_fps, settings)
    if len(indices) > caps.max_frames_per_request:
        raise VideoError(f"video samples {len(indices)} frames, above the limit of {caps.max_frames_per_request} "
                         "(limits.VideoLimits.max_frames_per_request)")
    rh, rw = smart_resize(len(indices), height, width, settings)
    temporal = settings.temporal_patch_size
    grid = (-(-len(indices) // temporal), rh // settings.patch_size, rw // settings.patch_size)
    info = VideoInfo(total, file_fps, width, height, tuple(indices), rh, rw, grid,
                     tuple(patch_timestamps(indices, file_fps, temporal)), settings.merge_size)
    if info.decoded_pixels > caps.max_decoded_pixels:
        raise VideoError(f"video needs {info.decoded_pixels} decoded pixels ({info.indices[-1] + 1} frames of "
                         f"{width}x{height}), above the limit of {caps.max_decoded_pixels} "
                         "(limits.VideoLimits.max_decoded_pixels)")
    return info


# --------------------------------------------------------------------------- decode and patches


def decode_frames(data: bytes, indices: list[int]):
    """The frames at ``indices`` (sorted) as uint8 RGB ``[n, H, W, 3]``: frame ``i`` is the ``i``-th
    frame the decoder outputs, as in ``read_video_pyav``; a file that ends before the last one is
    truncated. A chunk that starts later in a constant-rate clip starts decoding at the key frame
    before its first frame (``_decode_from_key_frame``) instead of at frame 0."""
    import av
    import numpy as np

    container = _open(data)
    try:
        frames = _decode_from_key_frame(container, indices) if indices[0] > 0 else None
        if frames is None:
            container.seek(0)
            frames = _pick(enumerate(container.decode(video=0)), indices)
    except av.error.FFmpegError as error:
        raise VideoError(f"video data is corrupt or truncated: {error.strerror or error}") from None
    finally:
        container.close()
    if len(frames) < len(indices):
        raise VideoError(f"video is truncated: its header promises {indices[-1] + 1}+ frames, only "
                         f"{len(frames)} of the {len(indices)} sampled ones decode")
    return np.stack(frames)


def _pick(numbered, indices: list[int]) -> list:
    """The frames of ``(index, frame)`` pairs (in order) whose index is wanted, up to the last one."""
    wanted, end, frames = set(indices), indices[-1], []
    for i, frame in numbered:
        if i > end:
            break
        if i in wanted:
            frames.append(frame.to_ndarray(format="rgb24"))
    return frames


def _frame_step(stream) -> int | None:
    """One frame's duration in the stream's time base, when the header describes a constant-rate
    timeline exactly (frame ``i`` at ``start + i * step``, ``frames * step`` long); else None."""
    from fractions import Fraction

    rate, base = stream.average_rate, stream.time_base
    if not rate or not base or stream.start_time is None or not stream.frames or not stream.duration:
        return None
    step = 1 / (Fraction(rate) * Fraction(base))
    if step.denominator != 1 or step <= 0 or stream.duration != stream.frames * step:
        return None
    return int(step)


def _decode_from_key_frame(container, indices: list[int]) -> list | None:
    """The wanted frames, decoding from the key frame at or before ``indices[0]``: a chunk late in a
    clip no longer decodes every frame before it (the chunks of one clip are decoded on several
    replicas). Each frame's index comes from its timestamp, and every decoded frame must sit exactly
    on the constant-rate timeline; None (decode from frame 0 instead) when the clip gives any doubt."""
    import av

    stream = container.streams.video[0]
    step = _frame_step(stream)
    if step is None:
        return None
    start = stream.start_time
    try:
        container.seek(start + indices[0] * step, stream=stream, backward=True, any_frame=False)
    except av.error.FFmpegError:
        return None  # whatever the seek ran into, decoding from frame 0 decides
    numbered, expected = [], None
    for frame in container.decode(stream):
        if frame.pts is None or (frame.pts - start) % step:
            return None
        index = (frame.pts - start) // step
        if expected is None and not 0 <= index <= indices[0]:
            return None  # the seek landed after the first frame wanted
        if expected is not None and index != expected:
            return None  # a gap or a repeat: not the timeline the header describes
        numbered.append((index, frame))
        expected = index + 1
        if index >= indices[-1]:
            break
    return _pick(numbered, indices)


def preprocess_frames(frames, info: VideoInfo, settings: VideoSettings) -> torch.Tensor:
    """uint8 ``[n, H, W, 3]`` (n even, or the clip's last frames) -> pixel rows ``[t * h * w, 3 * 2 * p * p]``."""
    import torch

    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()  # [n, 3, H, W] uint8
    if video.shape[1:] != (3, info.height, info.width):
        raise VideoError(f"video frames decode to {list(video.shape[2:])}, the header says "
                         f"{info.height}x{info.width}")
    if (info.resized_height, info.resized_width) != (info.height, info.width):
        video = torch.nn.functional.interpolate(video, size=[info.resized_height, info.resized_width],
                                                mode="bicubic", align_corners=False, antialias=True)
    rf = settings.rescale_factor
    mean = (torch.tensor(settings.image_mean) * (1.0 / rf)).view(-1, 1, 1)
    std = (torch.tensor(settings.image_std) * (1.0 / rf)).view(-1, 1, 1)
    video = video.to(torch.float32).sub_(mean).div_(std)
    return patchify(video, settings)


def patchify(video: torch.Tensor, settings: VideoSettings) -> torch.Tensor:
    """``Qwen3VLVideoProcessor.patchify`` for one clip ``[n, C, H, W]``."""
    import torch

    temporal, patch, merge = settings.temporal_patch_size, settings.patch_size, settings.merge_size
    if pad := -video.shape[0] % temporal:
        video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)), dim=0)
    n, channel, height, width = video.shape
    grid_t, grid_h, grid_w = n // temporal, height // patch, width // patch
    patches = video.view(grid_t, temporal, channel, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid_t * grid_h * grid_w, channel * temporal * patch * patch).contiguous()


def load_chunk_pixels(data: bytes, settings: VideoSettings, first: int, count: int,
                      caps: limits.VideoLimits | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Pixel rows of temporal patches ``[first, first + count)`` of a clip and their grid ``(count, h, w)``."""
    info = probe_video(data, settings, caps)
    grid_t = info.grid_thw[0]
    if not (0 <= first < grid_t and 0 < count <= grid_t - first):
        raise VideoError(f"video chunk {first}+{count} is outside the clip's {grid_t} temporal patches")
    temporal = settings.temporal_patch_size
    wanted = list(info.indices[first * temporal : (first + count) * temporal])
    frames = decode_frames(data, wanted)
    pixels = preprocess_frames(frames, info, settings)
    return pixels, (count, info.grid_thw[1], info.grid_thw[2])


# --------------------------------------------------------------------------- chunks and keys


def chunks(grid_t: int, patches_per_chunk: int) -> list[tuple[int, int]]:
    """``(first, count)`` of each group of temporal patches, in order."""
    size = max(1, patches_per_chunk)
    return [(first, min(size, grid_t - first)) for first in range(0, grid_t, size)]


def chunk_key(data: bytes, settings: VideoSettings, first: int, count: int) -> str:
    """Hex sha256 of (domain, clip bytes, settings fingerprint, the chunk's range)."""
    return imaging.content_key(_KEY_DOMAIN, data, settings.fingerprint(), f"\0{first}\0{count}".encode())


def prompt_token_ids(info: VideoInfo, timestamp_ids, vision_start: int, vision_end: int, video_pad: int) -> list[int]:
    """The ids that replace the template's ``<|video_pad|>``; ``timestamp_ids(text)`` tokenizes plain text
    (each timestamp sits between two added tokens, so it is tokenized alone, as in transformers)."""
    out: list[int] = []
    for t in info.timestamps:
        out.extend(timestamp_ids(f"<{t:.1f} seconds>"))
        out.append(vision_start)
        out.extend([video_pad] * info.tokens_per_patch)
        out.append(vision_end)
    return out
