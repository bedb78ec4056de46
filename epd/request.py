"""The life of one request, as one status every role reports the same way."""

from __future__ import annotations

import enum


class RequestStatus(enum.Enum):
    WAITING_FOR_EMBEDDINGS = "waiting_for_embeddings"  # router: images being probed, looked up, encoded
    PREFILLING = "prefilling"  # prefill: splicing embeddings and running the prompt
    HANDED_OFF = "handed_off"  # decode: state received, waiting in the batch or for its claim
    DECODING = "decoding"  # decode: producing tokens
    FINISHED = "finished"  # any role: done, cancelled or failed; its state is freed


class FinishReason(str, enum.Enum):
    EOS = "eos"
    STOP = "stop"  # a stop string
    LENGTH = "length"  # max_tokens
    CANCELLED = "cancelled"  # the client went away, or its handoff lease ran out
    DEADLINE = "deadline"
    ERROR = "error"  # the role failed this request (logged there); the router reports INTERNAL
