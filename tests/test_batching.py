"""Dynamic batching: correctness only (speed lives in bench/).

To make batches form deterministically, without sleeps or timing luck, a test
*holds* the device worker: a real forward pre-hook on the served model blocks the
first forward pass until the test releases it. Requests sent meanwhile are admitted
and queued (observed through `engine.queued`, waited on with a deadline); on release
the worker takes them as one batch. The same pre-hook records the batch size of
every forward pass, so the tests see exactly which batches ran.
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from hookserve.images import to_image
from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc
from hookserve_server.models import build_model

from conftest import encode, rand_image
from helpers import R18, feature_extractor, wait_until

SIDE = 64  # native 64x64 images: cheap forward passes on a 2-core CPU
FLAGS = [*R18, "--max-batch-size", "8", "--max-batch-delay-ms", "2000", "--metrics-port", "0"]


class Gate:
    """A forward pre-hook on a served model: records batch sizes; can hold the worker."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.sizes: list[int] = []
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.sizes.append(int(args[0].shape[0]))
        if self.armed:
            self.armed = False
            self.entered.set()
            if not self.release.wait(60):  # never hang the worker for good
                raise RuntimeError("test gate was not released")

    def hold(self) -> None:
        self.armed = True
        self.entered.clear()
        self.release.clear()

    def remove(self) -> None:
        self.release.set()
        self._handle.remove()


@pytest.fixture
def gated(make_server):
    srv = make_server(*FLAGS)
    gate = Gate(srv.engine.models["resnet18"].module)
    yield srv, gate
    gate.remove()


def hold_worker(srv, gate: Gate, pool: ThreadPoolExecutor):
    """Start one image whose forward pass blocks the worker; returns its future."""
    gate.hold()
    fut = pool.submit(one, srv, rand_image(SIDE, SIDE, 999), ["layer4"])
    assert gate.entered.wait(30), "the holding image never reached the model"
    return fut


def one(srv, img, layers, **opts):
    with srv.client(timeout=120) as c:
        return c.extract(img, layers, native=True, **opts)


def reference(images, layers: list[str]) -> list[dict[str, np.ndarray]]:
    """torchvision's own feature extractor, one image per forward, same weights."""
    module, _ = build_model("resnet18", "random", seed=0)
    fx = feature_extractor(module.eval(), {n: n for n in layers})
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    out = []
    with torch.inference_mode():
        for img in images:
            x = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float()
            x = x.div(255).sub(mean).div(std)
            out.append({k: v[0].numpy() for k, v in fx(x).items()})
    return out


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    # Batched and single-image convolutions take different CPU kernels and summation
    # orders: float32 results differ at the ~1e-6 relative level per layer, compounding
    # over the network's depth. 1e-4 of the tensor's scale is far above that noise and
    # far below any real mix-up (another image's or layer's features differ at O(1)).
    assert got.shape == want.shape
    scale = float(np.abs(want).max()) or 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)


def batch_size_samples(srv) -> tuple[float, float]:
    reg = srv.telemetry.registry
    labels = {"model": "resnet18"}
    return (reg.get_sample_value("hookserve_batch_size_count", labels) or 0.0,
            reg.get_sample_value("hookserve_batch_size_sum", labels) or 0.0)


def test_concurrent_requests_form_one_batch_with_single_image_results(gated):
    srv, gate = gated
    images = [rand_image(SIDE, SIDE, seed) for seed in range(8)]
    layers = ["layer1", "layer4"]
    with ThreadPoolExecutor(9) as pool:
        holder = hold_worker(srv, gate, pool)
        count0, sum0 = batch_size_samples(srv)
        futs = [pool.submit(one, srv, img, layers) for img in images]
        wait_until(lambda: srv.engine.queued == 9, what="8 clients' images to be queued")
        gate.release.set()
        results = [f.result(timeout=120) for f in futs]
        holder.result(timeout=120)
    # The 8 images from 8 separate calls went through the model as one batch of 8.
    assert gate.sizes[-2:] == [1, 8]
    count1, sum1 = batch_size_samples(srv)
    # The server's own histogram agrees: the holder's batch of 1 (recorded when its
    # pass ended, after count0 was read), then one batch of 8.
    assert (count1 - count0, sum1 - sum0) == (2, 9)
    for got, want in zip(results, reference(images, layers), strict=True):
        assert set(got) == set(layers)
        for name in layers:
            assert_close(got[name], want[name])


