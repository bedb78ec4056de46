"""The Linux scheduling policy of a local stack's processes: the control plane as ``SCHED_IDLE``.

On a machine whose cores the forwards fill (``epd serve`` on one host), the rest of the stack
wakes ~1,800 times a second even when idle (each Ray actor's 10-ms main-thread tick, Ray's
daemons, the registry's watches, the controller's probes), and each wakeup that takes a core
from a forward thread holds its thread team's other threads at their next barrier. The policies:

- ``SCHED_IDLE`` (the control plane: Ray's daemons, the controller, the registry, Redis's keeper,
  the ``epd serve`` process while it waits): runs only where a core has nothing else to run (a
  forward thread asleep at a barrier, between steps), or for a sliver of a busy core. Measured
  under W1's load on two cores: such a process wakes 1.6 ms late at the median, 15 ms at p99,
  172 ms at worst, well inside every timeout of the control plane (probes: 2 s).
- ``SCHED_BATCH`` (the serving path that is not a forward: the router and its HTTP front, the
  encode front, the embedded Redis server): the default policy's share of the CPU, but it never
  preempts a running thread on wakeup; it runs at the end of that thread's slice.
- ``SCHED_OTHER`` (the forwards: encoder, prefill, decode, aggregated, tensor-parallel ranks).

The local launcher starts Ray inside ``control_plane``, so Ray's daemons and every actor they
start inherit the control plane's policy; a serving-path role lifts itself (``serving_path``),
a forward role takes the default policy back for its whole process (``epd.tensors.configure_threads``).
``EPD_CONTROL_POLICY`` picks the control plane's policy: ``idle`` (the default), ``batch`` (the
control plane at the serving path's), or ``default`` (every process at the default policy;
``EPD_CONTROL_BATCH=0``, the older switch, means the same). Measured in docs/BENCHMARKS.md,
"Prefill's elementwise passes in C++, the control plane as SCHED_BATCH, attention's prefetch"
and "Issue 18 on the AMD EPYC, a sixth time".
"""

from __future__ import annotations

import contextlib
import os

POLICY_ENV = "EPD_CONTROL_POLICY"
"""``idle`` (default), ``batch`` or ``default``: the policy of a local stack's control plane."""
CONTROL_BATCH_ENV = "EPD_CONTROL_BATCH"
"""The older switch: ``0`` is ``EPD_CONTROL_POLICY=default``."""

_NAMES = ("other", "batch", "idle")


def _policy_number(name: str) -> int:
    return {"other": os.SCHED_OTHER, "batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}[name]


def supported() -> bool:
    """Linux's non-real-time policies are there to set (not on other systems)."""
    return all(hasattr(os, attr) for attr in ("SCHED_BATCH", "SCHED_IDLE", "sched_setscheduler"))


def control_policy() -> str:
    """The control plane's policy by the environment: ``idle``, ``batch``, or "" (leave every
    process as it is). An unknown value is a ``ValueError`` that names the variable."""
    value = os.environ.get(POLICY_ENV, "").strip().lower()
    if not value:
        return "" if os.environ.get(CONTROL_BATCH_ENV, "1").strip() == "0" else "idle"
    if value == "default":
        return ""
    if value not in ("idle", "batch"):
        raise ValueError(f"{POLICY_ENV}={value!r}: expected idle, batch or default")
    return value


def current(tid: int = 0) -> str:
    """``other``, ``batch``, ``idle`` or ``realtime``: the policy of thread ``tid`` (0: the caller)."""
    number = os.sched_getscheduler(tid)
    for name in _NAMES:
        if number == _policy_number(name):
            return name
    return "realtime"


def set_policy(policy: str) -> None:
    """Every thread of this process to ``policy`` (``other``, ``batch`` or ``idle``). Real-time
    threads stay as they are (put there on purpose); nothing happens elsewhere than Linux."""
    if policy not in _NAMES:
        raise ValueError(f"unknown scheduling policy {policy!r}")
    if not supported():
        return
    wanted = _policy_number(policy)
    keep = {_policy_number(name) for name in _NAMES}
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getscheduler(int(tid)) in keep:
                os.sched_setscheduler(int(tid), wanted, os.sched_param(0))
        except OSError:  # a thread that ended meanwhile
            pass


def serving_path() -> None:
    """A role on the serving path that is no forward (router, encode front, the embedded Redis
    server, called in its process before it starts serving): from the control plane's
    ``SCHED_IDLE``, which it inherited from the daemon that started it, to ``SCHED_BATCH``.
    A process at any other policy keeps it (the stack runs with ``EPD_CONTROL_POLICY=batch`` or
    ``default``, or outside a local stack)."""
    if supported() and current() == "idle":
        set_policy("batch")


@contextlib.contextmanager
def control_plane():
    """The processes this process starts inside the block run at the control plane's policy
    (they inherit it); this process afterwards as before. Nothing with ``EPD_CONTROL_POLICY=default``."""
    policy = control_policy() if supported() else ""
    if not policy:
        yield
        return
    before = current()
    set_policy(policy)
    try:
        yield
    finally:
        set_policy(before if before in _NAMES else "other")
