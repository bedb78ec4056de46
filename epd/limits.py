"""Bounds of a request's sampling values: one source for the gRPC router (``router_svc.core``), the
HTTP front (``router_svc.http``) and ``epd generate``, so a value one of them takes the others take
and a value one refuses the others refuse, with the same numbers in the message. ``max_tokens``
is bounded by the deployment's own ``RouterConfig.max_tokens_limit`` (``--max-tokens-limit``)."""

from __future__ import annotations

MAX_TEMPERATURE = 1e6
"""Above this a softmax is uniform to float32's precision anyway (the proto carries a float32)."""
MAX_LOGPROBS = 20  # epd.sampling's (which imports torch: this module must not, the CLI's parser reads it)
MAX_TOP_K = 2**31 - 1  # int32 in the proto
MAX_SEED = 2**64 - 1  # uint64 in the proto
MAX_PIXELS = 2**63 - 1  # uint64 in the proto; the image processor's own cap applies below it
__all__ = ["MAX_LOGPROBS", "MAX_PIXELS", "MAX_SEED", "MAX_TEMPERATURE", "MAX_TOP_K", "check_temperature"]


def check_temperature(value: float) -> None:
    """Raise ValueError unless ``value`` is a temperature every front accepts."""
    if not 0 <= value <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {value:g}")
