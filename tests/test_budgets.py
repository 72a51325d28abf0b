"""Every client-controlled cost is bounded before it is paid.

1. Geometry: every intermediate size (decoded, resized, cropped) is computed from the
   image header before decoding and checked against the limits; a tiny PNG can no
   longer become a 256x256000 resize.
2. Answer buffers: each answer's bytes are reserved before it is computed, per stream
   (--max-stream-buffer-bytes) and across streams (--max-buffer-bytes); a full budget
   stops reading the stream (backpressure), an answer over the whole budget gets
   RESOURCE_EXHAUSTED without a retry hint. Measured as the server process's RSS (the
   server runs in this process; answers over glibc's mmap threshold are returned to the
   OS as soon as they are freed).
"""

from __future__ import annotations

import io
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

import hookserve
from hookserve.v1 import hookserve_pb2 as pb
from hookserve_server.preprocess.geometry import DECODE_BYTES_PER_PIXEL, RESIZE_BYTES_PER_PIXEL

from conftest import encode, rand_image
from helpers import rss, small_server

FAST = small_server("--max-batch-delay-ms", "2")
MiB = 1 << 20
CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def png(w: int, h: int) -> bytes:
    return encode(np.full((h, w, 3), 90, np.uint8))


# -- 1: geometry ---------------------------------------------------------------------------
@pytest.mark.parametrize("data, options, sizes", [
    (png(1000, 1), {}, "256x256000"),                      # 1xN, default preprocessing
    (png(1, 1000), {}, "256000x256"),                      # Nx1
    (png(24, 8), {"resize": 4096, "crop": 224}, "4096x12288"),  # huge resize, small crop
    (png(1000, 1), {"resize": 64}, "64x64000"),            # resize, no crop
    (png(9000, 2), {"native": True}, "2x9000"),            # native: decoded = input
], ids=["1xN-default", "Nx1-default", "resize4096-crop224", "resize-no-crop", "native"])
def test_intermediate_sizes_are_refused_from_the_header(server, data, options, sizes):
    t0 = time.monotonic()
    with server.client(timeout=60, retries=0) as c:
        results = list(c.extract_many([data, rand_image(40, 40)], ["conv1"], **options))
    err = results[0].error
    assert err is not None and err.code == grpc.StatusCode.INVALID_ARGUMENT, err
    assert sizes in str(err) and "--max-input-side" in str(err), str(err)
    assert results[1].ok  # the stream goes on
    assert time.monotonic() - t0 < 5  # nothing was resized


def test_raw_pixels_get_the_same_geometry_check(server):
    with server.client(timeout=60, retries=0) as c:
        [r] = list(c.extract_many([np.zeros((1, 1000, 3), np.uint8)], ["conv1"]))
    assert r.error is not None and "256x256000" in str(r.error)


def test_exif_rotation_counts_in_the_geometry(server):
    im = Image.fromarray(np.zeros((1, 1000, 3), np.uint8))
    exif = im.getexif()
    exif[0x0112] = 6  # displayed rotated: 1000 high, 1 wide
    buf = io.BytesIO()
    im.save(buf, "PNG", exif=exif)
    with server.client(timeout=60, retries=0) as c:
        [r] = list(c.extract_many([buf.getvalue()], ["conv1"]))
    assert r.error is not None and "256000x256" in str(r.error), str(r.error)


def test_wide_images_within_the_limits_still_work(server):
    with server.client(timeout=60, retries=0) as c:
        out = c.extract(png(3000, 100), ["conv1"])  # resized to 256x7680, then cropped
    assert out["conv1"].shape == (64, 112, 112)


# -- 2: answer buffers ---------------------------------------------------------------------
def _spec(**pre) -> pb.ExtractRequest:
    return pb.ExtractRequest(spec=pb.ExtractionSpec(
        model="resnet18", layers=[pb.LayerRequest(name="conv1")],
        preprocessing=pb.Preprocessing(mode=pb.Preprocessing.MODE_NATIVE, **pre)))


def _raw(i: int, side: int) -> pb.ExtractRequest:
    return pb.ExtractRequest(image=pb.Image(id=str(i), raw=pb.RawImage(
        height=side, width=side, pixels=bytes(side * side * 3))))


def _extract(ch):
    return ch.stream_stream("/hookserve.v1.FeatureExtractor/Extract",
                            request_serializer=pb.ExtractRequest.SerializeToString,
                            response_deserializer=pb.ExtractResponse.FromString)


def _answers(call) -> dict[str, str]:
    """Read a whole stream: image id -> 'OK' or the status code name."""
    out = {}
    for msg in call:
        if msg.HasField("status"):
            out[msg.image_id] = CODE_NAMES[msg.status.code]
    return out


def _wait_blocked(s, streams: int, timeout: float = 60) -> None:
    """Until `streams` readers wait for buffer room and nothing is being computed."""
    budget = s.engine.budget
    assert budget.wait_for(lambda: budget.waiting >= streams, timeout), budget.waiting
    assert s.engine.admission.wait_empty(timeout)


