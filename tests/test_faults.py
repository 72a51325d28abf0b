"""Faults cost nothing: cancelled and killed clients, deadlines, slow readers, overload,
the concurrent-call limit, and SIGTERM during a rolling restart.

Work done by the server is read from its own Prometheus registry (the sum of the
batch-size histogram = images that went through the model), so "work stopped" is an
exact count, not a timing.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import hookserve
from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc
from hookserve_server.engine import Session

from conftest import RunningServer, rand_image
from helpers import (
    METRICS,
    R18,
    ServeProcess,
    answered,
    computed,
    in_threads,
    small_server,
    wait_until,
)

CODE = {c.value[0]: c for c in grpc.StatusCode}
def sessions(s: RunningServer) -> list[Session]:
    """The Extract sessions of server `s` that anything still references."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() wakes torch's deprecated aliases
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects()
                if isinstance(o, Session) and o.engine is s.engine]


def spec_req(layer="layer4", reduction=pb.REDUCTION_AVG_POOL, model="", pre=None):
    return pb.ExtractRequest(spec=pb.ExtractionSpec(
        model=model, layers=[pb.LayerRequest(name=layer, reduction=reduction)],
        preprocessing=pre))


def raw_req(arr: np.ndarray, image_id: str = "") -> pb.ExtractRequest:
    h, w = arr.shape[:2]
    return pb.ExtractRequest(image=pb.Image(id=image_id, raw=pb.RawImage(
        pixels=arr.tobytes(), height=h, width=w)))


class HeldStream:
    """A raw Extract call whose request side the test feeds (and can leave open)."""

    def __init__(self, address: str, timeout: float | None = 60.0, metadata=()) -> None:
        self.channel = grpc.insecure_channel(address)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        stub = pb_grpc.FeatureExtractorStub(self.channel)

        def gen():
            while True:
                item = self.requests.get()
                if item is None:
                    return
                yield item

        self.call = stub.Extract(gen(), timeout=timeout, metadata=metadata)

    def send(self, *reqs: pb.ExtractRequest) -> None:
        for r in reqs:
            self.requests.put(r)

    def close_requests(self) -> None:
        self.requests.put(None)

    def next_status(self) -> tuple[int, grpc.StatusCode]:
        for r in self.call:
            if r.WhichOneof("payload") == "status":
                return r.image_index, CODE[r.status.code]
        raise AssertionError("stream ended without a status")

    def finish(self) -> tuple[list[grpc.StatusCode], grpc.StatusCode]:
        """Read to the end: (per-image codes, the call's own code)."""
        codes = []
        try:
            for r in self.call:
                if r.WhichOneof("payload") == "status":
                    codes.append(CODE[r.status.code])
            return codes, grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return codes, exc.code()

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


# -- cancel, disconnect, deadline ------------------------------------------------------


def test_cancel_mid_stream_drops_queued_work_and_others_dont_notice(make_server, caplog):
    s = make_server(*R18, *METRICS, "--max-batch-size", "2", "--max-batch-delay-ms", "1")
    imgs = [rand_image(64, 64, i) for i in range(60)]
    with s.client(timeout=120) as c:
        reference = c.extract(imgs[0], "layer4", reduction="avg")["layer4"]
    base = computed(s)
    # A well-behaved client streams alongside the one that cancels.
    other: list = []
    stream = HeldStream(s.address)
    stream.send(spec_req(), *[raw_req(a) for a in imgs])
    with s.client(timeout=120) as c2:
        t = threading.Thread(target=lambda: other.extend(
            c2.extract_many([imgs[0]] * 20, "layer4", reduction="avg", max_in_flight=4)))
        t.start()
        assert stream.next_status() == (0, grpc.StatusCode.OK)
        stream.close()                                   # the client cancels
        t.join(120)
    assert not t.is_alive()
    assert len(other) == 20 and all(r.ok for r in other)
    for r in other:
        np.testing.assert_allclose(r.features["layer4"], reference, rtol=1e-4, atol=1e-5)
    wait_until(lambda: s.engine.queued == 0, what="admitted images to be dropped")
    wait_until(lambda: s.server.stream_caps.work_streams == 0, what="the cancelled call to end")
    # Of the 60 cancelled images, most never reached the model.
    cancelled_work = computed(s) - base - 20
    assert 1 <= cancelled_work < 30, cancelled_work
    assert s.engine.hook_count() == 0
    # Nothing of the cancelled session stays referenced (its futures, its tensors).
    wait_until(lambda: not sessions(s), 10, "the cancelled session to be freed")
    # A client going away is not a server fault, whichever the server notices first.
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_a_broken_request_stream_is_a_cancel_not_a_fault():
    """grpc's request iterator raises RpcError when the client goes away, at times
    before the call's cancel callback runs: the servicer reports it as CANCELLED."""
    from hookserve_server.errors import Cancelled
    from hookserve_server.servicer import _client_gone_is_cancelled

    def broken():
        yield "first"
        raise grpc.RpcError()

    it = _client_gone_is_cancelled(broken())
    assert next(it) == "first"
    with pytest.raises(Cancelled):
        next(it)


