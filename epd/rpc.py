"""gRPC plumbing every role shares: asyncio servers with standard health checking, channels, errors.

Servers are ``grpc.aio`` servers on an event loop thread of their own (``EventLoop``) inside the
role's process, so a stream costs a coroutine, not a thread: no thread pool bounds how many
streams a role carries. Blocking work a handler needs (tokenizing, a Redis call) goes to the
loop's executor for the length of that work only.

Errors keep their meaning across hops: a role raises an ``epd.errors`` failure (or ``ValueError``
for bad input, INVALID_ARGUMENT), ``status_of`` maps it to a status in one place, and a caller
re-raises a downstream status with its code and message intact (``RpcFailure.from_rpc_error``), so
a bad image is INVALID_ARGUMENT at the gateway whichever service found it. A status that reports
a failure *downstream* of the server that sent it carries ``DOWNSTREAM`` in its trailing metadata:
the caller then does not blame (or avoid) that server for it.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd import errors, logs
from epd.config import RpcConfig

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = RpcConfig().max_message_bytes  # internal hops: a handoff chunk, an inline embedding, images
KEEPALIVE_S = RpcConfig.keepalive_s
"""Every connection (both ends) pings its peer this often and gives up on it when the answer takes
as long again. A peer whose machine is lost (power, cable, a crashed kernel) sends no FIN and no
RST: without this a call to it, or a stream from it, hangs until its deadline (tens of minutes for
TCP's own retransmissions), and a new call can start on the dead connection. With it such a call
fails with UNAVAILABLE within about 2 x KEEPALIVE_S and is retried elsewhere (tests/test_node_loss.py)."""


def _keepalive_options(keepalive_s: float) -> list[tuple[str, int]]:
    """On every channel and every server, so both ends find out."""
    return [
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_s * 1000)),
        ("grpc.http2.ping_timeout_ms", int(keepalive_s * 1000)),  # else a ping waits 60 s for its answer
        ("grpc.keepalive_permit_without_calls", 1),  # idle channels too: a new call must not find a dead one
        ("grpc.http2.max_pings_without_data", 0),  # pings go on while a stream sends nothing
        # The server side of the same: accept those pings (by default a server answers a ping more
        # often than every 5 minutes without data with GOAWAY "too_many_pings", failing the calls).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(keepalive_s * 1000 * 0.8)),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def _channel_options(max_message_bytes: int, keepalive_s: float) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes), *_keepalive_options(keepalive_s)]


KEEPALIVE_OPTIONS = _keepalive_options(KEEPALIVE_S)
CHANNEL_OPTIONS = _channel_options(MAX_MESSAGE_BYTES, KEEPALIVE_S)
MAX_CONCURRENT_RPCS = RpcConfig.max_concurrent_rpcs
"""Calls one role's gRPC server runs at once: a ceiling, so that no flood of calls between roles
(each holding buffers) can take a process's memory; the queues behind the servers bound the work."""
EXECUTOR_THREADS = RpcConfig.executor_threads


def configure(config: RpcConfig) -> None:
    """This process's settings for every hop between roles (``ServeConfig.rpc``): each role calls
    it first in its constructor, before it opens a channel or a server. Defaults until then."""
    global MAX_MESSAGE_BYTES, KEEPALIVE_S, KEEPALIVE_OPTIONS, CHANNEL_OPTIONS, MAX_CONCURRENT_RPCS, EXECUTOR_THREADS
    MAX_MESSAGE_BYTES, KEEPALIVE_S = config.max_message_bytes, config.keepalive_s
    KEEPALIVE_OPTIONS = _keepalive_options(KEEPALIVE_S)
    CHANNEL_OPTIONS = _channel_options(MAX_MESSAGE_BYTES, KEEPALIVE_S)
    MAX_CONCURRENT_RPCS, EXECUTOR_THREADS = config.max_concurrent_rpcs, config.executor_threads

DOWNSTREAM = ("epd-fault", "downstream")
"""Trailing metadata of a status that reports a failure of a hop behind the server that sent it."""


class RpcFailure(Exception):
    """A failure with the gRPC status it must surface as; ``downstream`` when it happened behind
    the server that raises it (so that server's callers do not blame it)."""

    def __init__(self, code: grpc.StatusCode, message: str, downstream: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.downstream = downstream

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, hop: str) -> RpcFailure:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = (error.details() if hasattr(error, "details") else str(error)) or code.name
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL) \
                and not details.startswith(f"{hop}: "):
            details = f"{hop}: {details}"  # infrastructure failures say where; user errors stay as they were
        return cls(code, details, downstream=True)


