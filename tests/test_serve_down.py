"""One real `epd serve`, then what an operator does to it from another shell (issue 21):
server reflection answers as v1 and v1alpha listing every service of the router's port, health
included (`grpcurl list`); `epd status` answers (its header the state now) and is quiet when its reader goes away
(`epd status | head -4`), and `epd down` ends `epd serve` itself, not only its roles."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from tests.conftest import ServeProcess, epd, ray_address


def _reflect(address: str, version: str, request: reflection_pb2.ServerReflectionRequest):
    """One ServerReflectionInfo exchange over ``grpc.reflection.<version>`` (v1 and v1alpha
    messages are the same on the wire)."""
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        return next(iter(call(iter([request]), timeout=30)))


def _check_reflection(address: str) -> None:
    expected = {"epd.v1.Router", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"}
    for version in ("v1", "v1alpha"):
        listed = _reflect(address, version, reflection_pb2.ServerReflectionRequest(list_services=""))
        assert {s.name for s in listed.list_services_response.service} == expected, (version, listed)
        for symbol in ("grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "epd.v1.Router"):
            found = _reflect(address, version, reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol))
            assert found.HasField("file_descriptor_response"), (version, symbol, found)
            files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                     for raw in found.file_descriptor_response.file_descriptor_proto]
            package, _, service = symbol.rpartition(".")
            assert any(f.package == package and service in [s.name for s in f.service] for f in files), (symbol, files)


def test_status_then_down_ends_epd_serve_and_a_restart_takes_the_same_ports(tiny_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    port, http_port = _free_port(), _free_port()
    ports = ("--port", str(port), "--http-port", str(http_port))
    server = ServeProcess(tiny_model_dir, "--encoders", "1", *ports, log_path=str(log))
    held, watch = None, None
    try:
        assert server.address == f"127.0.0.1:{port}"
        held = _touch_http(http_port)  # a connection the router closes on stop: TIME_WAIT on its port
        _check_reflection(server.address)
        ray = ray_address(server)
        out = epd("status", "--address", ray, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "router: 1 of 1 serving" in out.stdout.splitlines(), out.stdout

        scale = epd("scale", "--address", ray, "encoders", "1", timeout=300)
        assert (scale.returncode, scale.stdout.strip()) == (0, "encoders: 1"), scale.stderr
        nobody = epd("status", "--address", ray, "--namespace", "nobody", timeout=120)
        assert nobody.returncode == 1 and "no epd deployment in namespace 'nobody'" in nobody.stderr, nobody.stderr

        read, write = os.pipe()
        os.close(read)  # the reader is gone before status writes a byte: `| head -0`
        closed = subprocess.run([sys.executable, "-m", "control.cli", "status", "--address", ray], stdout=write,
                                stderr=subprocess.PIPE, text=True, timeout=120)
        os.close(write)
        assert closed.returncode == 141, (closed.returncode, closed.stderr)
        assert "Traceback" not in closed.stderr and "BrokenPipe" not in closed.stderr, closed.stderr

        watch = subprocess.Popen([sys.executable, "-m", "control.cli", "status", "--address", ray, "--watch", "0.5"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert watch.stdout.readline().startswith("--- "), watch.stderr.read()  # it watches
        down = epd("down", "--address", ray, timeout=300)
        assert down.returncode == 0, down.stderr
        assert "epd deployment 'epd' stopped" in down.stdout, down.stdout
        _, watched = watch.communicate(timeout=60)  # the watch ends too, in one line
        assert watch.returncode == 1 and watched.strip().splitlines()[-1] == "epd: the deployment was stopped", watched
        assert "Traceback" not in watched, watched
        server.proc.wait(timeout=90)  # before: `epd serve` ran on with nothing behind it
        assert server.proc.returncode == 0, log.read_text()[-3000:]
        assert "epd serve: the deployment was stopped (`epd down`)" in log.read_text(), log.read_text()[-3000:]
        held.settimeout(30)  # the router closed it first: its end waits in TIME_WAIT once this one closes
        while held.recv(65536):
            pass
        held.close()
    finally:
        left = server.stop()
        if held is not None:
            held.close()
        if watch is not None and watch.poll() is None:
            watch.kill()
            watch.wait()
    assert left == [], f"epd serve left processes behind: {left}"

    # At once on the same ports (before: "cannot listen on 127.0.0.1:P: Address already in use"
    # while the stopped router's connections sat in TIME_WAIT).
    waiting = _states(port) | _states(http_port)
    assert "06" in waiting, f"no connection in TIME_WAIT on the ports ({waiting}): the restart proves nothing"
    again = ServeProcess(tiny_model_dir, "--encoders", "1", *ports, log_path=str(tmp_path / "again.log"))
    try:
        assert again.address == f"127.0.0.1:{port}", waiting
    finally:
        assert again.stop() == [], "the restarted epd serve left processes behind"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _touch_http(port: int) -> socket.socket:
    """A kept-alive HTTP connection to the front, which the router's side closes when it stops."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=30)
    connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert connection.recv(65536).startswith(b"HTTP/1.1 "), "the HTTP front did not answer"
    return connection


def _states(port: int) -> set[str]:
    """TCP states (hex, /proc/net/tcp) of the IPv4 sockets on local port ``port``; 06 is TIME_WAIT."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {row[3] for row in rows if int(row[1].rsplit(":", 1)[1], 16) == port}
