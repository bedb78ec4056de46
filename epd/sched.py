"""The Linux scheduling policy of a local stack's processes: the control plane as ``SCHED_BATCH``.

On a machine whose cores the forwards fill (``epd serve`` on one host), every wakeup of a
control-plane process (a Ray daemon's or actor's timers, the registry's watches, a router's
streams, the encode front) preempted a forward thread at once, hundreds of times a second, and a
two-thread forward waits at its next barrier for the thread that lost its core. A ``SCHED_BATCH``
thread gets the same share of the CPU (the same weight as the default policy) but never preempts
on wakeup: it runs on a core that is idle (a forward thread asleep at a barrier) or at the end of
the running thread's slice. The local launcher starts Ray inside ``control_plane_batch``, so Ray's
daemons and every actor they start inherit the policy; each forward role (encoder, prefill,
decode, aggregated, a tensor-parallel rank) puts its own process back to ``SCHED_OTHER`` as it
configures its threads (``epd.tensors.configure_threads``). ``EPD_CONTROL_BATCH=0`` leaves every
process at the default policy. Measured in docs/BENCHMARKS.md, "Prefill's elementwise passes in
C++, the control plane as SCHED_BATCH, attention's prefetch".
"""

from __future__ import annotations

import contextlib
import os

CONTROL_BATCH_ENV = "EPD_CONTROL_BATCH"
"""``0``: a local stack's control plane keeps the default scheduling policy."""


def set_policy(batch: bool) -> None:
    """Every thread of this process to ``SCHED_BATCH`` (``batch``) or ``SCHED_OTHER``. Only threads
    at one of these two policies change (a real-time or idle one was put there on purpose);
    nothing happens elsewhere than Linux."""
    if not hasattr(os, "SCHED_BATCH"):
        return
    policy = os.SCHED_BATCH if batch else os.SCHED_OTHER
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getscheduler(int(tid)) in (os.SCHED_OTHER, os.SCHED_BATCH):
                os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except OSError:  # a thread that ended meanwhile
            pass


@contextlib.contextmanager
def control_plane_batch():
    """The processes this process starts inside the block run ``SCHED_BATCH`` (they inherit it),
    this process afterwards as before. A no-op with ``EPD_CONTROL_BATCH=0``."""
    if os.environ.get(CONTROL_BATCH_ENV, "1").strip() == "0":
        yield
        return
    set_policy(batch=True)
    try:
        yield
    finally:
        set_policy(batch=False)