SIDE = 768                        # resnet18 conv1 at 768x768: 64x384x384 float32
ANSWER = 64 * 384 * 384 * 4       # 37.7 MB, over glibc's mmap threshold


def test_a_stream_that_is_not_read_holds_its_buffer_and_one_answer(make_server):
    s = make_server(*FAST, "--max-stream-buffer-bytes", str(64 * MiB))
    with grpc.insecure_channel(s.address) as ch:
        # warm the allocator and the model at this size
        assert _answers(_extract(ch)(iter([_spec(), _raw(0, SIDE)]))) == {"0": "OK"}
        base = rss()
        reqs = [_spec(), _raw("tiny", 16)] + [_raw(i, SIDE) for i in range(12)]
        call = _extract(ch)(iter(reqs))  # never read until the end
        _wait_blocked(s, 1)
        grown = rss() - base
        assert s.engine.budget.reserved <= 64 * MiB
        # the buffer, plus one answer on its way out, plus 40 MiB for everything else
        assert grown < 64 * MiB + ANSWER + 40 * MiB, f"grew {grown / MiB:.0f} MiB"
        answers = _answers(call)
    assert answers == {"tiny": "OK", **{str(i): "OK" for i in range(12)}}  # none lost


def test_all_streams_together_stay_within_the_global_budget(make_server):
    s = make_server(*FAST, "--max-stream-buffer-bytes", str(80 * MiB),
                    "--max-buffer-bytes", str(80 * MiB))
    n = 3
    with grpc.insecure_channel(s.address) as ch:
        assert _answers(_extract(ch)(iter([_spec(), _raw(0, SIDE)]))) == {"0": "OK"}
        base = rss()
        calls = [_extract(ch)(iter([_spec()] + [_raw(i, SIDE) for i in range(6)]))
                 for _ in range(n)]
        _wait_blocked(s, n)
        grown = rss() - base
        assert s.engine.budget.reserved <= 80 * MiB
        assert grown < 80 * MiB + n * ANSWER + 40 * MiB, f"grew {grown / MiB:.0f} MiB"
        # health answers within a second while every stream is stuck
        t0 = time.monotonic()
        assert health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=5).status == 1
        assert time.monotonic() - t0 < 1.0
        results = [None] * n

        def read(k):
            results[k] = _answers(calls[k])

        readers = [threading.Thread(target=read, args=(k,)) for k in range(n)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(120)
    assert all(r == {str(i): "OK" for i in range(6)} for r in results), results


def test_streams_that_are_not_read_leave_room_for_other_calls(make_server):
    """Streams whose clients stop reading fill the global budget only up to its
    headroom (16 MiB here: 80 MiB less one stream's 64): a new call is still answered
    (every other call waited without end)."""
    s = make_server(*FAST, "--max-stream-buffer-bytes", str(64 * MiB),
                    "--max-buffer-bytes", str(80 * MiB))
    side = 256                                   # conv1: 64x128x128 float32, 4 MiB
    with grpc.insecure_channel(s.address) as ch:
        stuck = [_extract(ch)(iter([_spec()] + [_raw(i, side) for i in range(24)]))
                 for _ in range(2)]
        _wait_blocked(s, 2)
        g = s.engine.budget
        assert g.headroom == 16 * MiB
        # (each stream's first answer is taken holding none: it may use the headroom)
        assert g.reserved <= g.capacity - g.headroom + 2 * 4 * MiB
        new = _extract(ch)(iter([_spec()] + [_raw(i, side) for i in range(6)]), timeout=60)
        assert _answers(new) == {str(i): "OK" for i in range(6)}
        for call in stuck:                       # nothing of theirs was lost
            assert _answers(call) == {str(i): "OK" for i in range(24)}


def test_the_headroom_rule_and_a_stream_alone_fills_its_own_budget(make_server):
    """The rule itself: streams holding answers stop at the capacity less the headroom,
    one holding none takes it. And the headroom never stops a stream alone from
    filling its own budget: an Open Inference Protocol request holds its whole answer
    until it is complete, so a headroom that left it less would wait for itself."""
    from hookserve_server.engine.budget import Budget

    root = Budget(100, "--max-buffer-bytes", headroom=25)
    a, b = root.child(80, "--max-stream-buffer-bytes"), root.child(80, "x")
    never = lambda: False   # noqa: E731
    held = [a.reserve(30, never, ""), a.reserve(30, never, ""), a.reserve(15, never, "")]
    assert root.reserved == 75
    assert b.reserve(20, never, "") is not None            # b holds none: the headroom
    assert b.reserve(1, lambda: True, "") is None           # b holds 20: waits (cancelled)
    for r in held:
        r.release()
    for stream, total in [(str(76 * MiB), 80 * MiB), (str(80 * MiB), 80 * MiB),
                          (str(256 * MiB), 1024 * MiB)]:
        s = make_server(*FAST, "--max-stream-buffer-bytes", stream,
                        "--max-buffer-bytes", str(total))
        g = s.engine.budget
        assert g.capacity - g.headroom >= int(stream), (stream, total, g.headroom)
        assert g.headroom == min(int(stream), total // 4, total - int(stream))


def test_an_answer_over_the_whole_budget_is_refused_without_retry_hint(make_server):
    s = make_server(*FAST, "--max-stream-buffer-bytes", str(32 * MiB))
    with s.client(timeout=60, retries=0) as c:
        results = list(c.extract_many([np.zeros((SIDE, SIDE, 3), np.uint8),
                                       rand_image(64, 64)], ["conv1"], native=True))
    err = results[0].error
    assert err is not None and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.retry_after_s is None
    assert "--max-stream-buffer-bytes" in str(err)
    assert "fewer layers" in str(err)
    assert results[1].ok
    # an Attribute answer is told what Attribute can change (it was told of layers,
    # reductions and float16, which it has none of)
    s = make_server(*FAST, "--max-stream-buffer-bytes", str(1 * MiB))
    with s.client(timeout=60, retries=0) as c:
        results = list(c.attribute_many([rand_image(64, 64)] * 2, method="gradient",
                                        top_k=2))   # 2 maps of 3x224x224 float32
    for r in results:
        assert r.error is not None and r.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "top_k" in str(r.error) and "fewer layers" not in str(r.error)
    assert hookserve  # typed errors come from the SDK


# -- 1: the preprocessing memory formula of docs/limits.md -------------------------------
_PEAK = """
import io, sys
import numpy as np
from PIL import Image
from hookserve_server.preprocess.decode import decode
from hookserve_server.preprocess.geometry import apply_geometry
from hookserve_server.spec import ImageInput, Mode, Preprocess
h, w, resize = map(int, sys.argv[1:4])
buf = io.BytesIO()
Image.fromarray(np.full((h, w, 3), 77, np.uint8)).save(buf, "PNG")
pre = (Preprocess(Mode.RESIZE_CROP, resize=resize, crop_height=224, crop_width=224)
       if resize else Preprocess(Mode.NATIVE))
apply_geometry(np.zeros((8, 8, 3), np.uint8), pre, 256, (224, 224))  # warm torch
def status(key):
    return int(open("/proc/self/status").read().split(key)[1].split()[0]) * 1024
with open("/proc/self/clear_refs", "w") as fh:  # the peak (VmHWM) restarts from here
    fh.write("5")
before = status("VmRSS:")
decode_and_resize = apply_geometry(decode(ImageInput("x", encoded=buf.getvalue()), 10**9),
                                   pre, 256, (224, 224))
print(status("VmHWM:") - before)
"""


@pytest.mark.parametrize("h, w, resize", [(2000, 2000, 0), (4000, 3000, 256),
                                          (1000, 3000, 1024)],
                         ids=["native", "downscale", "upscale"])
def test_preprocessing_peak_memory_is_within_the_documented_formula(h, w, resize):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK, str(h), str(w), str(resize)],
                         capture_output=True, text=True, check=True).stdout
    peak = int(out.split()[-1])
    p_dec = h * w
    p_res = 0
    if resize:
        short, long = min(h, w), max(h, w)
        p_res = resize * int(resize * long / short)
    bound = DECODE_BYTES_PER_PIXEL * p_dec + RESIZE_BYTES_PER_PIXEL * p_res
    assert (DECODE_BYTES_PER_PIXEL, RESIZE_BYTES_PER_PIXEL) == (24, 26)  # as documented
    assert peak <= bound, f"peak {peak / MiB:.0f} MiB over 24*P_dec + 26*P_res = " \
                          f"{bound / MiB:.0f} MiB"