def peer_failed(error: grpc.RpcError) -> bool:
    """The server we called is itself broken or gone (not a client error, not a failure it
    reported from behind it): a reason to try another replica and to avoid this one for a while."""
    if error.code() is not grpc.StatusCode.UNAVAILABLE:
        return False
    metadata = error.trailing_metadata() or ()
    return tuple(DOWNSTREAM) not in [tuple(item) for item in metadata]


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status an exception leaves a server as: one mapping for every role."""
    if isinstance(error, RpcFailure):
        return error.code, error.message
    if isinstance(error, errors.ServiceError):
        return grpc.StatusCode[error.status], str(error)
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


async def abort(context: grpc.aio.ServicerContext, error: BaseException, method: str) -> None:
    code, message = status_of(error)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s: internal error", method)  # unexpected: the traceback is worth having
    elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        log.warning("%s: %s: %s", method, code.name, message)  # an expected fault: one line
    if getattr(error, "downstream", False):
        context.set_trailing_metadata((DOWNSTREAM,))
    await context.abort(code, message)


def unary_errors(method: Callable) -> Callable:
    """Map exceptions raised by an async unary servicer method to gRPC statuses."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:  # noqa: BLE001 - every error must leave as a status
            await abort(context, error, method.__name__)

    return wrapper


def stream_errors(method: Callable) -> Callable:
    """Same as ``unary_errors`` for server-streaming methods (async generators)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            async for item in method(self, request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as error:  # noqa: BLE001
            await abort(context, error, method.__name__)

    return wrapper


NODE_ADDRESS = "node"
"""A host value meaning "this Ray node's IP": servers that roles on other nodes must reach bind it."""


def resolve_host(host: str) -> str:
    if host != NODE_ADDRESS:
        return host
    import ray

    return ray.util.get_node_ip_address()


async def run_or_undo(undo: Callable, fn: Callable, *args):
    """``fn(*args)`` on the loop's default executor, awaited. A call on an executor's thread cannot
    be stopped: if the awaiting task is cancelled (its caller left) while ``fn`` runs, ``fn`` goes
    on, and ``undo(result)`` is called on the loop once it has returned (not when it raised). For a
    step that hands something over (a claim, a handoff joining a batch) that nobody would take back
    if its caller left half-way."""
    future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        def done(finished: asyncio.Future) -> None:
            if not finished.cancelled() and finished.exception() is None:
                undo(finished.result())

        future.add_done_callback(done)
        raise


class EventLoop:
    """An asyncio loop running in a daemon thread of its own; other threads hand it coroutines."""

    def __init__(self, name: str, executor_threads: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        # Short blocking work only (a tokenization, a Redis round trip): never a whole stream.
        self.loop.set_default_executor(ThreadPoolExecutor(executor_threads or EXECUTOR_THREADS,
                                                          thread_name_prefix=f"{name}-io"))
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float | None = 60.0):
        """Run ``coro`` on the loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class InFlightCounter(grpc.aio.ServerInterceptor):
    """Counts the calls a server is running (health checks aside), streams until they end: a
    replica being removed exits only when this reaches zero. Runs on the server's loop thread."""

    def __init__(self) -> None:
        self.count = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc."):
            return handler
        if handler.unary_unary:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._wrap_unary(handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream))
        return handler._replace(stream_stream=self._wrap_stream(handler.stream_stream))

    def _wrap_unary(self, behaviour: Callable) -> Callable:
        async def wrapped(request, context):
            self.count += 1
            try:
                return await behaviour(request, context)
            finally:
                self.count -= 1

        return wrapped

    def _wrap_stream(self, behaviour: Callable) -> Callable:
        async def wrapped(request, context):
            self.count += 1
            try:
                async for item in behaviour(request, context):
                    yield item
            finally:
                self.count -= 1

        return wrapped


