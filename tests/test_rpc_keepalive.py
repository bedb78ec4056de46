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
import asyncio
from grpc_health.v1 import health_pb2
from epd import rpc

async def main():
    # A role's own server (its options), with nothing but grpc.health.v1 on it.
    server, port, health = await rpc._start_server([], "127.0.0.1", 0, [], None, rpc.MAX_MESSAGE_BYTES)
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
    channel = rpc.Transport().channel(address)  # how every role and the controller open channels
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


def test_the_servers_accept_the_pings_of_an_idle_channel(server):
    """Idle channels ping too (a new call must not start on a dead connection); a server that
    refused those pings would answer with GOAWAY "too_many_pings" and drop the connection."""
    _, address = server
    channel = rpc.Transport().channel(address)
    states: list[str] = []
    channel.subscribe(lambda state: states.append(state.name), try_to_connect=True)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        time.sleep(5 * rpc.KEEPALIVE_S)  # the default policy drops it after 2 unwanted pings
        assert states[-1] == "READY" and states.count("READY") == 1, states  # connected once, never dropped
    finally:
        channel.close()
