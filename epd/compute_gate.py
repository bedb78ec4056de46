"""One forward at a time among the model roles that share a host's cores.

On a host where encoder, prefill and decode replicas run side by side on the same cores, each
role's forward uses every core with its own OpenMP team. When two forwards overlap, the teams
time-slice the cores, and an OpenMP region waits at each of its barriers for its slowest
thread: a thread that lost its core to another role's thread holds up its whole team. Both
forwards then run much slower than one after the other (measured in docs/BENCHMARKS.md, "One
forward at a time").

The gate makes the co-located roles take turns, as a single-process engine does: a role holds
an exclusive ``flock`` on one file for the length of one forward (a decode step, a prefill
chunk, a vision batch), so each forward has every core to itself. The launcher turns it on for
roles that share cores (``EPD_COMPUTE_GATE`` names the file; every role process inherits it);
roles pinned to cores of their own (``--*-cpus``) or on separate hosts leave it off.

Turns are fair enough: the kernel wakes a waiter when the holder releases, but a holder that
asks again at once would usually win the lock back; so a process that released the gate less
than ``YIELD_S`` ago pauses ``PAUSE_S`` (well under 1% of a forward) before it asks again, which
lets a woken waiter in first.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

ENV = "EPD_COMPUTE_GATE"
YIELD_S = 0.05  # asking again this soon after a release: pause first
PAUSE_S = 0.0003  # long enough for a woken waiter on another core to take the lock


class ComputeGate:
    """An exclusive lock across processes on ``path`` (created if missing), held per forward."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._local = threading.Lock()  # flock is per open file: threads of one process queue here
        self.waits = 0  # forwards that found the gate held
        self.wait_s = 0.0  # time spent waiting for it
        self._last_release = 0.0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self._local:
            self._acquire()
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                self._last_release = time.monotonic()

    def _acquire(self) -> None:
        if time.monotonic() - self._last_release < YIELD_S:  # a waiter woken by our release goes first
            time.sleep(PAUSE_S)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        start = time.perf_counter()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.waits += 1
        self.wait_s += time.perf_counter() - start

    def close(self) -> None:
        os.close(self._fd)


_GATE: ComputeGate | None = None
_GATE_LOCK = threading.Lock()


def gate() -> ComputeGate | None:
    """This process's gate, from ``EPD_COMPUTE_GATE``; None when the variable is unset."""
    global _GATE
    path = os.environ.get(ENV, "")
    if not path:
        return None
    with _GATE_LOCK:
        if _GATE is None or _GATE.path != path:
            _GATE = ComputeGate(path)
            log.info("forwards take turns with the other roles on this host (%s=%s)", ENV, path)
        return _GATE


@contextlib.contextmanager
def forward_turn() -> Iterator[None]:
    """Hold the host's gate for one forward, or nothing when there is no gate."""
    current = gate()
    if current is None:
        yield
        return
    with current.hold():
        yield
