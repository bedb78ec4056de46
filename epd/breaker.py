"""A circuit breaker: bookkeeping that keeps a failing peer (a replica, the Redis store) out of use
for a back-off that doubles while it keeps failing, then lets one trial call decide. Not thread-safe
by itself: its owner holds a lock around it."""

from __future__ import annotations


class Breaker:
    """Closed (used); open after a failure (skipped until ``retry_at``); then half-open: one trial
    call, whose success closes it and whose failure opens it for twice as long (up to ``max_s``)."""

    def __init__(self, base_s: float = 0.5, max_s: float = 10.0) -> None:
        self.base_s, self.max_s = base_s, max_s
        self.failures = 0  # in a row
        self.retry_at = 0.0
        self.trial = False

    @property
    def closed(self) -> bool:
        return self.failures == 0

    def allows(self, now: float) -> bool:
        return self.failures == 0 or (now >= self.retry_at and not self.trial)

    def begin(self) -> None:
        """A call starts; when the breaker is not closed, it is the one trial."""
        if self.failures:
            self.trial = True

    def end(self, ok: bool | None, now: float) -> None:
        """The call ended: ``ok`` is the peer's own verdict; None (a client error, a failure from
        behind the peer) says nothing about it."""
        self.trial = False
        if ok is True:
            self.failures = 0
        elif ok is False:
            self.failures += 1
            self.retry_at = now + min(self.max_s, self.base_s * 2 ** (self.failures - 1))
