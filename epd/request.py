"""Why a request ended: the finish reasons every role and the router share."""

from __future__ import annotations

import enum


class FinishReason(str, enum.Enum):
    EOS = "eos"
    STOP = "stop"  # a stop string
    LENGTH = "length"  # max_tokens
    CANCELLED = "cancelled"  # the client went away, or its handoff lease ran out
    DEADLINE = "deadline"
    ERROR = "error"  # the role failed this request (logged there); the router reports INTERNAL
    PREEMPTED = "preempted"  # decode took its K/V back to let others go on: internal, the router resumes it
