"""A peer that vanishes without closing its connections (a lost machine: no FIN, no RST) must fail
the calls to it with UNAVAILABLE, which callers retry elsewhere, instead of leaving them hanging
until their deadline; and the keepalive pings that find this out must not break a healthy stream.

The peer is a real gRPC server process with epd's options; "vanished" is SIGSTOP: its kernel still
holds the connection, but nothing answers the HTTP/2 pings (tests/test_node_loss.py takes a whole
machine's link down instead).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd import rpc

SERVER = """
import asyncio, sys
import grpc
from grpc_health.v1 import _async as health_aio, health_pb2, health_pb2_grpc
from epd import rpc

async def main():
    server = grpc.aio.server(options=rpc.CHANNEL_OPTIONS)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


@pytest.fixture
def server():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield proc, f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGKILL)  # works on a stopped process too
        proc.wait(timeout=30)


def _watch(address: str, timeout_s: float):
    channel = grpc.insecure_channel(address, options=rpc.CHANNEL_OPTIONS)
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    first = next(stream)
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    return channel, stream


def test_a_stream_from_a_peer_that_stops_answering_fails_unavailable_not_at_its_deadline(server):
    proc, address = server
    deadline_s = 20 * rpc.KEEPALIVE_S  # without keepalive the stream would end only here
    channel, stream = _watch(address, deadline_s)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failure:
            next(stream)
        waited = time.monotonic() - started
        assert failure.value.code() is grpc.StatusCode.UNAVAILABLE, (failure.value.code(), failure.value.details())
        assert waited < deadline_s / 2, f"the stream hung {waited:.0f} s"
    finally:
        channel.close()


def test_keepalive_pings_do_not_break_a_quiet_healthy_stream(server):
    _, address = server
    channel, stream = _watch(address, 4 * rpc.KEEPALIVE_S)
    try:
        # Nothing is sent on the stream; both ends ping. A server that refused the pings would end
        # it with UNAVAILABLE ("too_many_pings") long before the deadline.
        with pytest.raises(grpc.RpcError) as end:
            next(stream)
        assert end.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, (end.value.code(), end.value.details())
    finally:
        channel.close()
