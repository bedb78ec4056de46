"""The life of one request on the decode side, and why a request ended (shared by every role).

The router and prefill handle a request within one call, so its phase there is the call's
progress; decode keeps requests across calls and tracks each one's status explicitly."""

from __future__ import annotations

import enum


class RequestStatus(enum.Enum):
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
