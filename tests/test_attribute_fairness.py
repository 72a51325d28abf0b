"""Attribution shares the model's thread: a long Integrated Gradients batch runs in
passes; between two passes the thread serves other calls and checks the call's cancel
and deadline. The cost cap bounds a whole batch.

Progress is read from the engine's own counters (Attribute passes run, jobs started
and running), so "the work stopped" and "the other call went first" are counts and
orderings, not timings. The long call is Integrated Gradients with 340 steps on one
image at one row a pass (--attribution-pass-cost 3): 341 passes.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc
from hookserve_server.attribution_spec import AttributeInput, AttributionSpec, Method
from hookserve_server.errors import Cancelled, DeadlineExceeded
from hookserve_server.spec import Mode, Preprocess

from conftest import rand_image
from helpers import NATIVE, R18, answers, attribute, image_req, ok, wait_until

IG = pb.ATTRIBUTION_METHOD_INTEGRATED_GRADIENTS
ONE_ROW = [*R18, "--attribution-pass-cost", "3"]
LONG = pb.AttributionSpec(method=IG, preprocessing=NATIVE, ig_steps=340)
LONG_PASSES = 341


class Call:
    """An Attribute call whose answers a thread reads as they come."""

    def __init__(self, server, spec: pb.AttributionSpec, images, timeout: float = 300):
        self.channel = grpc.insecure_channel(server.address)
        reqs = [pb.AttributeRequest(spec=spec)] + [image_req(a, i) for i, a in
                                                   enumerate(images)]
        self.rpc = pb_grpc.FeatureExtractorStub(self.channel).Attribute(iter(reqs),
                                                                          timeout=timeout)
        self.answers: list[pb.AttributeResponse] = []
        self.error: grpc.RpcError | None = None
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for m in self.rpc:
                self.answers.append(m)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.done.set()

    def close(self) -> None:
        self.rpc.cancel()
        self.done.wait(30)
        self.channel.close()


def running(s) -> int:
    return s.engine.attribution_jobs[1]


@pytest.fixture
def one_row(make_server):
    return make_server(*ONE_ROW)


def test_cancel_stops_the_batch_within_a_pass(one_row):
    s = one_row
    ig = Call(s, LONG, [rand_image(64, 64, seed=1)])
    try:
        wait_until(lambda: s.engine.attribution_passes >= 3, what="the job's first passes")
        (session,) = s.engine.sessions
        ig.rpc.cancel()
        wait_until(lambda: session.cancelled, what="the server saw the cancel")
        seen = s.engine.attribution_passes
        wait_until(lambda: running(s) == 0, what="the job ended")
        stopped = s.engine.attribution_passes
        # The worker checks the call before every pass: at most the pass under way when
        # the cancel came is finished.
        assert stopped - seen <= 1, (seen, stopped)
        assert stopped < LONG_PASSES // 2
        session = None
        # The model's thread is free, and nothing of the cancelled batch runs again.
        with s.client(timeout=60) as c:
            assert c.extract(rand_image(32, 32), "layer1", native=True)["layer1"].size
        assert s.engine.attribution_passes == stopped
        assert ig.done.wait(30) and ig.error.code() == grpc.StatusCode.CANCELLED
    finally:
        ig.close()


def test_one_image_calls_finish_while_a_long_ig_stream_runs(one_row):
    s = one_row
    img = rand_image(64, 64, seed=2)
    ig = Call(s, LONG, [img])
    try:
        wait_until(lambda: s.engine.attribution_passes >= 3, what="the job's first passes")
        with s.client(timeout=120) as c:
            feats = c.extract(img, ["layer4", "fc"], native=True)     # ExtractImage
            assert not ig.answers and running(s) == 1, "the IG batch ended first"
            cam = c.attribute(img, "layer4", "grad_cam", native=True)  # another Attribute
            assert not ig.answers and running(s) == 1, "the IG batch ended first"
        assert feats["fc"].shape == (1000,) and cam.map.shape == (2, 2)
        assert s.engine.attribution_passes < LONG_PASSES
    finally:
        ig.close()


def test_deadline_passing_mid_batch_ends_it(one_row):
    s = one_row
    # Through gRPC: the client's deadline ends the call, and the server's batch. On a
    # loaded machine the deadline can pass before the job's first pass (the image then
    # ends as queued work does); a longer deadline is tried until the job has started.
    # Whichever side notices first ends it: gRPC ends the call, or the server ends the
    # image with DEADLINE_EXCEEDED as its status.
    for timeout in (1.0, 3.0, 9.0):
        before = s.engine.attribution_passes
        ig = Call(s, LONG, [rand_image(160, 160, seed=3)], timeout=timeout)
        assert ig.done.wait(120)
        wait_until(lambda: running(s) == 0, what="the job ended")
        ig.close()
        ran = s.engine.attribution_passes - before
        if ran:
            break
    codes = ({ig.error.code().value[0]} if ig.error is not None
             else {a["status"].code for a in answers(ig.answers)})
    assert codes == {grpc.StatusCode.DEADLINE_EXCEEDED.value[0]}, codes
    assert 0 < ran < LONG_PASSES, f"{ran} passes ran for a call whose deadline passed"
    # The engine's own check, with no gRPC cancel: the deadline passes between passes.
    before = s.engine.attribution_passes
    arr = rand_image(128, 128, seed=4)
    spec = AttributionSpec("resnet18", Method.INTEGRATED_GRADIENTS, ig_steps=340,
                           preprocessing=Preprocess(Mode.NATIVE))
    image = AttributeInput("long", raw=arr.tobytes(), height=128, width=128)
    (r,) = list(s.engine.session(deadline=time.monotonic() + 3.0).run([spec, image]))
    assert isinstance(r.error, DeadlineExceeded), r.error
    assert f"of the {LONG_PASSES} attribution passes" in str(r.error)
    assert "fewer steps" in str(r.error)
    ran = s.engine.attribution_passes - before
    assert 0 < ran < LONG_PASSES
    assert not isinstance(r.error, Cancelled)


def test_cost_cap_bounds_a_batch(make_server):
    # Integrated Gradients with 32 steps costs 99 per image: a cap of 200 admits two
    # images to a batch. A long batch delay would otherwise gather all six.
    flags = [*R18, "--max-batch-delay-ms", "500"]
    capped = make_server(*flags, "--max-attribution-cost", "200")
    whole = make_server(*flags)
    spec = pb.AttributionSpec(method=IG, preprocessing=NATIVE, ig_steps=32)
    imgs = [rand_image(32, 32, seed=s) for s in range(6)]
    got, want = attribute(capped, spec, imgs), attribute(whole, spec, imgs)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(ok(a)["map"], ok(b)["map"], rtol=1e-3, atol=1e-7)
    started, now = capped.engine.attribution_jobs
    assert started >= 3 and now == 0       # at most 2 images (198) a batch
    assert whole.engine.attribution_jobs[0] < started
    spec.ig_steps = 100                     # 303 a single image: over the cap
    with pytest.raises(grpc.RpcError) as err:
        attribute(capped, spec, imgs[:1])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-attribution-cost of 200" in err.value.details()
