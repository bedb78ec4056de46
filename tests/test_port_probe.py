"""`epd serve`'s pre-flight port check binds the way its servers do (SO_REUSEADDR): a port whose
last connections are in TIME_WAIT after a stop is free to restart on at once, a port another
process listens on is still refused (issue 21: restarts failed for 20-60 s with "Address already
in use")."""

from __future__ import annotations

import socket
import time

from control.cli import _port_in_use


def _port_in_time_wait() -> int:
    """A port whose listener is gone and whose accepted connection was closed by the server side
    first, so that connection sits in TIME_WAIT on the port: a server stopped a moment ago."""
    listener = socket.socket()
    # As the stopped deployment's servers had it (gRPC and the HTTP front both set it): a
    # TIME_WAIT socket lets a new bind through only when both sides asked for SO_REUSEADDR.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server side closes first: its end goes to TIME_WAIT
    client.recv(1)  # sees the FIN
    client.close()
    listener.close()
    deadline = time.monotonic() + 10
    while _states(port) != {"06"}:  # every socket on the port in TIME_WAIT (FIN_WAIT2 until the client's FIN)
        assert time.monotonic() < deadline, _states(port)
        time.sleep(0.01)
    return port


def _states(port: int) -> set[str]:
    """The TCP states (hex, /proc/net/tcp) of the IPv4 sockets whose local port is ``port``."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {row[3] for row in rows if int(row[1].rsplit(":", 1)[1], 16) == port}


def test_a_port_in_time_wait_is_free_to_restart_on():
    port = _port_in_time_wait()
    with socket.socket() as plain:  # what the old probe did: refused while TIME_WAIT lasts
        try:
            plain.bind(("127.0.0.1", port))
            in_time_wait = False
        except OSError:
            in_time_wait = True
    assert in_time_wait, "the kernel left no TIME_WAIT socket; the test proves nothing"
    assert _port_in_use("127.0.0.1", port) == ""


def test_a_port_another_process_listens_on_is_still_refused():
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a gRPC or HTTP server sets it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _port_in_use("127.0.0.1", port) == f"cannot listen on 127.0.0.1:{port}: Address already in use"