CLIENT_SCRIPT = textwrap.dedent("""
    import sys, grpc, numpy as np
    from hookserve.v1 import hookserve_pb2 as pb, hookserve_pb2_grpc as pb_grpc
    ch = grpc.insecure_channel(sys.argv[1])
    stub = pb_grpc.FeatureExtractorStub(ch)
    def reqs():
        yield pb.ExtractRequest(spec=pb.ExtractionSpec(layers=[pb.LayerRequest(
            name="layer4", reduction=pb.REDUCTION_AVG_POOL)]))
        for i in range(60):
            a = np.full((64, 64, 3), i, np.uint8)
            yield pb.ExtractRequest(image=pb.Image(raw=pb.RawImage(
                pixels=a.tobytes(), height=64, width=64)))
        import threading; threading.Event().wait()   # never half-close
    for r in stub.Extract(reqs()):
        if r.WhichOneof("payload") == "status":
            print("answered", flush=True)
            threading_event = __import__("threading").Event()
            threading_event.wait()                   # stop reading; wait to be killed
""")


def test_killed_client_process_costs_nothing(make_server):
    s = make_server(*R18, *METRICS, "--max-batch-size", "2", "--max-batch-delay-ms", "1")
    base = computed(s)
    p = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, s.address],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "answered"
        wait_until(lambda: s.server.stream_caps.work_streams == 1, what="the call to be open")
    finally:
        p.kill()                                        # SIGKILL: no goodbye on the wire
        p.wait(30)
    wait_until(lambda: s.server.stream_caps.work_streams == 0,
               what="the server to see the disconnect")
    wait_until(lambda: s.engine.queued == 0, what="the dead client's images to be dropped")
    assert computed(s) - base < 30
    assert s.engine.hook_count() == 0
    with s.client(timeout=60) as c:
        assert c.health() == "SERVING"
        assert c.extract(rand_image(32, 32), "layer4", reduction="avg")["layer4"].shape == (512,)


def test_work_for_an_expired_call_is_not_started(make_server):
    s = make_server(*R18, *METRICS, "--max-batch-size", "2", "--max-batch-delay-ms", "1")
    base = computed(s)
    n = 150
    stream = HeldStream(s.address, timeout=0.5)
    stream.send(spec_req(), *[raw_req(rand_image(224, 224, i)) for i in range(n)])
    stream.close_requests()
    codes, code = stream.finish()
    stream.close()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: s.engine.queued == 0, what="expired images to be dropped")
    wait_until(lambda: s.server.stream_caps.work_streams == 0, what="the expired call to end")
    done = computed(s) - base
    assert done < n // 2, f"{done} of {n} images computed for an expired call"
    assert len(codes) <= done


def test_sdk_deadline_is_a_typed_error(make_server):
    s = make_server(*R18, *METRICS)
    with s.client(timeout=0.001, retries=0) as c:
        with pytest.raises(hookserve.errors.DeadlineExceeded):
            c.extract(rand_image(224, 224), "layer4")
    wait_until(lambda: s.engine.queued == 0, what="the queue to empty")
    wait_until(lambda: s.server.stream_caps.work_streams == 0, what="the call to end")


# -- slow reader -------------------------------------------------------------------------