def test_batched_equals_unbatched_server(make_server, gated):
    """A --max-batch-size 1 server gives the same tensors as a batch of 8."""
    srv, gate = gated
    single = make_server(*R18, "--max-batch-size", "1")
    images = [rand_image(SIDE, SIDE, 100 + s) for s in range(8)]
    layers = {"layer2": {"reduction": "none"}, "layer4": {"reduction": "avg"}}
    with ThreadPoolExecutor(9) as pool:
        holder = hold_worker(srv, gate, pool)
        futs = [pool.submit(one, srv, img, layers) for img in images]
        wait_until(lambda: srv.engine.queued == 9, what="8 clients' images to be queued")
        gate.release.set()
        batched = [f.result(timeout=120) for f in futs]
        holder.result(timeout=120)
    assert gate.sizes[-1] == 8
    with single.client(timeout=120) as c:
        unbatched = [r.raise_for_error() for r in
                     c.extract_many(images, layers, crop=SIDE, max_in_flight=8)]
    for b, u in zip(batched, unbatched, strict=True):
        assert b["layer4"].shape == (512,)
        for name in layers:
            assert_close(b[name], u[name])


def test_different_layer_sets_in_one_batch_get_only_their_own(gated):
    srv, gate = gated
    img = rand_image(SIDE, SIDE, 7)
    asks = [
        (["layer1"], {}),
        (["layer4"], {"reduction": "avg"}),
        (["layer2", "layer3"], {"dtype": "float16"}),
        (["conv1", "fc"], {}),
        (["layer4"], {"reduction": "max", "l2_normalize": True}),
    ]
    with ThreadPoolExecutor(len(asks) + 1) as pool:
        holder = hold_worker(srv, gate, pool)
        futs = [pool.submit(one, srv, img, layers, **opts) for layers, opts in asks]
        wait_until(lambda: srv.engine.queued == len(asks) + 1, what="all requests to be queued")
        gate.release.set()
        got = [f.result(timeout=120) for f in futs]
        holder.result(timeout=120)
    assert gate.sizes[-1] == len(asks)  # all in one forward pass
    ref = reference([img], ["conv1", "layer1", "layer2", "layer3", "layer4", "fc"])[0]
    for (layers, _opts), feats in zip(asks, got, strict=True):
        assert sorted(feats) == sorted(layers)
    assert_close(got[0]["layer1"], ref["layer1"])
    assert_close(got[1]["layer4"], ref["layer4"].mean(axis=(1, 2)))
    assert got[2]["layer2"].dtype == np.float16 and got[2]["layer3"].dtype == np.float16
    np.testing.assert_allclose(got[2]["layer3"].astype(np.float32), ref["layer3"],
                               rtol=2e-3, atol=2e-3 * float(np.abs(ref["layer3"]).max()))
    assert_close(got[3]["conv1"], ref["conv1"])
    assert_close(got[3]["fc"], ref["fc"])
    mx = ref["layer4"].max(axis=(1, 2))
    assert_close(got[4]["layer4"], mx / np.linalg.norm(mx))


