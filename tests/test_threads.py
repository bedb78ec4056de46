"""A role's CPU pinning (``--encoder-cpus``, ``--prefill-cpus``, ``--decode-cpus``): every thread
of the process moves to the cores, threads created before the call included, and torch runs one
thread per core. In a subprocess, so the test process keeps its own cores."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys, threading, time, torch
    from epd.config import ConfigError
    from epd.tensors import configure_threads

    early = threading.Thread(target=time.sleep, args=(30,), daemon=True)
    early.start()  # made before the pinning, as torch's and Ray's threads are in a role
    cores = sys.argv[1]
    try:
        configure_threads(0, "9999")
    except ConfigError as error:
        print("refused:", error)
    count = configure_threads(0, cores)
    masks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
    print("threads", count, torch.get_num_threads(), len(masks), sorted({str(m) for m in masks.values()}))
""")


def test_pinning_moves_every_thread_and_sets_one_torch_thread_per_core():
    core = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(core)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    refused, threads = out.stdout.strip().splitlines()
    assert refused.startswith("refused: cpus '9999': none of them is among this process's cores")
    assert threads.split(" ", 4)[:3] == ["threads", "1", "1"]
    assert int(threads.split(" ", 4)[3]) >= 2  # the early thread was there to be moved
    assert threads.endswith(f"['[{core}]']")
