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
