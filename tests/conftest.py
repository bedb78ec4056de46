"""Shared fixtures: a tiny checkpoint, a real `epd serve` stack, and the transformers oracle."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

from epd import rpc

# Property tests are reproducible (a fixed seed per test), leave no example database behind, and
# have no per-example deadline (a loaded 2-core machine makes timings meaningless). Hypothesis's
# own cache (constants it reads from the code) goes to the temp directory, not into the repo.
settings.register_profile("epd", derandomize=True, database=None, deadline=None)
settings.load_profile("epd")
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "epd-hypothesis"))

READY_PREFIX = "epd ready at "
INTERNAL_TOKEN = "the-test-suite-internal-token-0123456789"


needs_compiler = pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None,
                                    reason="no C++ compiler or ninja on this machine")
"""For a test of epd's C++ kernels (``epd.fused``): built on this machine at first use."""


@pytest.fixture
def fresh_fused(monkeypatch):
    """The next ``fused.ops()`` / ``fused.decode_ops()`` decides again (and again after the test)."""
    from epd import fused

    monkeypatch.delenv(fused.ENV, raising=False)
    fused.reset()
    yield
    fused.reset()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from epd.checkpoint import create_checkpoint

    return str(create_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0, progress=False))


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory) -> str:
    """The mixture-of-experts preset (``tiny``'s dims, 8 experts, top 2, a shared expert)."""
    from epd.checkpoint import create_checkpoint

    return str(create_checkpoint("tiny-moe", tmp_path_factory.mktemp("ckpt") / "tiny-moe", seed=0, progress=False))


DEFAULT_MODE = "<epd serve's own choice of aggregated or separate prefill and decode>"
"""Give ServeProcess this among its arguments to start `epd serve` without --aggregate or
--no-aggregate."""


class ServeProcess:
    """`epd serve` in its own session; remembers every descendant so teardown can prove cleanup."""

    def __init__(self, model_dir: str, *extra: str, log_path: str, sigint_ignored: bool = False,
                 ready_timeout_s: float = 240) -> None:
        self.log = open(log_path, "w+")
        # sigint_ignored: start it the way a shell script starts a background job (SIGINT ignored,
        # inherited across exec), which must not stop Ctrl-C from stopping it.
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        # Separate prefill and decode replicas unless the test asks for a mode (most tests look at,
        # kill or scale the decode role); DEFAULT_MODE: the mode `epd serve` picks by itself.
        if DEFAULT_MODE in extra:
            extra = tuple(arg for arg in extra if arg != DEFAULT_MODE)
        elif "--aggregate" not in extra and "--no-aggregate" not in extra:
            extra = ("--no-aggregate", *extra)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "control.cli", "serve", "--model", model_dir, *extra],
            stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True, preexec_fn=ignore,
        )
        self.address = self._wait_ready(timeout_s=ready_timeout_s)
        self.descendants = psutil.Process(self.proc.pid).children(recursive=True)

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        self.lines: list[str] = []  # what it printed before it was ready (the local Ray's address)
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            self.lines.append(line)
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX):].strip()
            if not line and self.proc.poll() is not None:
                break
        self.stop()  # closes self.log
        with open(self.log.name) as log:
            raise RuntimeError(f"epd serve did not become ready:\n{log.read()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> list[psutil.Process]:
        """Send ``sig``, wait, and return whatever is still alive (should be nothing): every
        process it had at start and every one it has now (replicas Ray restarted are new ones)."""
        watched = {p.pid: p for p in getattr(self, "descendants", [])}
        if self.proc.poll() is None:
            try:
                watched.update({p.pid: p for p in psutil.Process(self.proc.pid).children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=150)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        alive = [p for p in watched.values() if _running(p)]
        deadline = time.monotonic() + 15
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [p for p in alive if _running(p)]
        for p in alive:  # never leave a process behind, even when the assertion below fails
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.log.close()
        return alive


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, FileNotFoundError):
        return False


@contextmanager
def serving(model_dir: str, *extra: str, log_path: str, ready_timeout_s: float = 240) -> Iterator[ServeProcess]:
    """`epd serve` for a fixture: started with ``extra`` flags, stopped after it, every process it
    started proven gone. ``ready_timeout_s``: how long it may take to start (stacks with more
    processes, e.g. tensor-parallel replicas, take longer on a loaded machine)."""
    server = ServeProcess(model_dir, *extra, log_path=log_path, ready_timeout_s=ready_timeout_s)
    try:
        yield server
    finally:
        assert server.stop() == [], "epd serve left processes behind"


def ray_address(server: ServeProcess) -> str:
    """The local Ray that `epd serve` started (it prints "ray at ADDRESS namespace NS")."""
    for line in server.lines:
        match = re.match(r"ray at (\S+) namespace", line)
        if match:
            return match.group(1)
    raise AssertionError(f"epd serve did not print its Ray address: {server.lines}")


def epd(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "control.cli", *args], capture_output=True, text=True, timeout=timeout)


