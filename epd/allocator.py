"""The memory allocator of the model roles' processes: jemalloc (the copy Ray ships with its wheel)
in place of glibc's malloc, set up before the process starts (``LD_PRELOAD``), and torch's large
CPU buffers on transparent huge pages where the operator asks for it (``THP_MEM_ALLOC_ENABLE``).

Why: a role runs its forwards on a thread of its own (the decode loop, the encoder's worker), not
on the process's main thread (Ray's). glibc gives such a thread an arena of its own made of heaps
it unmaps or trims as soon as a forward's large activations are freed, and above 32 MiB it always
maps and unmaps; so every prompt step faulted its activations in again and the kernel zeroed each
page: a 2,048-token prefill step took 3.4-4.1 s on such a thread (327-431k page faults, 0.8-1.4 s
of system time) against 3.0-3.3 s on the main thread (50-60k faults), and served it spent 1.1 s
of its 6.3 s of CPU in the kernel (docs/BENCHMARKS.md, "Where a served W1 wave's time goes").
glibc's own tunables did not help there. jemalloc keeps freed pages for ``dirty_decay_ms`` and
hands them back after that (an idle replica shrinks again). ``oversize_threshold:0``: jemalloc
otherwise puts allocations over 8 MiB in an arena of their own that returns them at once, which
faulted even more than glibc (2 million faults a step; likely why a session before this one
measured jemalloc with its defaults 40% slower).

``EPD_JEMALLOC=0`` in the environment of the process that starts the replicas (``epd serve``,
``epd deploy``, the controller) keeps glibc's allocator; an ``LD_PRELOAD`` already set there is
left as it is (the operator chose an allocator). The library path is this host's Ray wheel's: a
cluster whose nodes keep Ray elsewhere gets a warning from the loader on those nodes, which then
run with glibc's allocator.

Huge pages: torch's CPU allocator, with ``THP_MEM_ALLOC_ENABLE=1``, aligns each buffer of 2 MiB
or more to 2 MiB and advises the kernel to back it with huge pages (``MADV_HUGEPAGE``): the packed
weights, the K/V pool, the recurrent-state slots, which a decode step streams once each. Where
the launching environment sets it, the roles get the same value on every node (a cluster's
roles do not inherit the deploying shell's environment). It is off by default: in process a
bfloat16 decode step of the 0.8b was 2-8% shorter with it (alternated: 8 rows 46.8-48.0 against
50.7-51.1 ms, 16 rows 76.1-82.4 against 83.3-92.4), but served, on W1 and W2, the difference
stayed within the test machine's noise (docs/BENCHMARKS.md, "Huge pages"), and with the kernel's
``madvise`` defrag a fault in such a buffer may compact memory on the spot, a stall a
long-running host with fragmented memory can see.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

ENV = "EPD_JEMALLOC"
THP_ENV = "THP_MEM_ALLOC_ENABLE"
"""torch's switch (c10's CPU allocator) for buffers of 2 MiB and more on transparent huge pages."""
CONF = "oversize_threshold:0,dirty_decay_ms:10000,muzzy_decay_ms:0"
"""jemalloc's settings for a role (``MALLOC_CONF``, unless the environment sets its own)."""


def library() -> str | None:
    """The jemalloc shared library Ray's wheel ships (``ray/core/libjemalloc.so``), if present."""
    try:
        import ray
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(ray.__file__), "core", "libjemalloc.so")
    return path if os.path.isfile(path) else None


def role_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The environment variables of a model role's process: jemalloc (unless turned off or another
    allocator is preloaded), and the operator's own ``THP_MEM_ALLOC_ENABLE`` where set; empty off
    Linux."""
    if not sys.platform.startswith("linux"):
        return {}
    env = {THP_ENV: environ[THP_ENV]} if THP_ENV in environ else {}
    path = library()
    if environ.get(ENV, "1") != "0" and not environ.get("LD_PRELOAD") and path is not None:
        env.update({"LD_PRELOAD": path, "MALLOC_CONF": environ.get("MALLOC_CONF", CONF)})
    return env


def in_use(pid: int | str = "self") -> bool:
    """Whether process ``pid`` has jemalloc loaded (Linux: its memory maps name the library)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return any("libjemalloc" in line for line in maps)
    except OSError:
        return False
