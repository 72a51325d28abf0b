"""Building and running the gRPC server: health, reflection, auth, TLS, drain."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hookserve.v1 import hookserve_pb2 as pb

from .allocator import keep_large_buffers_on_heap
from .calls import Calls
from .engine import Engine
from .oip import servicer as oip
from .oip.infer import Inference
from .preflight import MAX_SEND_MESSAGE_BYTES
from .servicer import Servicer
from .stream_caps import SIDE_STREAMS, StreamCaps, same_shape

log = logging.getLogger("hookserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["FeatureExtractor"].full_name
#: Threads (and concurrent calls) kept for health checks and unary calls.
UNARY_HEADROOM = 16
#: Methods that stay open without a token, so orchestrators can probe.
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    max_streams: int = 128
    max_receive_message_bytes: int = 64 << 20
    max_send_message_bytes: int = MAX_SEND_MESSAGE_BYTES
    chunk_bytes: int = 2 << 20
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_client_ca: bytes | None = None
    auth_token: str | None = None
    #: open calls of each streaming method other than the work calls (health Watch,
    #: reflection)
    max_side_streams: int = 16
    #: side streams with no message either way for this long are cancelled (0: never)
    stream_idle_seconds: float = 300.0
    #: the OIP REST routes' port (None: off); TLS files (cert, key, client CA) for it
    http_port: int | None = None
    http_tls_files: tuple[str, str, str | None] | None = None


#: The shortest interval between a client's keepalive pings on a call with no data.
MIN_PING_INTERVAL_MS = 10_000


class _TokenAuth(grpc.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call but health checks."""

    def __init__(self, token: str, calls: Calls | None = None) -> None:
        self._expected = token.encode()
        self._calls = calls   # a refused call is logged and counted there

    def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_PREFIXES):
            return continuation(details)
        sent = [v for k, v in details.invocation_metadata or () if k == "authorization"]
        got = sent[0] if len(sent) == 1 else ""
        scheme, _, token = got.partition(" ")  # the scheme is case-insensitive (RFC 7235)
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self._expected):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        if len(sent) > 1:  # which one would count is a proxy's guess: refuse them all
            msg = (f"{len(sent)} authorization headers sent: send exactly one "
                   "'authorization: Bearer <token>'")
        elif not sent:
            msg = ("missing bearer token: send metadata 'authorization: Bearer <token>' "
                   "(the SDK reads HOOKSERVE_TOKEN)")
        else:
            msg = "invalid bearer token"

        method = details.method.rsplit("/", 1)[-1]

        def deny(request, context):
            if self._calls is not None:
                self._calls.refused(method, context, "UNAUTHENTICATED")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

        return same_shape(handler, deny)


