"""gRPC plumbing every role shares: servers with standard health checking, channels, errors.

Errors keep their meaning across hops: a role raises ``RpcFailure`` (or a ``ValueError`` for bad
input, which is INVALID_ARGUMENT) and the router re-raises a downstream status with its code and
message intact, so a bad image is INVALID_ARGUMENT at the gateway whichever service found it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epd import errors

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # an encoded image, a request with several of them
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class RpcFailure(Exception):
    """A failure with the gRPC status it must surface as."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, hop: str) -> RpcFailure:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL):
            details = f"{hop}: {details}"  # infrastructure failures say where; user errors stay as they were
        return cls(code, details)


def invalid(message: str) -> RpcFailure:
    return RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, message)


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status an exception leaves a server as: one mapping for every role."""
    if isinstance(error, RpcFailure):
        return error.code, error.message
    if isinstance(error, errors.ServiceError):
        return grpc.StatusCode[error.status], str(error)
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


def _abort(context: grpc.ServicerContext, error: BaseException) -> None:
    code, message = status_of(error)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error")
    context.abort(code, message)


def unary_errors(method: Callable) -> Callable:
    """Map exceptions raised by a unary servicer method to gRPC statuses."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as error:  # noqa: BLE001 - every error must leave as a status
            _abort(context, error)

    return wrapper


def stream_errors(method: Callable) -> Callable:
    """Same as ``unary_errors`` for server-streaming methods (generators)."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except Exception as error:  # noqa: BLE001
            _abort(context, error)

    return wrapper


NODE_ADDRESS = "node"
"""A host value meaning "this Ray node's IP": servers that roles on other nodes must reach bind it."""


def resolve_host(host: str) -> str:
    if host != NODE_ADDRESS:
        return host
    import ray

    return ray.util.get_node_ip_address()


class InFlightCounter(grpc.ServerInterceptor):
    """Counts the calls a server is running (health checks aside), streams until they end: a
    replica being removed exits only when this reaches zero."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def _add(self, delta: int) -> None:
        with self._lock:
            self.count += delta

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc.health."):
            return handler
        if handler.unary_unary:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._wrap_unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream))
        return handler._replace(stream_stream=self._wrap_stream(handler.stream_stream))

    def _wrap_unary(self, behaviour: Callable) -> Callable:
        def wrapped(request, context):
            self._add(1)
            try:
                return behaviour(request, context)
            finally:
                self._add(-1)

        return wrapped

    def _wrap_stream(self, behaviour: Callable) -> Callable:
        def wrapped(request, context):
            self._add(1)
            try:
                yield from behaviour(request, context)
            finally:
                self._add(-1)

        return wrapped


def start_server(
    services: Iterable[tuple[Callable, object, str]], host: str = "127.0.0.1", port: int = 0, max_workers: int = 32,
    interceptors: Iterable[grpc.ServerInterceptor] = (),
) -> tuple[grpc.Server, int]:
    """Start a server with the given services plus grpc.health.v1; returns it and its bound port.

    ``services`` holds ``(add_XServicer_to_server, servicer, full service name)``; the health
    service reports each name (and the server as a whole) SERVING once it is started.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS,
                         interceptors=list(interceptors))
    names = []
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    server.start()
    for name in [*names, ""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


class RoleServer:
    """Hosts one role's gRPC service in its own process (the launcher makes it a Ray actor)."""

    host: str
    port: int
    server: grpc.Server

    def _serve(self, add: Callable, servicer: object, name: str, host: str, port: int = 0) -> None:
        self.host = resolve_host(host)
        self._in_flight = InFlightCounter()
        self.server, self.port = start_server([(add, servicer, name)], host=self.host, port=port,
                                              interceptors=[self._in_flight])

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def in_flight(self) -> int:
        """Calls this server is still running: a replica being drained exits at zero."""
        return self._in_flight.count

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        self.server.stop(grace=1).wait()


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


class StubCache:
    """One channel and stub per address, made on first use and kept (channels reconnect on their own)."""

    def __init__(self, make_stub: Callable[[grpc.Channel], object]) -> None:
        self._make_stub = make_stub
        self._stubs: dict[str, object] = {}
        self._lock = threading.Lock()

    def get(self, address: str):
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                stub = self._stubs[address] = self._make_stub(channel(address))
            return stub


def is_serving(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    try:
        with channel(address) as chan:
            reply = health_pb2_grpc.HealthStub(chan).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def wait_serving(address: str, timeout_s: float = 60.0, service: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if is_serving(address, service):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{address} did not report SERVING within {timeout_s:.0f}s")