@pytest.mark.parametrize("native", [False, True], ids=["fixed-size", "native-size"])
def test_slow_reader_gets_backpressure_not_unbounded_buffers(make_server, native):
    # vgg11 features.0 at 224 is 64x224x224 float32 = 12.8 MB per image; a 40 MB stream
    # buffer allows 3 answered-but-unsent images. With native sizes the answer size is
    # not known in advance: the stream takes one image, then sizes its window by it.
    s = make_server(*small_server(models=("vgg11",)), *METRICS,
                    "--max-stream-buffer-bytes", str(40 << 20), "--max-batch-size", "2",
                    "--max-batch-delay-ms", "1")
    window = (40 << 20) // (64 * 224 * 224 * 4)
    assert window == 3
    n = 30
    base = computed(s, "vgg11")                 # the warm-up image
    stream = HeldStream(s.address)
    pre = pb.Preprocessing(mode=pb.Preprocessing.MODE_NATIVE) if native else None
    stream.send(spec_req("features.0", pb.REDUCTION_NONE, pre=pre),
                *[raw_req(rand_image(224, 224, i)) for i in range(n)])
    stream.close_requests()
    # The client reads nothing. The server computes up to its window, then waits.
    wait_until(lambda: computed(s, "vgg11") - base >= window and s.engine.queued == 0,
               what="the window to fill")
    assert computed(s, "vgg11") - base <= window
    [session] = sessions(s)
    assert session._inflight <= window
    # Once the client reads, everything arrives, in order.
    codes, code = stream.finish()
    stream.close()
    assert code == grpc.StatusCode.OK and codes == [grpc.StatusCode.OK] * n
    assert computed(s, "vgg11") - base == n


# -- overload ----------------------------------------------------------------------------


def test_100_concurrent_streams_against_a_small_queue(make_server):
    s = make_server(*R18, *METRICS, "--max-queue", "4", "--queue-wait-ms", "50",
                    "--max-batch-size", "4", "--max-batch-delay-ms", "1")
    imgs = [rand_image(64, 64, i) for i in range(3)]
    opts = dict(layers="layer4", reduction="avg", resize=64, crop=64)
    with s.client(timeout=120) as c:
        ref = [c.extract(a, **opts)["layer4"] for a in imgs]
    results: list[list] = [[] for _ in range(100)]

    def stream(i: int) -> None:
        with s.client(timeout=120) as c:
            results[i] = list(c.extract_many(imgs, **opts))

    in_threads(stream, range(100), timeout=180)
    flat = [r for rs in results for r in rs]
    assert len(flat) == 300
    ok = [r for r in flat if r.ok]
    busy = [r for r in flat if not r.ok]
    assert ok and busy, (len(ok), len(busy))
    for r in busy:
        assert isinstance(r.error, hookserve.errors.ResourceExhausted), r.error
        assert r.error.retry_after_s == pytest.approx(0.5)
        assert "--max-queue 4" in r.error.message
    for r in ok:
        np.testing.assert_allclose(r.features["layer4"], ref[r.index], rtol=1e-4, atol=1e-5)
    # Still alive, healthy, and back to an empty queue.
    wait_until(lambda: s.engine.queued == 0, what="the queue to drain")
    with s.client(timeout=60) as c:
        assert c.health() == "SERVING"
        assert c.extract(imgs[0], **opts)["layer4"].shape == (512,)


def test_max_streams_limits_concurrent_calls(make_server):
    s = make_server(*R18, *METRICS, "--max-streams", "2")
    held = [HeldStream(s.address) for _ in range(2)]
    try:
        for h in held:
            h.send(spec_req())
        wait_until(lambda: s.server.stream_caps.work_streams == 2, what="two open calls")
        with s.client(timeout=10, retries=0) as c:
            with pytest.raises(hookserve.errors.ResourceExhausted) as e:
                c.extract(rand_image(32, 32), "layer4", reduction="avg")
            assert "--max-streams" in e.value.message and e.value.retry_after_s == 1.0
            # Attribute streams share the cap (and, like Extract, have no idle timeout).
            with pytest.raises(hookserve.errors.ResourceExhausted) as e:
                c.attribute(rand_image(32, 32), layer="layer4", method="grad_cam")
            assert "--max-streams" in e.value.message
            # Saturated with streams, it still answers probes and unary calls.
            assert c.health() == "SERVING"
            assert c.list_models()[0].name == "resnet18"
    finally:
        for h in held:
            h.close()
    wait_until(lambda: s.server.stream_caps.work_streams == 0, what="the held calls to end")
    with s.client(timeout=30) as c:
        assert c.extract(rand_image(32, 32), "layer4", reduction="avg")["layer4"].shape == (512,)