class RequestContext(grpc.aio.ServerInterceptor):
    """Every call a role serves runs with the request id its caller sent (``logs.REQUEST_ID_KEY``
    metadata) as ``logs.REQUEST_ID``: whatever the handler logs names the request the router's
    lines name, and the calls it makes on (prefill's handoff to decode) carry it on. Each call
    ends with one DEBUG line: method, status, seconds."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith("/grpc."):
            return handler
        request_id = logs.request_id_of(handler_call_details.invocation_metadata)
        name = method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary, request_id, name))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._wrap_unary(handler.stream_unary, request_id, name))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream, request_id, name))
        return handler._replace(stream_stream=self._wrap_stream(handler.stream_stream, request_id, name))

    @staticmethod
    def _done(name: str, context, started: float, error: BaseException | None) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            status = "CANCELLED"
        elif error is not None and not isinstance(error, grpc.aio.AbortError):
            status = status_of(error)[0].name
        else:
            code = context.code() if hasattr(context, "code") else None
            status = "OK" if code in (None, grpc.StatusCode.OK, 0) else getattr(code, "name", str(code))
        took = time.perf_counter() - started
        log.debug("%s %s in %.3f s", name, status, took,
                  extra={logs.FIELDS: {"method": name, "status": status, "duration_s": round(took, 6)}})

    def _wrap_unary(self, behaviour: Callable, request_id: str, name: str) -> Callable:
        async def wrapped(request, context):
            if request_id:
                logs.REQUEST_ID.set(request_id)
            started, error = time.perf_counter(), None
            try:
                return await behaviour(request, context)
            except BaseException as raised:
                error = raised
                raise
            finally:
                self._done(name, context, started, error)

        return wrapped

    def _wrap_stream(self, behaviour: Callable, request_id: str, name: str) -> Callable:
        async def wrapped(request, context):
            if request_id:
                logs.REQUEST_ID.set(request_id)
            started, error = time.perf_counter(), None
            try:
                async for item in behaviour(request, context):
                    yield item
            except BaseException as raised:
                error = raised
                raise
            finally:
                self._done(name, context, started, error)

        return wrapped


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuses every call (health checks aside) that does not carry ``value`` in the metadata
    ``key`` with UNAUTHENTICATED. The public fronts check ``authorization: Bearer KEY`` (server
    reflection included: it follows the API's rules); internal services the deployment's token.
    Compared in constant time; never logged."""

    OPEN = ("/grpc.health.",)

    def __init__(self, key: str, value: str, what: str) -> None:
        self.key, self.value, self.what = key, value.encode(), what

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.OPEN):
            return handler
        sent = dict(handler_call_details.invocation_metadata or ()).get(self.key, "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self.value):
            return handler
        return _refusing(handler, f"{self.what} required")


def _refusing(handler, message: str):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - never reached: makes this an async generator

    if handler.unary_unary:
        return handler._replace(unary_unary=unary)
    if handler.stream_unary:
        return handler._replace(stream_unary=unary)
    if handler.unary_stream:
        return handler._replace(unary_stream=stream)
    return handler._replace(stream_stream=stream)


INTERNAL_TOKEN_KEY = "x-epd-internal"


@dataclass(frozen=True)
class Transport:
    """How a process reaches (or serves) a set of endpoints: a token sent as metadata and, when
    certificates are given, TLS (mutual when both sides present one)."""

    token_key: str = INTERNAL_TOKEN_KEY
    token: str = field(default="", repr=False)
    ca: bytes | None = field(default=None, repr=False)  # PEM: the CA that signed the peer's certificate
    cert: bytes | None = field(default=None, repr=False)  # PEM: our certificate chain
    key: bytes | None = field(default=None, repr=False)  # PEM: our private key

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((self.token_key, self.token),) if self.token else ()

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        if self.ca is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        credentials = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)

    def channel(self, address: str) -> grpc.Channel:
        if self.ca is None:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(self.ca, self.key, self.cert),
                                   options=CHANNEL_OPTIONS)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.cert is None or self.key is None:
            return None
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def interceptors(self, what: str) -> list[grpc.aio.ServerInterceptor]:
        return [RequireToken(self.token_key, self.token, what)] if self.token else []


