"""M-RoPE positions for Qwen3.5 prompts, computed per request from explicit rules.

Every token gets three position components (time, height, width). Text tokens have three equal
components. A video clip's temporal patches are laid out exactly like images, one after another
(transformers' ``Qwen3_5Model.get_rope_index`` splits ``video_grid_thw`` [t, h, w] into t grids
[1, h, w], because each temporal patch sits between its own timestamp text and vision tokens), so
each run of ``<|video_pad|>`` tokens is an ``ImageSpan`` here. An image whose first token sits at position ``s`` and whose merged grid is ``h x w``
gives its token at row ``r``, column ``c`` the position ``(s, s + r, s + c)``; the text after it
continues at ``s + max(h, w)``. Decode step ``i`` of a prompt of length ``L`` uses
``L + i + rope_delta`` on all three components, with ``rope_delta = max_position + 1 - L``.

Nothing here reads or writes state on a model object: transformers keeps ``rope_deltas`` on the
model, shared by every request that touches it, which is exactly what a server must not do.

Importing this module does not import torch (only building positions does): the placeholder
spans and vision pieces are plain Python, and the router's prefix keys (``epd.prefix``) and through
them ``epd.discovery`` use them; the controller, the registry and every `epd` command import
``epd.discovery``, and torch's import (3 s idle, 10-20 s on a loaded machine) would eat their
connect deadlines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's placeholder tokens sit in the prompt and the merged grid they form."""

    start: int  # index of the image's first placeholder token in the prompt
    merged_height: int  # rows of image tokens (patch rows / merge size)
    merged_width: int  # columns of image tokens

    @property
    def num_tokens(self) -> int:
        return self.merged_height * self.merged_width

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class VisionPiece:
    """One run of placeholder tokens and where its embedding rows come from: rows ``row`` to
    ``row + span.num_tokens`` of item ``ref`` (an image: its only run; a clip chunk: one temporal patch)."""

    span: ImageSpan
    ref: int  # index of the item in the request
    row: int  # first embedding row of this run in the item's embedding
    name: str  # what the prefix cache hashes for this run (the item's store key, and the patch for a chunk)


def find_image_spans(
    token_ids: Sequence[int], image_token_id: int, merged_grids: Sequence[tuple[int, int]]
) -> list[ImageSpan]:
    """Pair each run of image placeholder tokens with its image's merged grid, in prompt order.

    Raises ValueError when the placeholder runs do not match the grids one to one: a prompt whose
    placeholders and images disagree must never be served.
    """
    spans: list[ImageSpan] = []
    grids = list(merged_grids)
    i, n = 0, len(token_ids)
    while i < n:
        if token_ids[i] != image_token_id:
            i += 1
            continue
        start = i
        # Adjacent images are separated by vision_end/vision_start tokens, so each image's
        # placeholders form one run; a run is consumed grid by grid in case two ever touch.
        while i < n and token_ids[i] == image_token_id:
            i += 1
        run_left = i - start
        while run_left > 0:
            if len(spans) >= len(grids):
                raise ValueError(f"prompt has more image placeholder tokens than the {len(grids)} image(s) sent")
            h, w = grids[len(spans)]
            if h * w > run_left:
                raise ValueError(
                    f"image {len(spans)} needs {h * w} placeholder tokens but its run has only {run_left}"
                )
            spans.append(ImageSpan(start=i - run_left, merged_height=h, merged_width=w))
            run_left -= h * w
    if len(spans) != len(grids):
        raise ValueError(f"prompt has placeholders for {len(spans)} image(s) but {len(grids)} were sent")
    return spans


def vision_pieces(prompt_ids: Sequence[int], refs, image_token_id: int, video_token_id: int | None
                  ) -> list[VisionPiece]:
    """Every run of placeholder tokens in prompt order, with the item whose embedding rows fill it.
    ``refs``: the request's items in prompt order (``ImageRef``: ``store_key``, ``merged_height``,
    ``merged_width``, ``temporal_patches``); a clip chunk of n temporal patches fills n runs of
    ``<|video_pad|>``. Raises ValueError when the runs and the items disagree."""
    image_refs = [i for i, ref in enumerate(refs) if not ref.temporal_patches]
    video_refs = [i for i, ref in enumerate(refs) if ref.temporal_patches]
    grids = [(refs[i].merged_height, refs[i].merged_width) for i in image_refs]
    spans = find_image_spans(prompt_ids, image_token_id, grids)
    pieces = [VisionPiece(span, i, 0, refs[i].store_key) for span, i in zip(spans, image_refs)]
    if video_refs:
        if video_token_id is None:
            raise ValueError("this model has no video token")
        owners = [(i, k) for i in video_refs for k in range(refs[i].temporal_patches)]
        grids = [(refs[i].merged_height, refs[i].merged_width) for i, _ in owners]
        try:
            spans = find_image_spans(prompt_ids, video_token_id, grids)
        except ValueError as error:
            raise ValueError(f"video: {str(error).replace('image', 'temporal patch')}") from None
        pieces += [VisionPiece(span, i, k * span.num_tokens, f"{refs[i].store_key}#{k}")
                   for span, (i, k) in zip(spans, owners)]
    return sorted(pieces, key=lambda piece: piece.span.start)


def mrope_positions(num_tokens: int, spans: Sequence[ImageSpan]) -> tuple[torch.Tensor, int]:
    """Positions ``[3, num_tokens]`` (int64) for a prompt, and its ``rope_delta``."""
    import torch

    pieces: list[torch.Tensor] = []
    cursor = 0  # next prompt index to place
    position = 0  # next position to hand out
    for span in spans:
        pieces.append(_text_positions(span.start - cursor, position))
        position += span.start - cursor
        pieces.append(_image_positions(span, position))
        position += max(span.merged_height, span.merged_width)
        cursor = span.end
    pieces.append(_text_positions(num_tokens - cursor, position))
    positions = torch.cat(pieces, dim=1)
    rope_delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, rope_delta


def decode_position(prompt_len: int, step: int, rope_delta: int) -> int:
    """Position of the token fed at decode step ``step`` (0 = the first sampled token)."""
    return prompt_len + step + rope_delta


def _text_positions(length: int, start: int) -> torch.Tensor:
    import torch

    return (torch.arange(length, dtype=torch.long) + start).expand(3, length)


def _image_positions(span: ImageSpan, start: int) -> torch.Tensor:
    import torch

    rows = torch.arange(span.merged_height, dtype=torch.long).repeat_interleave(span.merged_width)
    cols = torch.arange(span.merged_width, dtype=torch.long).repeat(span.merged_height)
    time = torch.zeros_like(rows)
    return torch.stack([time, rows, cols]) + start
