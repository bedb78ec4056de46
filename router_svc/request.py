"""One request as the router carries it: an explicit status and the only ways it changes.

``RouterRequest`` is what the router's steps share (the prompt, sampling, deadline, which images
this request encoded, which decode worker holds its unclaimed handoff). Its status moves only
through ``to`` along ``TRANSITIONS``; every move is logged at debug level with the request's id, so
routing, retries and resumes are each one visible step:

    TOKENIZING -> ENCODING -> PREFILLING -> STREAMING -> FINISHED
                      ^            |            |
                      +------------+            v        (an embedding went missing: encode
                      (re-encode inline)     RESUMING      again with it inline, prefill again)
                                                |
                                                +--> PREFILLING (prompt + answer so far)

Any status may go to FINISHED (done, failed or cancelled). The request's ``id`` never changes;
each prefill attempt (the first, a retry on another prefill replica, a resume after decode lost
the request) gets its own ``attempt_id`` (``<id>.<n>``), because decode must never see one id
handed off twice and a restarted decode worker may still hold an old one.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid

from epd.sampling import SamplingConfig
from epd.v1 import epd_pb2
from router_svc.prompt import Prompt

log = logging.getLogger(__name__)


class RouteStatus(enum.Enum):
    TOKENIZING = "tokenize"  # validating and rendering the prompt
    ENCODING = "encode"  # making sure every image's embedding is in the store (or inline)
    PREFILLING = "prefill"  # a prefill replica computes the prompt (plus the answer so far on a resume)
    STREAMING = "decode"  # the first token is out; decode's stream is relayed
    RESUMING = "resume"  # decode lost or preempted the request: it is about to be prefilled again
    FINISHED = "finished"  # done, failed or cancelled


TRANSITIONS: dict[RouteStatus, frozenset[RouteStatus]] = {
    RouteStatus.TOKENIZING: frozenset({RouteStatus.ENCODING}),
    RouteStatus.ENCODING: frozenset({RouteStatus.PREFILLING}),
    RouteStatus.PREFILLING: frozenset({RouteStatus.STREAMING, RouteStatus.ENCODING}),
    RouteStatus.STREAMING: frozenset({RouteStatus.RESUMING}),
    RouteStatus.RESUMING: frozenset({RouteStatus.PREFILLING}),
    RouteStatus.FINISHED: frozenset(),
}


class InvalidTransition(RuntimeError):
    pass


class RouterRequest:
    """One request's progress through the router: what the steps share, and its status."""

    prompt: Prompt
    sampling: SamplingConfig
    deadline: float
    cache_salt: str = ""
    prompt_logprobs: int | None = None  # alternatives per prompt token, when the prompt's logprobs are asked

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.id = uuid.uuid4().hex  # internal, unique whatever the client sent; never changes
        self.attempt = 0  # prefill attempts so far (first, retries, resumes)
        self.status = RouteStatus.TOKENIZING
        self.streamed = False  # the first token has gone to the client (it no longer waits)
        self.resumes = 0  # times it moved to a decode worker again (deaths and preemptions)
        self.preemptions = 0
        self.unclaimed_decode = ""  # a decode address holding a handoff no stream has claimed yet
        self.encoded: set[str] = set()  # store keys this request's encodes produced
        self.timings = epd_pb2.StageTimings()

    @property
    def attempt_id(self) -> str:
        """The id prefill and decode know this attempt by."""
        return self.id if self.attempt == 0 else f"{self.id}.{self.attempt}"

    @property
    def stage(self) -> str:
        """The stage a departed client is counted under: where it waited, or ``decode`` once it
        had its first token (resumes included)."""
        return "decode" if self.streamed else self.status.value

    def to(self, status: RouteStatus, why: str = "") -> None:
        """Move to ``status`` (any status may finish); raises ``InvalidTransition`` otherwise."""
        if status is not RouteStatus.FINISHED and status not in TRANSITIONS[self.status]:
            raise InvalidTransition(f"request {self.id}: {self.status.name} -> {status.name} is not a transition")
        if status is RouteStatus.STREAMING:
            self.streamed = True
        log.debug("request %s: %s -> %s%s", self.id, self.status.name, status.name, f" ({why})" if why else "")
        self.status = status

    def new_attempt(self, why: str) -> str:
        """A fresh attempt id for a prefill that may follow one which already reached decode."""
        self.attempt += 1
        log.debug("request %s: attempt %d (%s)", self.id, self.attempt, why)
        return self.attempt_id

    def resume(self, preempted: bool) -> None:
        """Decode lost the request (``preempted``: it gave it back to free K/V memory)."""
        self.to(RouteStatus.RESUMING, "preempted" if preempted else "decode worker lost it")
        self.resumes += 1
        self.preemptions += preempted
        self.new_attempt("resume")

    def remaining(self) -> float:
        return max(0.1, self.deadline - time.time())
