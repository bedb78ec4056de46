"""The memory allocator of the model roles' processes: jemalloc (the copy Ray ships with its wheel)
in place of glibc's malloc, set up before the process starts (``LD_PRELOAD``).

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
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

ENV = "EPD_JEMALLOC"
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
    """The environment variables that give a model role's process jemalloc; empty where it does
    not apply (turned off, an allocator already preloaded, not Linux, no library)."""
    if environ.get(ENV, "1") == "0" or environ.get("LD_PRELOAD") or not sys.platform.startswith("linux"):
        return {}
    path = library()
    if path is None:
        return {}
    return {"LD_PRELOAD": path, "MALLOC_CONF": environ.get("MALLOC_CONF", CONF)}


def in_use(pid: int | str = "self") -> bool:
    """Whether process ``pid`` has jemalloc loaded (Linux: its memory maps name the library)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return any("libjemalloc" in line for line in maps)
    except OSError:
        return False
