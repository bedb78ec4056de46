"""Bounds of a request's sampling values: one source for the gRPC router (``router_svc.core``), the
HTTP front (``router_svc.http``) and ``epd generate``, so a value one of them takes the others take
and a value one refuses the others refuse, with the same numbers in the message. ``max_tokens``
is bounded by the deployment's own ``RouterConfig.max_tokens_limit`` (``--max-tokens-limit``)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TEMPERATURE = 1e6
"""Above this a softmax is uniform to float32's precision anyway (the proto carries a float32)."""
MAX_LOGPROBS = 20  # epd.sampling's (which imports torch: this module must not, the CLI's parser reads it)
MAX_PROMPT_LOGPROBS = 20  # prompt_logprobs: alternatives per prompt token (vLLM's max_logprobs default)
MAX_PROMPT_LOGPROB_ENTRIES = 131072
"""(prompt tokens - 1) x (prompt_logprobs + 1): the entries one prompt_logprobs answer may hold
(about 1.6 MB on the wire; the LM head and a log-softmax over the vocabulary run for every one of
those prompt tokens). Past it the request is refused, naming this bound."""
MAX_TOP_K = 2**31 - 1  # int32 in the proto
MAX_SEED = 2**64 - 1  # uint64 in the proto
MAX_PIXELS = 2**63 - 1  # uint64 in the proto; the image processor's own cap applies below it
__all__ = ["MAX_LOGPROBS", "MAX_PIXELS", "MAX_PROMPT_LOGPROBS", "MAX_PROMPT_LOGPROB_ENTRIES", "MAX_SEED", "MAX_TEMPERATURE", "MAX_TOP_K", "VideoLimits",
           "check_prompt_logprobs", "check_temperature"]


def check_prompt_logprobs(num_top: int, prompt_len: int) -> None:
    """Raise ValueError unless a prompt of ``prompt_len`` tokens may have its logprobs with
    ``num_top`` alternatives each (vLLM's ``prompt_logprobs``)."""
    if not 0 <= num_top <= MAX_PROMPT_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got {num_top}")
    entries = (prompt_len - 1) * (num_top + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ValueError(f"prompt_logprobs: {prompt_len - 1} prompt tokens x {num_top + 1} entries each = {entries}, "
                         f"more than the {MAX_PROMPT_LOGPROB_ENTRIES} one answer may hold; send a shorter prompt or "
                         "a smaller prompt_logprobs")


def check_temperature(value: float) -> None:
    """Raise ValueError unless ``value`` is a temperature every front accepts."""
    if not 0 <= value <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {value:g}")


@dataclass(frozen=True)
class VideoLimits:
    """What one video clip may cost, checked from its header before a frame is decoded
    (``epd.video.probe_video``), by the router and again by the encoder replica. A header that lies
    (fewer frames than it claims) is caught by the decode, which never reads past the last sampled
    frame; one that claims more than these caps is refused at once."""

    max_frames_per_request: int = 768
    """Frames sampled from all the clips of one request (Qwen3VLVideoProcessor's max_frames); the
    per-request ``max_frames`` may only lower it."""
    max_total_frames: int = 100_000
    """Frames a clip's container may hold (a frame-count bomb is refused from its header)."""
    max_duration_s: float = 3600.0
    """A clip's length, frames / rate (a long clip at a tiny size is refused from its header)."""
    max_frame_pixels: int = 4096 * 4096
    """One decoded frame's width x height, before resizing."""
    max_decoded_pixels: int = 2_000_000_000
    """Pixels decoded to reach a clip's last sampled frame (every frame before it is decoded too)."""
    max_clip_pixels: int = 32 * 32 * 2 * 16384
    """The highest per-request ``max_pixels`` (the resized clip's budget, frames x height x width)."""
    max_fps: float = 60.0
    """The highest per-request sampling rate."""