# -- SIGTERM during a rolling restart ------------------------------------------------------


def test_sigterm_drains_and_the_sdk_moves_the_rest(make_server):
    grace = 6.0
    a = ServeProcess(*R18, "--max-batch-size", "2", "--max-batch-delay-ms", "1",
                     "--grace-seconds", str(grace))
    b = make_server(*R18, *METRICS)                        # the replica that stays
    try:
        imgs = [rand_image(64, 64, i) for i in range(40)]
        with b.client(timeout=120) as cb:
            ref = [r.features["layer4"] for r in cb.extract_many(imgs, "layer4",
                                                                  reduction="avg")]
        b_before = answered(b)
        # A stream that stays open through the drain, without sending images.
        idle = HeldStream(a.address, timeout=120)
        idle.send(spec_req())
        # A health Watch, opened before the signal, sees every status change. While it
        # is open the server stays in its grace period, so the checks below cannot race
        # a drain that finishes fast.
        watch_ch = grpc.insecure_channel(a.address)
        watch = health_pb2_grpc.HealthStub(watch_ch).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=120)
        seen: list[int] = []

        def follow():
            try:
                for m in watch:
                    seen.append(m.status)
            except grpc.RpcError:  # cancelled by the test, or the server went away
                pass

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
        wait_until(lambda: seen[-1:] == [health_pb2.HealthCheckResponse.SERVING], 10,
                   "the watch to see SERVING")
        with hookserve.Client([a.address, b.address], timeout=120, max_in_flight=8) as c:
            c._endpoints._rr = itertools.count(0)  # pin the first stream to replica A
            it = c.extract_many(imgs, "layer4", reduction="avg")
            first = next(it)
            assert first.ok
            t0 = time.monotonic()
            a.proc.send_signal(signal.SIGTERM)
            # 1. health goes NOT_SERVING
            wait_until(lambda: health_pb2.HealthCheckResponse.NOT_SERVING in seen, 10,
                       "NOT_SERVING")
            with hookserve.Client(a.address, timeout=10, retries=0) as ca:
                # 2. new calls get UNAVAILABLE
                with pytest.raises(hookserve.errors.Unavailable):
                    ca.extract(imgs[0], "layer4", reduction="avg")
                with pytest.raises(hookserve.errors.Unavailable):
                    ca.list_models()
            # 3. in-flight images finish; the SDK re-sends the rest to B: none lost.
            rest = list(it)
        results = [first, *rest]
        assert [r.index for r in results] == list(range(40))
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        for r in results:
            np.testing.assert_allclose(r.features["layer4"], ref[r.index], rtol=1e-4, atol=1e-5)
        moved = answered(b) - b_before
        assert 0 < moved < 40, moved            # A answered its admitted images, B the rest
        # An open stream with nothing in flight was ended as soon as the drain began.
        codes, code = idle.finish()
        assert codes == [] and code == grpc.StatusCode.UNAVAILABLE
        idle.close()
        watch.cancel()
        watch_ch.close()
        # 4. the process exits 0 within the grace period (plus interpreter teardown).
        assert a.proc.wait(grace + 10) == 0
        assert time.monotonic() - t0 < grace + 5
        log = "".join(a.log)
        assert "draining" in log and '"stopped"' in log
    finally:
        a.kill()


def test_sigterm_ends_an_idle_open_stream_at_once_instead_of_waiting_out_the_grace():
    # A client holding a stream open with nothing in flight must not hold up a rolling
    # restart: the stream ends UNAVAILABLE as soon as the drain starts.
    grace = 30.0
    a = ServeProcess(*R18, "--grace-seconds",
                     str(grace))
    try:
        idle = HeldStream(a.address, timeout=120)
        idle.send(spec_req())
        with hookserve.Client(a.address, timeout=30) as c:
            assert c.extract(rand_image(32, 32), "layer4", reduction="avg")
        t0 = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        assert a.proc.wait(grace + 15) == 0
        assert time.monotonic() - t0 < grace / 2  # not the whole grace period
        _, code = idle.finish()
        assert code == grpc.StatusCode.UNAVAILABLE
        idle.close()
        assert "grace period over" not in "".join(a.log)
    finally:
        a.kill()


