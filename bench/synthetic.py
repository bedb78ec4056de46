"""Synthetic images with real content (shapes, gradients, text), reproducible by seed.

Used by the demo, the tests and benchmarks: blank images would let a broken encoder path hide
(every patch alike), so each image has structure that differs with the seed.
"""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw


def make_image(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """An encoded image of ``width x height`` whose content is fixed by ``seed``."""
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for y in range(0, height, max(1, height // 32)):  # a vertical gradient band
        shade = int(255 * y / max(1, height - 1))
        draw.line([(0, y), (width // 4, y)], fill=(shade, rng.randrange(256), 255 - shade))
    for _ in range(6):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randrange(1, max(2, width // 2)), y0 + rng.randrange(1, max(2, height // 2))
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=colour)
    draw.text((width // 8, height // 2), f"epd {seed}", fill=(0, 0, 0))
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def make_clip(width: int, height: int, num_frames: int, fps: float = 8, seed: int = 0, codec: str = "mpeg4",
              container: str = "mp4", audio: bool = False, faststart: bool = False) -> bytes:
    """A seeded synthetic video clip encoded with PyAV: a moving bar over coloured noise, so frames
    differ. ``codec``/``container``: any pair PyAV's FFmpeg writes (mpeg4/mp4, libvpx/webm, mjpeg/avi).
    ``faststart``: an MP4's index before its data (as streamed files have it), so a cut file still opens."""
    import os
    import tempfile

    if faststart:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "clip.mp4")
            _write_clip(path, width, height, num_frames, fps, seed, codec, container, audio, {"movflags": "faststart"})
            with open(path, "rb") as f:
                return f.read()
    out = io.BytesIO()
    _write_clip(out, width, height, num_frames, fps, seed, codec, container, audio, {})
    return out.getvalue()


def _write_clip(out, width, height, num_frames, fps, seed, codec, container, audio, options) -> None:
    import fractions

    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    with av.open(out, "w", format=container, options=options) as box:
        stream = box.add_stream(codec, rate=fractions.Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        sound = box.add_stream("aac", rate=8000) if audio else None
        if num_frames == 0:
            box.start_encoding()  # the header alone: a container with a video stream and no frame
        base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        for i in range(num_frames):
            frame = base.copy()
            x = (i * max(1, width // max(1, num_frames))) % width
            frame[:, x : x + max(2, width // 8)] = (255, 40 * (i % 6), 255 - 20 * (i % 12))
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                box.mux(packet)
        for packet in stream.encode():
            box.mux(packet)
        if sound is not None:
            _encode_tone(box, sound, seconds=num_frames / fps)


def make_audio(seconds: float = 1.0) -> bytes:
    """An audio-only MP4 (AAC tone): a file with no video stream."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as box:
        _encode_tone(box, box.add_stream("aac", rate=8000), seconds)
    return out.getvalue()


def _encode_tone(box, stream, seconds: float) -> None:
    import av
    import numpy as np

    rate = stream.rate
    samples = np.sin(np.arange(int(rate * seconds)) * 2 * np.pi * 440 / rate).astype(np.float32)
    step = stream.codec_context.frame_size or 1024
    for start in range(0, len(samples) - step + 1, step):
        frame = av.AudioFrame.from_ndarray(samples[None, start : start + step], format="fltp", layout="mono")
        frame.rate = rate
        for packet in stream.encode(frame):
            box.mux(packet)
    for packet in stream.encode():
        box.mux(packet)
