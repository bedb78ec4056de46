"""The memory allocator of the model roles' processes: jemalloc (the copy Ray ships with its wheel)
in place of glibc's malloc, set up before the process starts (``LD_PRELOAD``), and torch's large
CPU buffers on transparent huge pages (``THP_MEM_ALLOC_ENABLE``).

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

Huge pages: a decode step streams every weight once (~1.25 GB for the 0.8b in bfloat16, with the
screen's int8 head) and each row's recurrent state (1 MiB a row in each linear-attention layer): one TLB
entry a 4 KiB page. torch's CPU allocator, with ``THP_MEM_ALLOC_ENABLE=1``, aligns each buffer
of 2 MiB or more to 2 MiB and advises the kernel to back it with huge pages (``MADV_HUGEPAGE``,
which the kernel honours in its default ``madvise`` mode): the packed weights, the K/V pool and
the state slots. A bfloat16 decode step of the 0.8b in process, alternated: 8 rows 46.8-48.0 ms
against 50.7-51.1, 16 rows 76.1-82.4 against 83.3-92.4 (docs/BENCHMARKS.md, "Huge pages"; served,
the gain was within the host's noise). It costs up to 2 MiB of alignment a buffer, and a buffer's
memory is taken 2 MiB at a time as it is first touched. ``THP_MEM_ALLOC_ENABLE=0`` in the
launching environment turns it off; a kernel whose transparent huge pages are ``never`` ignores
the advice.
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
    """The environment variables of a model role's process: torch's huge pages (on unless the
    environment says ``THP_MEM_ALLOC_ENABLE`` itself) and jemalloc (unless turned off or another
    allocator is preloaded); empty off Linux."""
    if not sys.platform.startswith("linux"):
        return {}
    env = {THP_ENV: environ.get(THP_ENV, "1")}
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
