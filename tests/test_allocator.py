"""The model roles' allocator (epd.allocator): when jemalloc is preloaded, and that a process
started with it runs torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from epd import allocator

pytestmark = pytest.mark.skipif(allocator.library() is None or not sys.platform.startswith("linux"),
                                reason="Ray's wheel ships no jemalloc here")


def test_role_env_preloads_rays_jemalloc_with_epds_settings():
    env = allocator.role_env({})
    assert env == {"LD_PRELOAD": allocator.library(), "MALLOC_CONF": allocator.CONF}
    assert os.path.basename(env["LD_PRELOAD"]) == "libjemalloc.so" and os.path.isfile(env["LD_PRELOAD"])
    # the operator's own jemalloc settings win
    assert allocator.role_env({"MALLOC_CONF": "narenas:2"})["MALLOC_CONF"] == "narenas:2"


@pytest.mark.parametrize("environ", [{allocator.ENV: "0"}, {"LD_PRELOAD": "/usr/lib/libtcmalloc.so"}])
def test_role_env_is_empty_when_turned_off_or_another_allocator_is_preloaded(environ):
    assert allocator.role_env(environ) == {}


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
