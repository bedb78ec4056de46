"""`epd status`, `epd scale` and `epd down` give up on an address where no deployment answers
within `--connect-timeout` (10 s by default) with one line, and Ctrl-C stops them at once
(issue 21: they used to hang for minutes in Ray's driver, printing its C++ retry warnings)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from tests.test_cli_errors import assert_one_line_error


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _silent_server():
    """Accepts TCP connections and never says a word: a port that is open, but no GCS."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []

    def accept():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            held.append(connection)

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1], held
    finally:
        listener.close()
        for connection in held:
            connection.close()


def _run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "control.cli", *args], capture_output=True, text=True, timeout=60)
    return out, time.monotonic() - started


@pytest.mark.parametrize("command", [["status"], ["scale", "encoders", "2"], ["down"]])
def test_nothing_listening_is_one_line_in_seconds(command):
    address = f"127.0.0.1:{_closed_port()}"
    out, took = _run(command[0], "--address", address, *command[1:])
    assert_one_line_error(out, f"epd {command[0]}: no epd deployment answers at {address}", code=1)
    assert took < 10, took


def test_an_open_port_that_never_answers_is_given_up_on_at_the_timeout():
    with _silent_server() as (port, _):
        out, took = _run("status", "--address", f"127.0.0.1:{port}", "--connect-timeout", "3")
    line = assert_one_line_error(out, f"epd status: no epd deployment answers at 127.0.0.1:{port}", code=1)
    assert "within 3 s" in line, line
    assert out.stderr.strip() == line  # none of Ray's retry warnings
    assert 3 <= took < 10, took


def test_ctrl_c_while_connecting_stops_at_once():
    with _silent_server() as (port, held):
        proc = subprocess.Popen([sys.executable, "-m", "control.cli", "status", "--address", f"127.0.0.1:{port}",
                                 "--connect-timeout", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            deadline = time.monotonic() + 60
            while len(held) < 2:  # the TCP probe's connection, then Ray's driver's: inside ray.init now
                assert time.monotonic() < deadline and proc.poll() is None, "epd status never tried Ray"
                time.sleep(0.05)
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            sent = time.monotonic()
            stdout, stderr = proc.communicate(timeout=30)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert "Traceback" not in stderr and stderr.strip() == "", stderr
    assert took < 3, took


def test_deploy_to_nothing_listening_is_one_line_in_seconds(tiny_model_dir):
    address = f"127.0.0.1:{_closed_port()}"
    out, took = _run("deploy", "--address", address, "--model", tiny_model_dir, "--redis", "redis://127.0.0.1:1/0",
                     "--allow-plaintext-internal")
    assert_one_line_error(out, f"epd deploy: no Ray cluster answers at {address}", code=1)
    assert took < 10, took