def epd_status(address: str) -> dict:
    """`epd status --json` of the deployment on the Ray at ``address``. Each call joins Ray as a
    new driver; on two cores saturated by a test's load that took over the CLI's 10 s default
    (tests/test_cluster_scaling.py's burst, 2026-12-05), so the tests give it a minute."""
    out = epd("status", "--address", address, "--json", "--connect-timeout", "60")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


class StatusWatch:
    """`epd status --json --watch` in the background: the deployment's latest look, a fraction of
    a second old, without a new Ray driver per look."""

    def __init__(self, address: str, every_s: float = 0.2) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "control.cli", "status", "--address", address, "--json",
                                      "--watch", str(every_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.latest: dict | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.latest = json.loads(line)

    def since(self, moment: float, timeout_s: float = 60) -> dict:
        """The first look the controller took at ``moment`` (``time.time()``) or later."""
        deadline = time.monotonic() + timeout_s
        while self.latest is None or self.latest["time"] < moment:
            if self.proc.poll() is not None:
                raise AssertionError(f"epd status --watch exited {self.proc.returncode}: {self.proc.stderr.read()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no status look within {timeout_s:.0f} s")
            time.sleep(0.05)
        return self.latest

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=10)


@pytest.fixture(scope="session")
def serve(tiny_model_dir, tmp_path_factory):
    """The shared stack. Its internal token is known (``server.internal``: metadata to send), so a
    test may call an internal service the way another role would."""
    secrets_dir = tmp_path_factory.mktemp("secrets")
    (secrets_dir / "token").write_text(INTERNAL_TOKEN)
    with serving(tiny_model_dir, "--encoders", "2", "--internal-token-file", str(secrets_dir / "token"),
                 log_path=str(tmp_path_factory.mktemp("logs") / "serve.log")) as server:
        server.internal = ((rpc.INTERNAL_TOKEN_KEY, INTERNAL_TOKEN),)
        yield server


@pytest.fixture(scope="module")
def redis_url():
    """An embedded Redis of its own for one test module (the engines' embedding store)."""
    from control.redis_server import EmbeddedRedis

    server = EmbeddedRedis(max_memory_mb=64)
    yield server.url
    server.stop()


OPENAI_MODEL = "epd-tiny"
"""The model name the OpenAI-front stack answers to (``--served-model-name``)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def openai_stack(tiny_model_dir, tmp_path_factory):
    """A stack with the OpenAI-compatible HTTP front on a free port (``server.http``: host:port),
    answering to ``OPENAI_MODEL``; ``server.openai`` is an ``openai.OpenAI`` client of it (no
    retries, 120 s timeout). One for the session: the modules that use it (completions, choices,
    logits processing, compat) only send requests, so they share it rather than each paying a
    stack's ~30 s start."""
    import openai

    port = free_port()
    with serving(tiny_model_dir, "--encoders", "1", "--http-port", str(port), "--served-model-name", OPENAI_MODEL,
                 log_path=str(tmp_path_factory.mktemp("logs") / "serve.log")) as server:
        server.http = f"127.0.0.1:{port}"
        server.openai = openai.OpenAI(base_url=f"http://{server.http}/v1", api_key="unused", max_retries=0,
                                      timeout=120)
        yield server


@pytest.fixture(scope="session")
def addr(serve) -> str:
    return serve.address


@pytest.fixture(scope="session")
def oracle(tiny_model_dir):
    from bench.oracle import Oracle

    return Oracle(tiny_model_dir)


@pytest.fixture(scope="session")
def moe_oracle(tiny_moe_model_dir):
    """transformers' Qwen3_5MoeForConditionalGeneration on the tiny-moe checkpoint."""
    from bench.oracle import Oracle

    return Oracle(tiny_moe_model_dir)