def _add_servicer(servicer: Servicer, server: grpc.Server) -> None:
    """pb_grpc.add_FeatureExtractorServicer_to_server, but every method takes raw bytes.

    The servicer parses each request message itself, so a message that does not parse
    ends the call with INVALID_ARGUMENT (grpc's own deserializer answers INTERNAL). For a
    stream it is worse: the call is aborted inside grpc while the handler goes on, and
    the handler's end then sends a second status: the call never completes and
    server.stop() hangs forever (grpc 1.85; a client could block every SIGTERM this way).
    """
    handlers = {
        "Extract": grpc.stream_stream_rpc_method_handler(
            servicer.Extract, request_deserializer=None,
            response_serializer=pb.ExtractResponse.SerializeToString),
        "ExtractImage": grpc.unary_stream_rpc_method_handler(
            servicer.ExtractImage, request_deserializer=None,
            response_serializer=pb.ExtractResponse.SerializeToString),
        "Attribute": grpc.stream_stream_rpc_method_handler(
            servicer.Attribute, request_deserializer=None,
            response_serializer=pb.AttributeResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=None,
            response_serializer=pb.ListModelsResponse.SerializeToString),
        "DescribeModel": grpc.unary_unary_rpc_method_handler(
            servicer.DescribeModel, request_deserializer=None,
            response_serializer=pb.DescribeModelResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def oip_send_limit(opts: ServerOptions, engine: Engine) -> int:
    """gRPC's send limit: the OIP answer limit plus framing, within gRPC's 2 GiB."""
    return min(max(opts.max_send_message_bytes,
                   engine.config.max_stream_buffer_bytes + (1 << 20)), (1 << 31) - 1)


class HookServer:
    """A running hookserve gRPC server. Create with :func:`create_server`."""

    def __init__(self, engine: Engine, opts: ServerOptions) -> None:
        self.engine = engine
        self.opts = opts
        keep_large_buffers_on_heap()  # streamed chunks: see allocator.py
        self.stream_caps = StreamCaps(opts.max_side_streams, opts.stream_idle_seconds,
                                      opts.max_streams, lambda: engine.draining)
        calls = Calls(engine.telemetry, engine.models, engine.default_model)
        self.servicer = Servicer(engine, calls, self.stream_caps, chunk_bytes=opts.chunk_bytes,
                                 max_message_bytes=opts.max_receive_message_bytes)
        interceptors = [_TokenAuth(opts.auth_token, calls)] if opts.auth_token else []
        interceptors.append(self.stream_caps)
        # Each open stream holds a thread. The stream caps refuse work calls beyond
        # max_streams and other streaming methods beyond max_side_streams each, so the
        # spare threads always serve health checks and unary calls: a server full of
        # open streams still answers its liveness probe.
        # maximum_concurrent_rpcs is only a backstop against a flood of unary calls.
        workers = (opts.max_streams + opts.max_side_streams * len(SIDE_STREAMS)
                   + UNARY_HEADROOM)
        self._pool = futures.ThreadPoolExecutor(max_workers=workers,
                                                thread_name_prefix="hookserve-grpc")
        self.grpc = grpc.server(
            self._pool,
            interceptors=interceptors,
            maximum_concurrent_rpcs=workers,
            options=[
                ("grpc.max_receive_message_length", opts.max_receive_message_bytes),
                # One OIP answer holds every output (no chunks): up to the answer limit.
                ("grpc.max_send_message_length", oip_send_limit(opts, engine)),
                ("grpc.so_reuseport", 0),
                # Clients' keepalive pings on a stream that waits for its next image
                # (the SDK's every 30 s) are welcome: gRPC's default (one per 5 min)
                # ends such a stream with GOAWAY "too_many_pings".
                ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
            ],
        )
        _add_servicer(self.servicer, self.grpc)
        self._serving = False
        self.oip = oip.OipServicer(
            Inference(engine, self.servicer, engine.config.max_stream_buffer_bytes),
            self.servicer, ready=lambda: self._serving)
        oip.add_to_server(self.oip, self.grpc)
        self.http = None
        if opts.http_port is not None:
            from .oip.http import OipHttp
            self.http = OipHttp(self.oip, opts.host, opts.http_port, token=opts.auth_token,
                                max_body_bytes=opts.max_receive_message_bytes,
                                tls=opts.http_tls_files)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, oip.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
            self.grpc)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = self._bind(f"{opts.host}:{opts.port}")
        self._stopped = threading.Event()
        self._listening = False

    def _bind(self, address: str) -> int:
        """Listen on `address`; the port bound. OSError with a one-line reason if not
        (gRPC raises a RuntimeError that only says "Failed to bind")."""
        opts = self.opts
        try:
            if opts.tls_cert:
                creds = grpc.ssl_server_credentials(
                    [(opts.tls_key, opts.tls_cert)], root_certificates=opts.tls_client_ca,
                    require_client_auth=opts.tls_client_ca is not None)
                port = self.grpc.add_secure_port(address, creds)
            else:
                port = self.grpc.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if not port:
            self.grpc.stop(None)
            self._pool.shutdown(wait=False)
            raise OSError(f"cannot listen on {address}: the port is in use, or the address "
                          "is not one of this machine's (--host, --port)")
        return port

    def _set_health(self, status) -> None:
        self._serving = status == health_pb2.HealthCheckResponse.SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def listen(self) -> HookServer:
        """Start the workers and accept connections; health stays NOT_SERVING."""
        self.engine.start()
        if not self._listening:
            self.grpc.start()
            if self.http is not None:
                self.http.start()
            self._listening = True
        return self

    def ready(self, *, warmup: bool = True) -> HookServer:
        """Warm every model up (one full forward pass each), then report SERVING."""
        if warmup:
            self.engine.warmup()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return self

    def start(self, *, warmup: bool = True) -> HookServer:
        """listen() then ready(): SERVING only after the models are warmed up."""
        return self.listen().ready(warmup=warmup)

    def start_drain(self) -> None:
        """Take no new work: open calls finish what they have; streams waiting for
        their next request end."""
        self.stream_caps.start_drain(self.engine.start_drain)
        self.oip.end_idle_streams()

    def stop(self, grace: float = 30.0) -> None:
        """Drain: NOT_SERVING, refuse new calls, finish in-flight images, then stop.

        Returns within about `grace` seconds.
        """
        if self._stopped.is_set():
            return
        end = time.monotonic() + grace
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.start_drain()
        idle = self.stream_caps.wait_idle(max(0.0, end - time.monotonic()))
        if not idle:
            log.warning("grace period over with streams still open: cancelling them")
        if self.http is not None:
            self.http.stop(max(0.1, end - time.monotonic()))
        self.grpc.stop(max(0.0, end - time.monotonic())).wait()
        self.engine.close(timeout=max(0.1, end - time.monotonic()))
        self.stream_caps.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()

    def wait(self) -> None:
        self._stopped.wait()


def create_server(engine: Engine, opts: ServerOptions | None = None) -> HookServer:
    """Build a server (not started). `opts.port = 0` binds a free port: see `.port`."""
    return HookServer(engine, opts or ServerOptions())