def test_preprocessing_memory_budget_refuses_what_could_never_fit(make_server):
    s = make_server(*FAST, "--max-preprocess-bytes", str(50_000_000))
    with s.client(timeout=60, retries=0) as c:
        results = list(c.extract_many([np.zeros((1500, 1500, 3), np.uint8),  # 54 MB
                                       np.zeros((1000, 1000, 3), np.uint8)],  # 24 MB
                                      ["conv1"], reduction="avg", native=True))
    err = results[0].error
    assert err is not None and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert "--max-preprocess-bytes" in str(err) and err.retry_after_s is None
    assert results[1].ok


def test_health_answers_within_a_second_while_flooded_with_resize_bombs(server):
    """Four streams of 83-byte PNGs that would each be 256x256000: refused from the
    header, so the server stays responsive."""
    bomb = png(1000, 1)
    done = threading.Event()
    counts: list[int] = []

    def flood():
        with server.client(timeout=120, retries=0) as c:
            n = sum(1 for r in c.extract_many([bomb] * 200, ["conv1"]) if not r.ok)
        counts.append(n)

    threads = [threading.Thread(target=flood) for _ in range(4)]
    for t in threads:
        t.start()
    with grpc.insecure_channel(server.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while not done.is_set() and any(t.is_alive() for t in threads):
            t0 = time.monotonic()
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
            assert time.monotonic() - t0 < 1.0
            done.wait(0.05)
    for t in threads:
        t.join(120)
    assert counts == [200] * 4