def read_pem(path: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None


def internal_transport(security) -> Transport:
    """Between roles: the deployment's token, and mutual TLS when internal certificates are given."""
    return Transport(INTERNAL_TOKEN_KEY, security.internal_token, read_pem(security.internal_tls_ca),
                     read_pem(security.internal_tls_cert), read_pem(security.internal_tls_key))


def public_transport(security) -> Transport:
    """The public fronts: the API key as ``authorization: Bearer KEY``, TLS when a certificate is given."""
    return Transport("authorization", f"Bearer {security.api_key}" if security.api_key else "", None,
                     read_pem(security.tls_cert), read_pem(security.tls_key))


Service = tuple[Callable, object, str]  # (add_XServicer_to_server, servicer, full service name)



class RoleServer:
    """Hosts one role's gRPC service in its own process (the controller makes it a Ray actor).

    The server runs on an ``EventLoop`` thread; the actor's own methods (``address``,
    ``in_flight``, ``stop``...) are called by Ray on other threads. grpc.health.v1 says SERVING
    while ``healthy()`` holds (checked every ``HEALTH_INTERVAL_S`` on the loop: it must be quick)
    and the server is not shutting down."""

    HEALTH_INTERVAL_S = 0.25
    host: str
    port: int

    def _serve(self, services: Iterable[Service], host: str, transport: Transport, port: int = 0,
               healthy: Callable[[], bool] = lambda: True, what: str = "the deployment's internal token",
               max_receive_bytes: int = 0, max_concurrent_rpcs: int = 0) -> None:
        """Start the server: ``transport`` says who may call (its token, its certificates);
        ``max_receive_bytes`` is the largest request message it reads (a public service sets it far
        below the internal hops' cap; gRPC refuses a bigger one with RESOURCE_EXHAUSTED);
        ``max_concurrent_rpcs`` the calls it runs at once (gRPC refuses more with RESOURCE_EXHAUSTED).
        0: this process's ``configure``d hop settings (``rpc.max_message_mb``, ``rpc.max_concurrent_rpcs``)."""
        from epd import sched

        sched.serving_path()  # from the control plane's SCHED_IDLE it was started with (a forward role is at SCHED_OTHER)
        self.host = resolve_host(host)
        services = list(services)
        self._service_names = [name for _, _, name in services]
        self._healthy = healthy
        self.shutting_down = False
        self.events = EventLoop(self._service_names[0].rsplit(".", 1)[-1].lower())
        self._in_flight = InFlightCounter()
        interceptors = [*transport.interceptors(what), self._in_flight, RequestContext()]
        self.server, self.port, self._health = self.events.run(_start_server(
            services, self.host, port, interceptors, transport.server_credentials(), max_receive_bytes or MAX_MESSAGE_BYTES,
            max_concurrent_rpcs or MAX_CONCURRENT_RPCS))
        self.events.run(_report_health(self))
        self._health_task = asyncio.run_coroutine_threadsafe(_health_loop(self), self.events.loop)

    def serving(self) -> bool:
        try:
            return not self.shutting_down and bool(self._healthy())
        except Exception:  # noqa: BLE001 - a health check that cannot tell says no
            log.exception("health check failed")
            return False

    def start_shutdown(self) -> None:
        """Health says NOT_SERVING from now on (a load balancer stops sending here)."""
        self.shutting_down = True
        self.events.run(_report_health(self))

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def device_info(self) -> dict:
        """The device this role computes on and the GPUs Ray gave it."""
        from epd.tensors import device_info

        return device_info()

    def in_flight(self) -> int:
        """Calls this server is still running: a replica being drained exits at zero."""
        return self._in_flight.count

    def requests(self) -> int:
        """Requests this replica is working on now (what `epd status` shows): its calls."""
        return self.in_flight()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def ping(self) -> bool:
        return True

    def health(self) -> bool:
        """What grpc.health.v1 says, asked on the serving loop (a wedged loop does not answer)."""
        async def ask() -> bool:
            return self.serving()

        return self.events.run(ask(), timeout=5)

    def stop(self, grace_s: float = 1.0) -> None:
        self.start_shutdown()
        self._health_task.cancel()
        self.events.run(self.server.stop(grace_s), timeout=grace_s + 10)
        self.events.close()


# Module functions, not methods: Ray would take a class with an ``async def`` for an async actor.


REFLECTION_PREFIX = "grpc.reflection."
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"


def enable_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """gRPC server reflection as both ``grpc.reflection.v1`` (what grpcurl and current clients
    ask first) and ``v1alpha`` (older ones), each listing every service the port serves: the
    given ones, ``grpc.health.v1.Health`` and the two reflection services.

    grpcio-reflection serves v1alpha only; v1 is the same protocol under another package (the
    messages are identical field for field), so one servicer answers both, and v1's file
    descriptor is added to the pool so that describing it works too. A service entry named
    ``grpc.reflection.*`` among a RoleServer's services asks for this (``_start_server``)."""
    from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

    _add_reflection_v1_descriptor(reflection_pb2)
    names = list(dict.fromkeys([*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                REFLECTION_V1, REFLECTION_V1ALPHA]))
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)})
    server.add_generic_rpc_handlers((v1,))