@pytest.mark.parametrize("rpc", ["stream", "image"])
def test_a_call_still_running_when_the_grace_ends_does_not_keep_the_process(rpc):
    """Images still queued when the drain's grace ends: the model's thread stops, the
    calls are cancelled, and the process exits (a call waited for its image's answer
    for ever, so the process never exited, and a second SIGTERM did nothing)."""
    grace = 1.0
    a = ServeProcess(*R18, "--grace-seconds", str(grace))
    big = np.zeros((768, 768, 3), np.uint8)
    got: list = []

    def client() -> None:
        with hookserve.Client(a.address, timeout=120, retries=0) as c:
            try:
                if rpc == "stream":
                    for r in c.extract_many((big for _ in range(60)), ["layer4"],
                                            reduction="avg", native=True):
                        got.append(r)
                else:
                    for _ in range(60):
                        got.append(c.extract(big, ["layer4"], reduction="avg", native=True))
            except hookserve.HookserveError as exc:
                got.append(exc)

    t = threading.Thread(target=client, daemon=True)
    try:
        t.start()
        wait_until(lambda: len(got) >= 1, 120, "the first answer")
        a.proc.send_signal(signal.SIGTERM)
        assert a.proc.wait(grace + 60) == 0, "".join(a.log[-10:])
        t.join(60)
        assert len(got) < 60   # the drain cut the work short
    finally:
        a.kill()


# -- out of memory -------------------------------------------------------------------------

# The split-and-retry path exists for CUDA OOM. There is no GPU here, so the server runs in
# a child process whose address space is capped (RLIMIT_AS) once it is up: a real
# allocation in the forward pass then fails ("can't allocate memory", which the engine
# treats like a CUDA OOM) exactly as a too-big batch would on a GPU.
OOM_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from conftest import RunningServer
    from helpers import small_server
    # The cap below is sized from the contiguous forward's activations (channels_last on
    # the CPU takes more room per image: the convolutions' reorders).
    s = RunningServer([*small_server(models=("vgg11",)), "--max-batch-size", "16",
                       "--max-batch-delay-ms", "3000", "--preprocess-workers", "2",
                       "--memory-format", "contiguous"])
    vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
              if l.startswith("VmSize"))
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 255, (448, 448, 3), np.uint8) for _ in range(16)]
    big = rng.integers(0, 255, (2048, 2048, 3), np.uint8)
    # vgg11 features.0..3 at 448x448: about 45 MB of activations per image.
    resource.setrlimit(resource.RLIMIT_AS, (vm + (600 << 20), resource.RLIM_INFINITY))
    opts = dict(layers="features.3", reduction="avg", native=True)
    out = {}
    with s.client(timeout=600) as c:
        batch = list(c.extract_many(imgs, max_in_flight=16, **opts))
        out["batch_ok"] = [r.ok for r in batch]
        single = [c.extract(a, **opts)["features.3"] for a in imgs[:3]]
        out["match"] = [bool(np.allclose(batch[i].features["features.3"], single[i],
                                         rtol=1e-4, atol=1e-5)) for i in range(3)]
        res = list(c.extract_many([imgs[0], big, imgs[1]], **opts))
        out["alone"] = [(r.ok, r.error.code.name if r.error else "", r.error.message
                         if r.error else "") for r in res]
    print(json.dumps(out), flush=True)
    s.stop(1)
""")


def test_out_of_memory_splits_the_batch_and_a_lone_image_fails_alone():
    env = dict(os.environ, MALLOC_ARENA_MAX="2")   # fewer per-thread malloc reservations
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", OOM_SCRIPT, tests_dir], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert re.search(r"out of memory on a batch of (\d+): splitting", r.stderr)
    assert out["batch_ok"] == [True] * 16          # every image of the split batch answered
    assert out["match"] == [True] * 3              # ... with the same features as alone
    (ok0, _, _), (ok1, code1, msg1), (ok2, _, _) = out["alone"]
    assert ok0 and ok2 and not ok1
    assert code1 == "RESOURCE_EXHAUSTED" and "more device memory" in msg1
