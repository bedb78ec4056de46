"""The model roles' allocator (epd.allocator): when jemalloc is preloaded, that a process started
with it runs torch, and that the operator's huge-page setting reaches it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from epd import allocator

LINUX = sys.platform.startswith("linux")
needs_jemalloc = pytest.mark.skipif(allocator.library() is None or not LINUX,
                                    reason="Ray's wheel ships no jemalloc here")


@needs_jemalloc
def test_role_env_preloads_rays_jemalloc_with_epds_settings():
    env = allocator.role_env({})
    assert env == {"LD_PRELOAD": allocator.library(), "MALLOC_CONF": allocator.CONF}
    assert os.path.basename(env["LD_PRELOAD"]) == "libjemalloc.so" and os.path.isfile(env["LD_PRELOAD"])
    # the operator's own jemalloc settings win
    assert allocator.role_env({"MALLOC_CONF": "narenas:2"})["MALLOC_CONF"] == "narenas:2"


@pytest.mark.skipif(not LINUX, reason="jemalloc and huge pages are set up on Linux only")
@pytest.mark.parametrize("environ", [{allocator.ENV: "0"}, {"LD_PRELOAD": "/usr/lib/libtcmalloc.so"}])
def test_role_env_is_empty_when_turned_off_or_another_allocator_is_preloaded(environ):
    assert allocator.role_env(environ) == {}


@pytest.mark.skipif(not LINUX, reason="jemalloc and huge pages are set up on Linux only")
@pytest.mark.parametrize("setting", ["1", "0"])
def test_the_operators_own_huge_page_setting_is_passed_on(setting):
    assert allocator.role_env({allocator.THP_ENV: setting, allocator.ENV: "0"}) == {allocator.THP_ENV: setting}


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as modes:
            return next(word[1:-1] for word in modes.read().split() if word.startswith("["))
    except (OSError, StopIteration):
        return "never"


@pytest.mark.skipif(not LINUX or _thp_mode() == "never", reason="this kernel gives no transparent huge pages")
@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_role_process_puts_its_large_tensors_on_huge_pages_when_asked(setting):
    """With the operator's ``1`` passed on, a role's 64 MiB tensor is (mostly) huge pages, whatever
    the kernel's mode (``madvise`` waits for the advice torch gives); with ``0`` it is not, where
    the kernel's mode is ``madvise``."""
    code = ("import torch\n"
            "x = torch.empty(64 << 20, dtype=torch.uint8); x.fill_(1)\n"
            "rollup = open('/proc/self/smaps_rollup').read().splitlines()\n"
            "print(next(int(line.split()[1]) for line in rollup if 'AnonHugePages' in line))\n")
    env = {k: v for k, v in os.environ.items() if k != allocator.THP_ENV}
    env.update(allocator.role_env({**env, allocator.THP_ENV: setting}))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    huge_kib = int(result.stdout.split()[-1])
    if setting == "1":
        # at least half of it (the kernel may lack free huge pages for some)
        assert huge_kib >= 32 << 10, result.stdout
    elif _thp_mode() == "madvise":
        assert huge_kib < 32 << 10, result.stdout


@needs_jemalloc
def test_a_process_started_with_it_has_jemalloc_and_runs_torch():
    code = ("import threading, torch\n"
            "from epd import allocator\n"
            "out = []\n"
            "def forward():\n"  # large activations freed and allocated again on a thread, as a role's forward
            "    for _ in range(3):\n"
            "        x = torch.ones(4096, 4096)\n"
            "        out.append(float((x @ x[:, :8]).sum()))\n"
            "t = threading.Thread(target=forward); t.start(); t.join()\n"
            "print(allocator.in_use(), out)\n")
    env = {**os.environ, **allocator.role_env({})}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "True", result.stdout
    assert result.stdout.count(str(4096.0 * 8 * 4096)) == 3
    plain = subprocess.run([sys.executable, "-c", "from epd import allocator; print(allocator.in_use())"],
                           env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, capture_output=True,
                           text=True, timeout=60)
    assert plain.stdout.strip() == "False", plain.stdout + plain.stderr