def _add_reflection_v1_descriptor(reflection_pb2) -> None:
    """grpc/reflection/v1/reflection.proto in the default pool: v1alpha's file renamed."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    pool = descriptor_pool.Default()
    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = name, "grpc.reflection.v1"

    def rename(messages) -> None:
        for message in messages:
            for entry in message.field:
                if entry.type_name.startswith(old):
                    entry.type_name = new + entry.type_name[len(old):]
            rename(message.nested_type)

    rename(proto.message_type)
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old):]
            method.output_type = new + method.output_type[len(old):]
    proto.options.Clear()
    pool.AddSerializedFile(proto.SerializeToString())


async def _start_server(services: list[Service], host: str, port: int, interceptors: list,
                        credentials: grpc.ServerCredentials | None, max_receive_bytes: int,
                        max_concurrent_rpcs: int = 0):
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", max_receive_bytes), *KEEPALIVE_OPTIONS]
    server = grpc.aio.server(options=options, interceptors=interceptors,
                             maximum_concurrent_rpcs=max_concurrent_rpcs or None)
    served = [name for _, _, name in services if not name.startswith(REFLECTION_PREFIX)]
    for add, servicer, name in services:
        if not name.startswith(REFLECTION_PREFIX):  # a reflection entry asks for enable_reflection below
            add(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if len(served) < len(services):
        enable_reflection(server, served)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    return server, bound, health


async def _report_health(role: RoleServer) -> bool:
    serving = role.serving()
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in [*role._service_names, ""]:
        await role._health.set(name, status)
    return serving


async def _health_loop(role: RoleServer) -> None:
    last = None
    while True:
        await asyncio.sleep(role.HEALTH_INTERVAL_S)
        if role.serving() != last:
            last = await _report_health(role)


def channel(address: str) -> grpc.Channel:
    """A blocking channel (clients, tests, the controller's probes)."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


class StubCache:
    """One asyncio channel and stub per address, made on first use and kept (channels reconnect on
    their own). Used on an event loop: the channels belong to it."""

    def __init__(self, make_stub: Callable[[grpc.aio.Channel], object], transport: Transport) -> None:
        self._make_stub = make_stub
        self.transport = transport
        self._stubs: dict[str, object] = {}

    def get(self, address: str):
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = self._make_stub(self.transport.aio_channel(address))
        return stub


def health_status(address: str, service: str = "", timeout_s: float = 2.0,
                  transport: Transport | None = None) -> int | None:
    """What the server's grpc.health.v1 says (a ``HealthCheckResponse`` status), or None when it
    does not answer."""
    try:
        with (transport or Transport()).channel(address) as chan:
            reply = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(service=service),
                                                           timeout=timeout_s)
        return reply.status
    except grpc.RpcError:
        return None


def is_serving(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    return health_status(address, service, timeout_s) == health_pb2.HealthCheckResponse.SERVING


def wait_serving(address: str, timeout_s: float = 60.0, service: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if is_serving(address, service):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{address} did not report SERVING within {timeout_s:.0f}s")
