"""The core share of co-located roles (epd.core_share): a forward's thread team is the cores
divided by the roles computing at that moment, told by real flocks of real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import torch

from epd import core_share

HOLDER = """
import os, sys, time
os.environ["EPD_CORE_SHARE"] = sys.argv[1]
from epd import core_share
share = core_share.enable(4)
with share.forward() as threads:
    print(threads, flush=True)
    time.sleep(600)
"""


def _holder(directory: str, threads: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, directory], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.stdout.readline().strip() == str(threads)  # its share, counting the holders before it
    return proc


def test_a_forward_gets_the_cores_divided_by_the_roles_computing(tmp_path, monkeypatch):
    directory = str(tmp_path / "share")
    os.mkdir(directory)
    before = torch.get_num_threads()
    share = core_share.CoreShare(directory, cores=4)
    first = second = None
    try:
        with share.forward() as threads:
            assert threads == 4 and torch.get_num_threads() == 4  # nobody else computes
        first = _holder(directory, 4)  # the test process is not computing: every core
        share._scanned = 0.0  # read the directory again now, not in RESCAN_S
        with share.forward() as threads:
            assert threads == 2 and torch.get_num_threads() == 2
        second = _holder(directory, 2)  # the first one computes
        share._scanned = 0.0
        assert share.busy_others() == 2
        with share.forward() as threads:
            assert threads == 1
        os.kill(second.pid, signal.SIGKILL)  # a dead role releases its mark with its descriptor
        second.wait(timeout=30)
        deadline = time.monotonic() + 10
        while share.busy_others() != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert share.busy_others() == 1
        share._scanned = 0.0
        share.busy_others()
        assert not os.path.exists(os.path.join(directory, f"{second.pid}.busy"))  # a dead role's file goes
        first.terminate()
        first.wait(timeout=30)
        assert share.busy_others() == 0
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        share.close()
        torch.set_num_threads(before)
    assert not os.path.exists(share.path)


def test_a_role_does_not_make_a_missing_share_directory(tmp_path, monkeypatch):
    """The launcher makes the directory and removes it at stop; a role starting while the stack
    stops (after the removal) must not make it again and leave it behind."""
    gone = tmp_path / "stopped"
    monkeypatch.setenv(core_share.ENV, str(gone))
    monkeypatch.setattr(core_share, "_SHARE", None)
    assert core_share.enable(2) is None
    assert not gone.exists()


def test_without_the_variable_nothing_changes(monkeypatch):
    monkeypatch.delenv(core_share.ENV, raising=False)
    assert core_share.enable(2) is None
    before = torch.get_num_threads()
    with core_share.forward_turn():
        assert torch.get_num_threads() == before


def test_a_long_forward_resizes_its_team_when_another_role_starts_or_stops(tmp_path):
    """A forward's team follows the other roles between its layers (``rebalance``): it shrinks
    when another role starts computing part-way and grows back when that one stops, not only at
    the next forward; outside a forward, or from another thread, nothing changes."""
    directory = str(tmp_path / "share")
    os.mkdir(directory)
    before = torch.get_num_threads()
    share = core_share.CoreShare(directory, cores=4)
    other = None
    try:
        share.rebalance()  # not in a forward: nothing to resize
        assert share.threads == 0
        with share.forward() as threads:
            assert threads == 4
            other = _holder(directory, 2)  # starts computing while this forward runs (its share: 2)
            share._scanned = share._probed = 0.0
            assert share.rebalance() == 2 and torch.get_num_threads() == 2
            share._probed = time.monotonic()
            other_thread = []
            thread = threading.Thread(target=lambda: other_thread.append(share.rebalance()))
            thread.start()
            thread.join()
            assert other_thread == [2]  # another thread than the forward's changes nothing
            other.terminate()  # it stops; the forward is still running
            other.wait(timeout=30)
            deadline = time.monotonic() + 10
            while share.busy_others() and time.monotonic() < deadline:
                time.sleep(0.05)
            share._probed = 0.0
            assert share.rebalance() == 4 and torch.get_num_threads() == 4
            other = _holder(directory, 2)
            share._scanned = 0.0
            share._probed = time.monotonic()  # within REBALANCE_S of the last probe: no probe yet
            assert share.rebalance() == 4
            share._probed = 0.0
            assert share.rebalance() == 2
    finally:
        if other is not None and other.poll() is None:
            other.kill()
            other.wait()
        share.close()
        torch.set_num_threads(before)
