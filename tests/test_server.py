"""Server surface: health state machine, reflection, message limits, port 0."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

import hookserve

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
