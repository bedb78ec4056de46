"""One real `epd serve`, then what an operator does to it from another shell (issue 21):
server reflection answers as v1 and v1alpha listing every service of the router's port, health
included (`grpcurl list`); `epd status` answers (its header the state now) and is quiet when its reader goes away
(`epd status | head -4`), and `epd down` ends `epd serve` itself, not only its roles."""

from __future__ import annotations

import os
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


def test_status_then_down_ends_epd_serve(tiny_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    server = ServeProcess(tiny_model_dir, "--encoders", "1", log_path=str(log))
    try:
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
        try:  # the watch ends too, in one line
            _, watched = watch.communicate(timeout=60)
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait()
        assert watch.returncode == 1 and watched.strip().splitlines()[-1] == "epd: the deployment was stopped", watched
        assert "Traceback" not in watched, watched
        server.proc.wait(timeout=90)  # before: `epd serve` ran on with nothing behind it
        assert server.proc.returncode == 0, log.read_text()[-3000:]
        assert "epd serve: the deployment was stopped (`epd down`)" in log.read_text(), log.read_text()[-3000:]
    finally:
        left = server.stop()
    assert left == [], f"epd serve left processes behind: {left}"
