"""Issue 12, hardening: defects each proven over the wire against a real server.

- duplicate `authorization` headers are refused (UNAUTHENTICATED);
- the metrics endpoint binds `--metrics-host` (loopback by default);
- `make docker-smoke` builds the venv first on a fresh clone;
- the features equal torchvision's tensor recipe bit for bit;
- idle health Watch and reflection streams, hundreds at once, never stop health Check,
  ListModels, DescribeModel or Extract from answering; idle ones are cancelled.
"""

from __future__ import annotations

import io
import os
import pathlib
import shutil
import socket
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from torchvision.io import decode_image
from torchvision.models import ResNet18_Weights
from torchvision.models.feature_extraction import create_feature_extractor

from hookserve.cli import build_parser
from hookserve.v1 import hookserve_pb2 as pb
from hookserve_server.app import start_metrics
from hookserve_server.models import build_model
from hookserve_server.stream_caps import SIDE_STREAMS

from conftest import encode, rand_image
from helpers import small_server

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST = small_server("--max-batch-delay-ms", "2")
WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


# -- 7: small ones -----------------------------------------------------------------------
def test_two_authorization_headers_are_unauthenticated(make_server, tmp_path):
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    s = make_server(*FAST, "--auth-token-file", str(token))
    with grpc.insecure_channel(s.address) as ch:
        list_models = ch.unary_unary("/hookserve.v1.FeatureExtractor/ListModels")
        good = ("authorization", "Bearer tok-123")
        assert list_models(b"", metadata=[good], timeout=10) is not None
        for pair in ([good, ("authorization", "Bearer wrong")],
                     [("authorization", "Bearer wrong"), good], [good, good]):
            with pytest.raises(grpc.RpcError) as err:
                list_models(b"", metadata=pair, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "2 authorization headers" in err.value.details()


def test_metrics_bind_loopback_unless_told(monkeypatch):
    pytest.importorskip("prometheus_client")
    from hookserve_server.metrics import PrometheusTelemetry

    args = build_parser().parse_args(["serve", "--metrics-port", "0"])
    assert args.metrics_host == "127.0.0.1"
    addr, port = start_metrics(PrometheusTelemetry(), args)
    assert addr == "127.0.0.1"
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    monkeypatch.setenv("HOOKSERVE_METRICS_HOST", "[::]")
    args = build_parser().parse_args(["serve", "--metrics-port", "0"])
    addr, _ = start_metrics(PrometheusTelemetry(), args)
    assert addr == "0.0.0.0"  # the wildcard, IPv4 (works where IPv6 is off)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("target", ["docker-smoke", "serve", "test", "test-slow", "lint",
                                    "proto", "bench", "bench-quick"])
def test_make_targets_build_the_venv_first_on_a_fresh_clone(tmp_path, target):
    assert f"make {target}" in (ROOT / "README.md").read_text()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    # Under `make test` the parent's MAKELEVEL/MAKEFLAGS would make this child print
    # "Entering directory" lines: run it as a first, top-level make would be.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    out = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=tmp_path,
                         capture_output=True, text=True, check=True,
                         env=env).stdout.splitlines()
    assert out[0].startswith("test -x .venv/bin/python ||"), out[:3]


def test_features_equal_torchvision_tensor_recipe_bit_for_bit(client):
    """decode_image, then weights.transforms() on the uint8 tensor: equal bit for bit."""
    data = encode(rand_image(150, 210, seed=7))
    layers = ["conv1", "layer2"]
    got = client.extract(data, layers)
    model, _ = build_model("resnet18", "random", 0)
    fe = create_feature_extractor(model.eval(), layers)
    x = ResNet18_Weights.IMAGENET1K_V1.transforms()(
        decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8)))
    with torch.inference_mode():
        want = {k: v[0].numpy() for k, v in fe(x[None]).items()}
    for name in layers:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # The PIL path (transforms on a PIL image) is a different recipe: close, not equal.
    xp = ResNet18_Weights.IMAGENET1K_V1.transforms()(Image.open(io.BytesIO(data)))
    with torch.inference_mode():
        pil = fe(xp[None])["conv1"][0].numpy()
    assert 0 < np.abs(pil - want["conv1"]).max() < 0.5


# -- 3: idle streams ---------------------------------------------------------------------
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
