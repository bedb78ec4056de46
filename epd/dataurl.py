"""``data:`` URLs (RFC 2397) as OpenAI's chat format carries images: ``data:image/png;base64,...``."""

from __future__ import annotations

import base64
import binascii


def decode_data_url(url: str, kind: str = "image") -> bytes:
    """The bytes of a ``data:[<media type>];base64,<data>`` URL whose media type is ``kind``/* (or
    unstated, or application/octet-stream); raises ValueError saying what is wrong."""
    if not url[:5].lower() == "data:":
        raise ValueError("not a data: URL")
    header, sep, data = url.partition(",")
    if not sep:
        raise ValueError("a data: URL needs a comma before its data")
    params = header[5:].split(";")
    if "base64" not in [p.strip().lower() for p in params[1:]]:
        raise ValueError("data: URLs must be base64 (data:image/png;base64,...)")
    media_type = params[0].strip().lower()
    if media_type and not media_type.startswith(f"{kind}/") and media_type != "application/octet-stream":
        raise ValueError(f"a data: URL of type {media_type!r} is not {'an image' if kind == 'image' else 'a ' + kind}")
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data: URL is not valid base64") from None


def encode_data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"
