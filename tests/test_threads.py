"""A role's CPU pinning (``--encoder-cpus``, ``--prefill-cpus``, ``--decode-cpus``): every thread
of the process moves to the cores, threads created before the call included, and torch runs one
thread per core; and only a forward's thread holds an OpenMP team. In subprocesses, so the test
process keeps its own cores and threads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

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


TEAMS = textwrap.dedent("""
    import os, threading, torch
    from epd.tensors import configure_threads, forward_team, release_thread_team

    def threads():
        return len(os.listdir("/proc/self/task"))

    def work():
        torch.ones(1 << 22).add_(1)  # large enough for a parallel region

    count = configure_threads(2, "")
    before = threads()
    work()  # the configuring thread loads the weights: on the whole team
    loaded = threads()
    print("loaded", count, torch.get_num_threads(), loaded - before)
    release_thread_team()
    print("released", torch.get_num_threads(), threads() - before)

    done, team, started = threading.Event(), {}, threading.Barrier(4)
    def other(name, forward):
        if forward:
            forward_team()
        work()
        team[name] = torch.get_num_threads()
        started.wait()
        done.wait()
    base = threads()
    handlers = [threading.Thread(target=other, args=(f"io{i}", False)) for i in range(2)]
    loop = threading.Thread(target=other, args=("forward", True))
    for thread in [*handlers, loop]:
        thread.start()
    started.wait()
    print("serving", sorted(team.items()), threads() - base)
    done.set()
""")


def test_only_forward_threads_hold_an_openmp_team():
    """libgomp throttles every pool's spin once a process's pools hold more threads than it has
    cores (epd/tensors.py): the threads that are not a forward's run their parallel ops alone and
    start no pool, and the thread that loaded the weights gives its pool back."""
    from epd import tensors

    if tensors._openmp()[0] is None:
        pytest.skip("torch here does not run on libgomp: threads keep torch's process-wide count")
    out = subprocess.run([sys.executable, "-c", TEAMS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, released, serving = out.stdout.strip().splitlines()
    assert loaded == "loaded 2 2 1"  # the loading thread's team: one more thread
    assert released == "released 1 0"  # ... which exits with the pool
    # two handler threads alone, the forward's on two: three Python threads and one pool thread
    assert serving == "serving [('forward', 2), ('io0', 1), ('io1', 1)] 4"


FIRST_OP = textwrap.dedent("""
    import threading, torch
    from epd import kernels_prefill
    from epd.tensors import _openmp, configure_threads, forward_team

    configure_threads(2, "")
    gomp = _openmp()[0]
    kernels_prefill.gdn_chunk_op()  # loads epd's own C++ operators, built apart from libtorch
    conv = torch.ops.epd_gdn_chunk.conv
    seen = []

    def forward():
        for _ in range(2):
            forward_team()
            seen.append(gomp.omp_get_max_threads())
            # a parallel op of the library, its first on this thread the first time round
            conv(torch.ones(1, 64, 2048), None, torch.ones(4, 2048), None, True)
            seen.append(gomp.omp_get_max_threads())

    thread = threading.Thread(target=forward)
    thread.start()
    thread.join()
    print(*seen)
