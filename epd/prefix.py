"""Prefix keys: the names prefill's prefix cache gives prompt prefixes, computed the same way by
prefill (to look up and store snapshots) and by the router (to ask which replica holds the
longest prefix of a request); and the compact summary a prefill replica reports of what it holds.

Keys are a chained sha256 over fixed-size blocks of prompt tokens. The root carries the model
fingerprint, the block size and the request's cache salt (if any); each block adds its token ids
and, for every image overlapping the block, that image's store key (which already hashes the image
bytes, the processor settings and the model) with its start index. Image placeholder tokens are
the same for every image, so keying on tokens alone would serve one image's state to another.

A replica's summary is the first ``SUMMARY_KEY_BYTES`` bytes of each snapshot's key, most recently
used first, at most ``MAX_SUMMARY_KEYS`` of them, concatenated: 8 bytes a snapshot. A false match
needs two different prefixes whose keys agree in 64 bits; it would cost one misrouted request
(prefill checks the full key), never a wrong answer.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

from epd.positions import ImageSpan, VisionPiece, vision_pieces

SUMMARY_KEY_BYTES = 8
MAX_SUMMARY_KEYS = 4096  # 32 KiB a replica: what a heartbeat carries at most


@dataclass(frozen=True)
class KeyedImage:
    """An image's place in the prompt and the store key that names its content."""

    span: ImageSpan
    store_key: str


def prefix_block_hashes(token_ids: Sequence[int], images: Sequence[KeyedImage], block_size: int,
                        model_fingerprint: str, salt: str = "") -> list[bytes]:
    """One chained hash per *full* block: ``hashes[i]`` names the prefix ``token_ids[:(i+1)*block_size]``.
    A ``salt`` (the request's ``cache_salt``) goes into the root: only requests with the same salt
    share entries."""
    root = f"epd-prefix-v1\0{model_fingerprint}\0{block_size}"
    if salt:
        root += f"\0salt\0{len(salt)}\0{salt}"
    digest = hashlib.sha256(root.encode()).digest()
    hashes: list[bytes] = []
    for block in range(len(token_ids) // block_size):
        start, end = block * block_size, (block + 1) * block_size
        h = hashlib.sha256(digest)
        h.update(struct.pack(f"<{block_size}i", *token_ids[start:end]))
        for image in images:
            if image.span.start < end and image.span.end > start:
                h.update(f"\0img\0{image.span.start}\0{image.store_key}".encode())
        digest = h.digest()
        hashes.append(digest)
    return hashes


def request_block_hashes(token_ids: Sequence[int], num_generated: int, refs, image_token_id: int,
                         video_token_id: int | None, block_size: int, model_fingerprint: str, salt: str = ""
                         ) -> tuple[list[VisionPiece], list[bytes]]:
    """A prefill request's vision pieces (``positions.vision_pieces``: images and clip chunks, in
    prompt order) and prefix block keys: ``token_ids`` is the prompt plus the ``num_generated``
    answer tokens a resume replays (those are text whatever their id), ``refs`` the request's
    ``ImageRef`` items. Prefill and the router both call this, so the router's keys are the
    cache's keys."""
    pieces = vision_pieces(token_ids[:len(token_ids) - num_generated], refs, image_token_id, video_token_id)
    images = [KeyedImage(piece.span, piece.name) for piece in pieces]
    return pieces, prefix_block_hashes(token_ids, images, block_size, model_fingerprint, salt)


def lookup_blocks(num_hashes: int, prompt_len: int, block_size: int) -> range:
    """The prefix lengths (in blocks) a lookup tries, longest first: a cached prefix must leave at
    least one token to compute (the first token's logits need one)."""
    return range(min(num_hashes, (prompt_len - 1) // block_size), 0, -1)


def summary_key(block_hash: bytes) -> bytes:
    return block_hash[:SUMMARY_KEY_BYTES]


def encode_summary(block_hashes: Iterable[bytes]) -> bytes:
    """The summary of the snapshot keys given (most recently used first), cut at ``MAX_SUMMARY_KEYS``."""
    keys = []
    for block_hash in block_hashes:
        if len(keys) == MAX_SUMMARY_KEYS:
            break
        keys.append(summary_key(block_hash))
    return b"".join(keys)


def decode_summary(blob: bytes) -> frozenset[bytes]:
    if len(blob) % SUMMARY_KEY_BYTES:
        raise ValueError(f"a prefix summary is whole {SUMMARY_KEY_BYTES}-byte keys, got {len(blob)} bytes")
    return frozenset(blob[i:i + SUMMARY_KEY_BYTES] for i in range(0, len(blob), SUMMARY_KEY_BYTES))


def cached_tokens(block_hashes: Sequence[bytes], prompt_len: int, block_size: int, held: Container[bytes]) -> int:
    """Tokens of this prompt a replica whose summary is ``held`` would serve from its prefix cache
    (the same search as ``PrefixCache.lookup``)."""
    for block in lookup_blocks(len(block_hashes), prompt_len, block_size):
        if summary_key(block_hashes[block - 1]) in held:
            return block * block_size
    return 0
