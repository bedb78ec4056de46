"""Failures that keep their meaning across a hop, named by what the caller should do.

Engines raise these (no gRPC in them); ``epd.rpc`` maps each to its gRPC status at the server's
edge. Bad client input is a plain ``ValueError`` (INVALID_ARGUMENT).
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base: ``status`` is the gRPC status name the failure surfaces as. ``downstream``: the
    failure is of something behind the service that raises it (its callers must not blame it)."""

    status = "INTERNAL"

    def __init__(self, message: str, downstream: bool = False) -> None:
        super().__init__(message)
        self.downstream = downstream


class Unavailable(ServiceError):
    """Infrastructure is missing or failed (a dead peer, no replica): another try may succeed."""

    status = "UNAVAILABLE"


class DeadlineExceeded(ServiceError):
    status = "DEADLINE_EXCEEDED"


class FailedPrecondition(ServiceError):
    """The request is fine but something it needs is not where it should be (an embedding the
    store evicted): the caller repairs it and retries."""

    status = "FAILED_PRECONDITION"


class NotFound(ServiceError):
    status = "NOT_FOUND"


class ResourceExhausted(ServiceError):
    """Refused for load: the message says when to retry."""

    status = "RESOURCE_EXHAUSTED"


class Cancelled(ServiceError):
    """The caller went away; the work was dropped."""

    status = "CANCELLED"