""")


def test_a_forward_thread_keeps_its_team_after_an_extension_resets_it():
    """ATen's first parallel op on a thread in a library built apart from libtorch (epd's C++
    operators) sets that thread back to torch's process-wide count (1 in a role): the next
    forward's ``forward_team`` must find that out and give the thread its team again, not trust
    the size it set before (a lone role ran every forward after its first on one thread)."""
    from epd import kernels_prefill, tensors

    if tensors._openmp()[0] is None or kernels_prefill.gdn_chunk_op() is None:
        pytest.skip("needs libgomp and epd's C++ operators")
    out = subprocess.run([sys.executable, "-c", FIRST_OP], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    before_first, after_first, before_second, after_second = map(int, out.stdout.split())
    assert before_first == 2
    assert before_second == 2, out.stdout  # the team given back, whatever the first op did to it
    assert after_second == 2  # the library's first-use reset happens once a thread


POLICY = textwrap.dedent("""
    import os, subprocess, sys, threading, time
    from epd import sched
    from epd.tensors import configure_threads

    def policies(pid="self"):
        return sorted({os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")})

    early = threading.Thread(target=time.sleep, args=(30,), daemon=True)
    early.start()  # a thread made before: Ray's and torch's in a role
    with sched.control_plane():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        inside = policies()
    print("inside", inside == [os.SCHED_IDLE], "after", policies() == [os.SCHED_OTHER],
          "child", policies(child.pid) == [os.SCHED_IDLE])
    child.kill()
    sched.set_policy("idle")  # a serving-path role's process, started by an idle daemon
    sched.serving_path()
    print("serving", policies() == [os.SCHED_BATCH])
    sched.set_policy("idle")  # a forward role's process, started by an idle daemon
    late = threading.Thread(target=time.sleep, args=(30,), daemon=True)
    late.start()
    configure_threads(1, "")
    sched.serving_path()  # a forward role serves too: it keeps the default policy
    print("forward", policies() == [os.SCHED_OTHER])
""")


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_the_control_plane_starts_idle_the_serving_path_as_batch_and_a_forward_role_takes_the_default_policy():
    out = subprocess.run([sys.executable, "-c", POLICY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["inside", "True", "after", "True", "child", "True", "serving", "True",
                                  "forward", "True"]
    off = subprocess.run([sys.executable, "-c", POLICY], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "EPD_CONTROL_POLICY": "default"})
    assert off.returncode == 0, off.stderr
    assert off.stdout.split()[:6] == ["inside", "False", "after", "True", "child", "False"]
    older = subprocess.run([sys.executable, "-c", POLICY], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "EPD_CONTROL_BATCH": "0"})
    assert older.stdout.split()[:6] == ["inside", "False", "after", "True", "child", "False"], older.stderr


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_the_control_plane_policy_can_be_batch_and_a_wrong_value_is_named(monkeypatch):
    from epd import sched

    monkeypatch.setenv("EPD_CONTROL_POLICY", "batch")
    assert sched.control_policy() == "batch"
    monkeypatch.setenv("EPD_CONTROL_POLICY", "lowest")
    with pytest.raises(ValueError, match="EPD_CONTROL_POLICY='lowest': expected idle, batch or default"):
        sched.control_policy()
    monkeypatch.delenv("EPD_CONTROL_POLICY")
    assert sched.control_policy() == "idle"


FORWARD_ROLES = ("ray::EncoderEngine", "ray::PrefillServer", "ray::DecodeServer", "ray::AggregateServer")


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_a_served_stack_runs_its_forwards_at_the_default_policy_its_serving_path_as_batch_the_rest_idle(serve):
    import psutil

    seen = {"forward": 0, "serving": 0, "control": 0}
    for process in psutil.Process(serve.proc.pid).children(recursive=True):
        try:
            name = " ".join(process.cmdline())
            policies = {os.sched_getscheduler(thread.id) for thread in process.threads()}
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
        if any(name.startswith(role) for role in FORWARD_ROLES):
            assert policies == {os.SCHED_OTHER}, name
            seen["forward"] += 1
        elif name.startswith(("ray::RouterServer", "ray::EncodeServer")) or "redis-server" in name:
            assert policies == {os.SCHED_BATCH}, name
            seen["serving"] += 1
        elif name.startswith(("ray::Controller", "ray::Registry", "ray::RedisKeeper")) \
                or "gcs_server" in name or "/raylet" in name:
            assert policies == {os.SCHED_IDLE}, name
            seen["control"] += 1
    assert seen["forward"] >= 4, seen  # 2 encoders, prefill, decode
    assert seen["serving"] >= 3 and seen["control"] >= 5, seen  # router, encode front, Redis; 3 actors, 2 daemons
    assert os.sched_getscheduler(serve.proc.pid) == os.SCHED_IDLE  # the launcher itself, waiting


HEAP_SCRIPT = textwrap.dedent("""
    import gc, weakref
    from epd.tensors import freeze_startup_heap

    gc.disable()  # only the explicit collection below may free the cycle
    class Node:
        pass
    freed = []
    a, b = Node(), Node()
    a.other, b.other = b, a  # garbage that only the collector frees
    weakref.finalize(a, freed.append, "cycle")
    del a, b
    kept = [Node() for _ in range(1000)]
    print("not served", freeze_startup_heap(), gc.get_freeze_count(), freed)
    frozen = freeze_startup_heap(served=True)
    print("served", frozen >= 1000, frozen == gc.get_freeze_count(), freed,
          any(o is kept for o in gc.get_objects()))
""")


def test_a_served_process_frees_its_garbage_then_freezes_the_rest_and_any_other_keeps_its_heap():
    """``freeze_startup_heap``: outside a Ray worker nothing; in one (``served``) the cycles that
    are garbage already are freed first, then every object left (the 1,000 kept) leaves the
    collector's view, so a full collection no longer walks them."""
    out = subprocess.run([sys.executable, "-c", HEAP_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["not served 0 0 []", "served True True ['cycle'] False"], out.stdout
