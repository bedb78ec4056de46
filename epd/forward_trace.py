"""One JSON line per model forward, for finding where a deployment's time goes.

With ``EPD_FORWARD_TRACE=/path/trace.jsonl`` in the environment of ``epd serve`` (or ``epd bench
--model``; role processes inherit it), every forward of every model role on the host (a vision
batch, a decode step with the prefill chunks riding it, a prefill step; a tensor-parallel
replica's forward is its leader's line) appends one line to that file as it ends::

    {"role": "prefill-2", "pid": 4211, "start": 1796561132.49, "end": 1796561133.06, "cpu_s": 0.98,
     "threads": [2, 1], "rows": 3, "prefill_tokens": 1197, "prompts": 4}

``start``/``end`` are Unix times (the roles' lines interleave on one clock), ``cpu_s`` the
process's CPU time over the forward (every thread of its team), ``threads`` its thread team at the
start and at the end (the core share may resize it between layers: ``epd/core_share.py``), then
what the forward carried: ``rows`` decode rows, ``prefill_tokens`` in ``prompts`` prompt chunks,
``images`` (and ``patches``) for the encoder. ``python -m bench.forward_trace FILE`` prints the
timeline and each role's busy time. It is how docs/BENCHMARKS.md read a W1 wave ("Issue 18 on the
AMD EPYC, a third time").

Each process opens the file once in append mode and writes whole lines (one ``write`` each, so the
roles' lines do not tear); a forward of tens of milliseconds or more pays a few microseconds for
it. A path that cannot be opened is said once in the log and the process traces nothing. Unset
(the default), nothing is measured or written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

ENV = "EPD_FORWARD_TRACE"

_local = threading.local()  # .fields: what the calling thread's next forward carries
_lock = threading.Lock()
_file = None
_opened_path: str | None = None
_role = ""


def note(**fields: int) -> None:
    """What the calling thread's next forward carries (``rows=8, prefill_tokens=300``); kept until
    that forward's line is written. Nothing to do when tracing is off."""
    if os.environ.get(ENV):
        _local.fields = fields


def _sink():
    """This process's trace file (opened on first use), or None when tracing is off or failed."""
    global _file, _opened_path
    path = os.environ.get(ENV, "")
    if not path:
        return None
    if _opened_path == path:
        return _file
    with _lock:
        if _opened_path != path:
            if _file is not None:
                _file.close()
            try:
                # a line at a time: one write per forward, O_APPEND keeps the processes' lines whole
                _file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept for the process
            except OSError as error:
                log.warning("%s=%s cannot be opened (%s): this process traces no forwards", ENV, path, error)
                _file = None
            _opened_path = path
    return _file


@contextlib.contextmanager
def span(threads: Callable[[], int]) -> Iterator[None]:
    """Around one forward: its line when tracing is on (``threads()`` reads the team size at the
    start and at the end); nothing otherwise."""
    sink = _sink()
    if sink is None:
        yield
        return
    fields = getattr(_local, "fields", None) or {}
    _local.fields = None
    first = threads()
    start, cpu = time.time(), time.process_time()
    try:
        yield
    finally:
        end, cpu = time.time(), time.process_time() - cpu
        global _role
        if not _role:  # the process's part never changes; the actor's name is looked up once
            from epd.logs import role_name

            _role = role_name()
        line = {"role": _role, "pid": os.getpid(), "start": round(start, 6), "end": round(end, 6),
                "cpu_s": round(cpu, 6), "threads": [first, threads()], **fields}
        with _lock:
            with contextlib.suppress(OSError, ValueError):  # a full disk or a closed file never fails a forward
                sink.write(json.dumps(line) + "\n")
