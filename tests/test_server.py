"""Server surface: health state machine, reflection, message limits, port 0; idle health
Watch and reflection streams, hundreds at once, never stop health Check, ListModels,
DescribeModel or Extract from answering, and idle ones are cancelled."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

import hookserve
from hookserve.v1 import hookserve_pb2 as pb
from hookserve_server.stream_caps import SIDE_STREAMS

from conftest import RunningServer, rand_image
from helpers import R18


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_health_serving_only_after_warmup_then_not_serving_on_stop():
    s = RunningServer(R18, start=False)
    try:
        assert s.port > 0  # --port 0 bound a real port before start
        s.server.listen()
        assert _health(s.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        s.server.ready()
        for svc in ("", "hookserve.v1.FeatureExtractor"):
            assert _health(s.address, svc) == health_pb2.HealthCheckResponse.SERVING
        with s.client() as c:
            assert c.health() == "SERVING"
    finally:
        s.stop(2)
    with hookserve.Client(s.address, timeout=2, retries=0) as c:
        try:
            status = c.health()
        except hookserve.Unavailable:
            status = "gone"
    assert status in ("NOT_SERVING", "gone")


def test_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"hookserve.v1.FeatureExtractor", "grpc.health.v1.Health"} <= services
        fd = db.FindFileContainingSymbol("hookserve.v1.FeatureExtractor")
        assert fd.package == "hookserve.v1"


def test_oversized_request_message_is_refused(make_server):
    s = make_server(*R18, "--max-message-bytes", str(1 << 20))
    with s.client(retries=0) as c:
        with pytest.raises(hookserve.ResourceExhausted):
            c.extract(b"\x89PNG" + bytes(2 << 20), ["layer1"])
        # the server is fine afterwards
        assert c.extract(rand_image(32, 32), ["conv1"], native=True)["conv1"].shape == (
            64, 16, 16)


def test_a_port_taken_after_the_checks_is_a_one_line_error(server):
    """The start-up checks find a taken port before any model loads; one taken in
    between (a race) is refused by the server's own bind, just as clearly."""
    import socket

    from hookserve_server.server import ServerOptions, create_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: the port is "
                                          "in use") as err:
            create_server(server.engine, ServerOptions(host="127.0.0.1", port=port))
    assert "\n" not in str(err.value)


WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
FAST = [*R18, "--max-batch-delay-ms", "2"]


class _Done:
    """Counts finished calls (by code) without polling."""

    def __init__(self) -> None:
        self.codes: list[grpc.StatusCode] = []
        self.cond = threading.Condition()

    def callback(self, call) -> None:
        with self.cond:
            self.codes.append(call.code())
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = 60) -> list[grpc.StatusCode]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.codes) >= n, timeout), self.codes
            return list(self.codes)


def _blocked(stop: threading.Event):
    stop.wait()
    return
    yield  # a request iterator that sends nothing until `stop`


def _answers_within_a_second(s) -> None:
    with grpc.insecure_channel(s.address) as ch:
        t0 = time.monotonic()
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - t0 < 1.0
    with s.client(timeout=30, retries=0) as c:
        assert [m.name for m in c.list_models()] == ["resnet18"]
        assert c.describe("resnet18", 64).layers
        assert c.extract(rand_image(32, 32), ["conv1"], native=True)["conv1"].shape == (
            64, 16, 16)


def test_hundreds_of_idle_streams_leave_unary_calls_answering(make_server):
    cap = 8
    s = make_server(*FAST, "--max-streams", "4", "--max-side-streams", str(cap))
    n = 150  # of each kind
    stop = threading.Event()
    channels = [grpc.insecure_channel(s.address) for _ in range(6)]
    done = _Done()
    calls = []
    try:
        for i in range(n):
            ch = channels[i % len(channels)]
            w = ch.unary_stream(WATCH)(health_pb2.HealthCheckRequest().SerializeToString())
            r = ch.stream_stream(REFLECTION)(_blocked(stop))
            for call in (w, r):
                call.add_done_callback(done.callback)
                calls.append(call)
        refused = 2 * (n - cap)
        codes = done.wait_for(refused)
        assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert s.server.stream_caps.open_calls(WATCH) == cap
        assert s.server.stream_caps.open_calls(REFLECTION) == cap
        _answers_within_a_second(s)
        # Extract streams are capped by --max-streams and leave the same headroom.
        with s.client(timeout=30, retries=0) as c:
            assert c.health() == "SERVING"
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()


def test_idle_side_streams_are_cancelled(make_server):
    s = make_server(*FAST, "--stream-idle-seconds", "0.3")
    stop = threading.Event()
    with grpc.insecure_channel(s.address) as ch:
        w = ch.unary_stream(WATCH)(health_pb2.HealthCheckRequest().SerializeToString())
        r = ch.stream_stream(REFLECTION)(_blocked(stop))
        t0 = time.monotonic()
        assert health_pb2.HealthCheckResponse.FromString(next(w)).status == (
            health_pb2.HealthCheckResponse.SERVING)
        for call in (w, r):
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.CANCELLED
        assert time.monotonic() - t0 < 10
        stop.set()
    # the server's handlers return (and their threads come back) soon after
    assert s.server.stream_caps.wait_closed(WATCH, 10)
    assert s.server.stream_caps.wait_closed(REFLECTION, 10)


def test_every_streaming_method_is_capped(server):
    """A streaming method added later is counted too: the work calls (Extract,
    ExtractImage and Attribute) by --max-streams, each other one by
    --max-side-streams, and the thread pool keeps threads for all of them plus spare
    ones for unary calls."""
    from grpc_health.v1 import health_pb2 as h
    from grpc_reflection.v1alpha import reflection_pb2 as r

    from hookserve_server.server import UNARY_HEADROOM

    streaming = {f"/{svc.full_name}/{m.name}"
                 for fd in (pb.DESCRIPTOR, h.DESCRIPTOR, r.DESCRIPTOR)
                 for svc in fd.services_by_name.values() for m in svc.methods
                 if m.client_streaming or m.server_streaming}
    assert {WATCH, REFLECTION} <= set(SIDE_STREAMS)
    assert streaming == set(SIDE_STREAMS) | {"/hookserve.v1.FeatureExtractor/Extract",
                                             "/hookserve.v1.FeatureExtractor/ExtractImage",
                                             "/hookserve.v1.FeatureExtractor/Attribute"}
    opts = server.server.opts
    assert server.server._pool._max_workers == (
        opts.max_streams + opts.max_side_streams * len(SIDE_STREAMS) + UNARY_HEADROOM)