def test_queue_is_bounded_and_overflow_gets_resource_exhausted(make_server):
    srv = make_server(*R18, "--max-queue", "2", "--queue-wait-ms", "100")
    gate = Gate(srv.engine.models["resnet18"].module)
    images = [rand_image(SIDE, SIDE, s) for s in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            gate.hold()
            with srv.client(timeout=120) as ca:
                filler = pool.submit(lambda: [r.raise_for_error() for r in ca.extract_many(
                    images, ["layer1"], crop=SIDE, max_in_flight=2)])
                assert gate.entered.wait(30)
                wait_until(lambda: srv.engine.queued == 2, what="the queue to be full")
                # The queue is full and the worker is held: a third image waits
                # --queue-wait-ms and is refused with a retry hint.
                with srv.client(timeout=120) as cb:
                    r = next(iter(cb.extract_many([images[0]], ["layer1"], native=True)))
                    assert r.error is not None
                    assert r.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert r.error.retry_after_s and r.error.retry_after_s > 0
                    assert "--max-queue" in str(r.error)
                    assert srv.engine.queued == 2
                    gate.release.set()
                    assert len(filler.result(timeout=120)) == 2
                    # Once there is room, the same request succeeds.
                    assert "layer1" in cb.extract(images[0], ["layer1"], native=True)
    finally:
        gate.remove()
    wait_until(lambda: srv.engine.queued == 0, what="the queue to drain")


def test_cancelled_stream_drops_its_queued_images_and_breaks_nothing(gated):
    srv, gate = gated
    doomed = [rand_image(SIDE, SIDE, 50 + s) for s in range(6)]
    others = [rand_image(SIDE, SIDE, 60 + s) for s in range(3)]
    with ThreadPoolExecutor(2) as pool, grpc.insecure_channel(srv.address) as ch:
        holder = hold_worker(srv, gate, pool)
        forwards_before = len(gate.sizes)
        # A raw stream (so the test can cancel it from here): spec + 6 images.
        spec = pb.ExtractionSpec(
            model="resnet18", layers=[pb.LayerRequest(name="layer3")],
            preprocessing=pb.Preprocessing(mode=pb.Preprocessing.MODE_RESIZE_CROP,
                                           crop_height=SIDE, crop_width=SIDE))
        reqs = [pb.ExtractRequest(spec=spec)] + [
            pb.ExtractRequest(image=to_image(a, str(i)))
            for i, a in enumerate(doomed)]
        call = pb_grpc.FeatureExtractorStub(ch).Extract(iter(reqs), timeout=120)
        wait_until(lambda: srv.engine.queued == 7, what="the doomed stream's images to be queued")
        with srv.client(timeout=120) as c:
            other = pool.submit(lambda: [r.raise_for_error() for r in c.extract_many(
                others, ["layer3"], crop=SIDE, max_in_flight=3)])
            wait_until(lambda: srv.engine.queued == 10, what="the other stream's images")
            call.cancel()
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.CANCELLED
            gate.release.set()
            got = other.result(timeout=120)
        holder.result(timeout=120)
    # The other client's answers are right, and the doomed images never ran.
    for feats, want in zip(got, reference(others, ["layer3"]), strict=True):
        assert_close(feats["layer3"], want["layer3"])
    assert sum(gate.sizes[forwards_before:]) == len(others)
    wait_until(lambda: srv.engine.queued == 0, what="the queue to empty")
    # Only the gate's own pre-hook is left.
    wait_until(lambda: srv.engine.hook_count() == 1, what="hooks to be removed")
    # And the server still serves.
    with srv.client(timeout=120) as c:
        assert c.extract(others[0], ["layer3"], native=True)["layer3"].shape[0] == 256


# -- --gpu-decode: no GPU here, so the CPU fallback and the tensor path are tested ------
def test_gpu_decode_flag_falls_back_to_cpu_decoding(make_server):
    srv = make_server(*R18, "--gpu-decode")
    assert srv.engine.config.gpu_decode is True
    img = rand_image(SIDE, SIDE, 3)
    with srv.client(timeout=120) as c:
        got = c.extract(encode(img, "JPEG", quality=95), ["layer2"], native=True)
        bad = next(iter(c.extract_many([b"\xff\xd8not a jpeg"], ["layer2"], native=True)))
    # Decoded on the CPU (the model is on the CPU): exactly the PIL-decoded pixels.
    want = reference([np.asarray(Image.open(io.BytesIO(encode(img, "JPEG", quality=95))))],
                     ["layer2"])[0]
    assert_close(got["layer2"], want["layer2"])
    assert bad.error is not None and bad.error.code == grpc.StatusCode.INVALID_ARGUMENT


def test_device_jpeg_decode_path_matches_cpu_path():
    """The --gpu-decode functions, run with device=cpu (the only device here)."""
    from hookserve_server import preprocess as pp
    from hookserve_server.preprocess.geometry import geometry_on_tensor
    from hookserve_server.preprocess.gpu_decode import decode_jpeg_on_device
    from hookserve_server.spec import ImageInput, Preprocess

    cpu = torch.device("cpu")
    img = rand_image(90, 120, 4)
    data = encode(img, "JPEG", quality=95)
    t = decode_jpeg_on_device(ImageInput("a", encoded=data), 10**6, cpu)
    ref = pp.decode(ImageInput("a", encoded=data), 10**6)
    assert t is not None and t.dtype == torch.uint8 and tuple(t.shape) == (3, 90, 120)
    # Same decoder family here (libjpeg); nvjpeg may differ by a few levels.
    assert np.abs(t.permute(1, 2, 0).numpy().astype(int) - ref.astype(int)).max() <= 2
    for pre in (Preprocess(), Preprocess("resize_crop", resize=64, crop_height=56,
                                         crop_width=48)):
        a = geometry_on_tensor(t, pre, 256, (224, 224))
        b = pp.apply_geometry(t.permute(1, 2, 0).numpy(), pre, 256, (224, 224))
        assert a.shape == b.shape and a.dtype == torch.uint8
        assert (a.int() - b.int()).abs().max() <= 1
    # What the CPU path must handle returns None: other formats, grayscale, EXIF
    # (orientation), over the pixel limit.
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", exif=exif.tobytes())
    for other in (encode(img, "PNG"), encode(img[:, :, 0], "JPEG"), buf.getvalue()):
        assert decode_jpeg_on_device(ImageInput("b", encoded=other), 10**6, cpu) is None
    assert decode_jpeg_on_device(ImageInput("c", encoded=data), 100, cpu) is None
