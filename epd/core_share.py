"""Co-located model roles split a host's cores by how many of them compute at the moment.

On a host where encoder, prefill and decode replicas run side by side on the same cores (one
machine's ``epd serve``), each role's torch would otherwise use every core in every forward. When
two or three forwards overlap, their OpenMP teams then time-slice the cores, and an OpenMP region
waits at each barrier for its slowest thread: a thread that lost its core to another role holds
up its whole team. Measured on W1 (docs/BENCHMARKS.md, "Co-located roles share the cores"): every
role on one thread beats every role on both cores, but one thread leaves a lone forward (a single
request at low load) at half the machine.

So each role sizes its forward's thread team to the host's cores divided by the roles computing
right now: alone it has every core, and when the vision encoder, prefill and decode all compute,
each gets its share. A role marks itself as computing by holding an exclusive ``flock`` on its
own file in a directory every co-located role shares (``EPD_CORE_SHARE`` names it; the launcher
sets it, and role processes inherit it); before a forward it counts the other files that are
locked (a non-blocking shared lock fails on those). A process that dies loses its lock with its
file descriptor, so a crashed role never counts as busy. Roles pinned to cores of their own
(``--*-cpus``) or given an explicit thread count leave it off.

Cost: a few system calls per forward (one ``flock`` probe per co-located role), against forwards
of tens of milliseconds or more.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator

from epd import forward_trace

log = logging.getLogger(__name__)

ENV = "EPD_CORE_SHARE"
RESCAN_S = 2.0  # how often the list of co-located roles is read again (replicas come and go)
REBALANCE_S = 0.02  # inside a forward, the least time between two probes of the other roles


class CoreShare:
    """This process's place in a host's core share: a file it locks while computing, and the
    other roles' files it probes before each forward."""

    def __init__(self, directory: str, cores: int) -> None:
        self.directory = directory
        self.cores = max(1, cores)
        # the launcher makes the directory and removes it at stop; a role never creates it (one
        # starting while the stack stops would leave it behind): FileNotFoundError when it is gone
        self.path = os.path.join(directory, f"{os.getpid()}.busy")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._others: dict[str, int] = {}  # path -> an open descriptor to probe it with
        self._scanned = 0.0
        self._lock = threading.Lock()  # one forward of this process at a time holds the mark
        self.threads = 0  # the team size the last forward used
        self._owner = 0  # the thread in a forward now (0: none)
        self._probed = 0.0

    def _rescan(self) -> None:
        now = time.monotonic()
        if now - self._scanned < RESCAN_S:
            return
        self._scanned = now
        try:
            names = {os.path.join(self.directory, n) for n in os.listdir(self.directory) if n.endswith(".busy")}
        except FileNotFoundError:
            names = set()
        names.discard(self.path)
        for path in [p for p in names if not _alive(p)]:  # a role Ray restarted under another pid
            names.discard(path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for path in set(self._others) - names:
            os.close(self._others.pop(path))
        for path in names - set(self._others):
            try:
                self._others[path] = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                pass

    def busy_others(self) -> int:
        """How many other co-located roles are in a forward now."""
        self._rescan()
        busy = 0
        for fd in self._others.values():
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                busy += 1
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
        return busy

    @contextlib.contextmanager
    def forward(self) -> Iterator[int]:
        """Mark this role as computing for one forward, its thread team sized to its share of
        the cores; yields the team size."""
        with self._lock:
            threads = self._resize()
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._owner = threading.get_ident()
            try:
                yield threads
            finally:
                self._owner = 0
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _resize(self) -> int:
        """Set this thread's torch team to the cores over the roles computing now; returns it."""
        self._probed = time.monotonic()
        threads = max(1, self.cores // (1 + self.busy_others()))
        from epd.tensors import forward_team  # only role processes get here; the launcher imports this module for ENV

        forward_team(threads)  # this thread's team (the others' stay one thread each)
        self.threads = threads
        return threads

    def rebalance(self) -> int:
        """Inside a forward, between its layers: size the team again to the roles computing now
        (at most every REBALANCE_S). A forward's team is otherwise fixed at its start, and a
        prefill step of a few seconds that began beside the encoder kept one of two cores idle
        after the encoder's last image, or one that began alone ran two threads beside the
        encoder's for its whole length (docs/BENCHMARKS.md). A no-op outside a forward or on
        another thread than the forward's. Returns the team size."""
        if self._owner != threading.get_ident() or time.monotonic() - self._probed < REBALANCE_S:
            return self.threads
        return self._resize()

    def close(self) -> None:
        for fd in self._others.values():
            os.close(fd)
        self._others.clear()
        os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _alive(path: str) -> bool:
    """Whether the process a ``<pid>.busy`` file is named after still exists."""
    try:
        pid = int(os.path.basename(path).split(".")[0])
    except ValueError:
        return True  # not ours to judge
    return pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user's counts as alive: not
    ours to judge). What a file named after its writer's pid is checked by before it is removed."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_SHARE: CoreShare | None = None
_SHARE_LOCK = threading.Lock()


def enable(cores: int) -> CoreShare | None:
    """Join the host's core share named by ``EPD_CORE_SHARE`` with ``cores`` cores to split
    (this process's torch threads when alone); None, and nothing changes, when it is unset."""
    global _SHARE
    directory = os.environ.get(ENV, "")
    if not directory:
        return None
    with _SHARE_LOCK:
        if _SHARE is None:
            try:
                _SHARE = CoreShare(directory, cores)
            except FileNotFoundError:
                log.warning("%s=%s does not exist: this process's forwards use all %d of its threads", ENV,
                            directory, cores)
                return None
            # debug: every role says the same, and an operator's log stays short (docs/ARCHITECTURE.md says it)
            log.debug("forwards split %d cores with the roles computing beside them on this host (%s)", cores,
                      directory)
        return _SHARE


def rebalance() -> None:
    """Between the layers of a forward: its team resized to the roles computing now
    (``CoreShare.rebalance``); nothing when the host has no core share."""
    share = _SHARE
    if share is not None:
        share.rebalance()


@contextlib.contextmanager
def forward_turn() -> Iterator[None]:
    """One forward, with this process's share of the cores (its full thread count when the
    host has no core share) as the calling thread's team; traced when ``EPD_FORWARD_TRACE`` names
    a file (``epd.forward_trace``)."""
    share = _SHARE
    if share is None:
        import torch

        from epd.tensors import forward_team

        forward_team()  # the process's configured team, on whichever thread runs the forward
        with forward_trace.span(torch.get_num_threads):
            yield
        return
    with share.forward(), forward_trace.span(lambda: share.threads):
        yield
