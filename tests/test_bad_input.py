"""Bad input over the wire: every case gets its own status code and a message that says
what to change. Per-image problems end that image only; per-call problems end the call
after the images sent before them were answered.

Raw hookserve.v1 stubs are used where the SDK would refuse to send the bad thing.
"""

from __future__ import annotations

import re
import struct
import zlib

import grpc
import numpy as np
import pytest

import hookserve
from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc

from conftest import RunningServer, encode, rand_image
from helpers import R18

INVALID = grpc.StatusCode.INVALID_ARGUMENT
CODE = {c.value[0]: c for c in grpc.StatusCode}

# -- helpers -------------------------------------------------------------------------


def layer(name: str = "conv1", reduction=pb.REDUCTION_AVG_POOL, dtype=pb.DTYPE_FLOAT32):
    return pb.LayerRequest(name=name, reduction=reduction, dtype=dtype)


def spec_msg(*layers: pb.LayerRequest, model: str = "", pre: pb.Preprocessing | None = None):
    return pb.ExtractRequest(spec=pb.ExtractionSpec(
        model=model, layers=list(layers) or [layer()], preprocessing=pre))


def img_msg(data: bytes | None = None, image_id: str = "", raw: tuple | None = None):
    if raw is not None:
        pixels, h, w = raw
        return pb.ExtractRequest(image=pb.Image(id=image_id, raw=pb.RawImage(
            pixels=pixels, height=h, width=w)))
    if data is None:
        return pb.ExtractRequest(image=pb.Image(id=image_id))
    return pb.ExtractRequest(image=pb.Image(id=image_id, encoded=data))


class Answer:
    """What one Extract call returned: per-image statuses and the call's own status."""

    def __init__(self, images: list[tuple[int, str, grpc.StatusCode, str]],
                 code: grpc.StatusCode, details: str, tensors: int) -> None:
        self.images, self.code, self.details, self.tensors = images, code, details, tensors

    def image(self, i: int) -> tuple[grpc.StatusCode, str]:
        index, _id, code, msg = self.images[i]
        assert index == i
        return code, msg


def extract_raw(address: str, requests: list[pb.ExtractRequest], *,
                timeout: float = 60.0, options=()) -> Answer:
    with grpc.insecure_channel(address, options=list(options)) as ch:
        stub = pb_grpc.FeatureExtractorStub(ch)
        images, tensors = [], 0
        try:
            for r in stub.Extract(iter(requests), timeout=timeout):
                if r.WhichOneof("payload") == "status":
                    images.append((r.image_index, r.image_id, CODE[r.status.code],
                                   r.status.message))
                else:
                    tensors += 1
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
    return Answer(images, code, details, tensors)


def png_header_bomb(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels, with a few rows of data.

    Fully decoding it would allocate width*height*3 bytes before finding the data
    short; the server must refuse it from the header alone.
    """
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\0" * (1 + 3 * width) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def jpeg_header_bomb(width: int, height: int) -> bytes:
    """A real small JPEG with its SOF0 frame header patched to claim width x height."""
    data = bytearray(encode(rand_image(16, 16, 3), "JPEG"))
    sof = data.index(b"\xff\xc0")
    # SOF0: marker(2) length(2) precision(1) height(2) width(2)
    data[sof + 5:sof + 7] = struct.pack(">H", height)
    data[sof + 7:sof + 9] = struct.pack(">H", width)
    return bytes(data)


def ppm_bytes() -> bytes:
    return b"P6\n2 2\n255\n" + bytes(range(12))


@pytest.fixture(scope="module")
def limited() -> RunningServer:
    """resnet18 with small limits, so each limit can be crossed cheaply."""
    s = RunningServer([*R18, "--max-batch-delay-ms", "2",
                       "--max-image-pixels", "40000",          # 200x200
                       "--max-response-bytes", "1000000",      # 1 MB per image
                       "--max-message-bytes", str(1 << 20),    # 1 MiB per request message
                       "--max-input-side", "512",
                       "--max-batch-bytes", "8000000"])       # 8 MB of activations
    yield s
    s.stop(2.0)


# -- per-image errors: each ends its image only --------------------------------------


def test_each_bad_image_fails_alone_and_the_stream_goes_on(server):
    import io

    from PIL import Image

    good = encode(rand_image(64, 64, 1), "PNG")
    jpeg = encode(rand_image(96, 96, 2), "JPEG")
    png = encode(rand_image(96, 96, 2), "PNG")
    buf = io.BytesIO()
    Image.fromarray(rand_image(96, 96, 2)).save(buf, "TIFF", compression="tiff_lzw")
    tiff = buf.getvalue()   # (its directory comes last)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).random((48, 64), dtype=np.float32)).save(
        buf, "TIFF")
    float_tiff = buf.getvalue()

    def zero_width(data: bytes) -> bytes:
        return data[:16] + struct.pack(">I", 0) + data[20:]

    cases = [
        # (image request, expected code, words the message must contain)
        (img_msg(b""), INVALID, "empty"),
        (img_msg(None), INVALID, "empty"),                          # neither bytes nor raw
        (img_msg(jpeg[: len(jpeg) // 2]), INVALID, "truncated"),
        (img_msg(png[: len(png) - 40]), INVALID, "truncated"),
        (img_msg(png[:40]), INVALID, "start as a PNG"),             # cut inside the header
        # cut where PIL cannot even tell the format: named by its signature
        (img_msg(png[:12]), INVALID, "start as a PNG but its header could not be read "
                                     "(is the file cut short or damaged?"),
        (img_msg(tiff[:len(tiff) // 2]), INVALID, "start as a TIFF but its header"),
        (img_msg(zero_width(png)), INVALID, "PNG"),
        # floating-point pixels have no one scale (values 0..1 became black)
        (img_msg(float_tiff), INVALID, "this TIFF holds floating-point pixels (mode F)"),
        (img_msg(b"this is not an image at all, just text" * 10), INVALID, "not a recognised"),
        (img_msg(bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8))),
         INVALID, "not a recognised"),
        (img_msg(ppm_bytes()), INVALID, "unsupported image format PPM"),
        (img_msg(encode(rand_image(16, 16), "ICO")), INVALID, "unsupported image format ICO"),
        (img_msg(png_header_bomb(60000, 60000)), INVALID, "--max-image-pixels"),
        (img_msg(jpeg_header_bomb(65000, 65000)), INVALID, "--max-image-pixels"),
        (img_msg(raw=(bytes(10 * 10 * 3 - 1), 10, 10)), INVALID, "height x width x 3"),
        (img_msg(raw=(bytes(300), 0, 100)), INVALID, "positive height and width"),
        (img_msg(raw=(b"", 60000, 60000)), INVALID, "--max-image-pixels"),
        (img_msg(good, image_id="dup"), grpc.StatusCode.OK, ""),
        (img_msg(good, image_id="dup"), INVALID, "duplicate image id 'dup'"),
        (img_msg(good), grpc.StatusCode.OK, ""),                    # empty ids may repeat
        (img_msg(good), grpc.StatusCode.OK, ""),
        (img_msg(raw=(rand_image(40, 50).tobytes(), 40, 50)), grpc.StatusCode.OK, ""),
    ]
    ans = extract_raw(server.address, [spec_msg()] + [c[0] for c in cases])
    assert ans.code == grpc.StatusCode.OK, ans.details
    assert len(ans.images) == len(cases)
    for i, (_, code, words) in enumerate(cases):
        got, msg = ans.image(i)
        assert got == code, (i, got, msg)
        assert words in msg, (i, msg)
    # Only the OK images carried tensors (one layer each, one chunk each).
    assert ans.tensors == sum(1 for c in cases if c[1] == grpc.StatusCode.OK)


def test_sdk_reports_per_image_errors_as_typed_results(client):
    good = encode(rand_image(48, 48, 5), "JPEG")
    results = list(client.extract_many([good, b"", b"garbage!", good], "conv1",
                                       reduction="avg"))
    assert [r.ok for r in results] == [True, False, False, True]
    assert isinstance(results[1].error, hookserve.errors.InvalidArgument)
    assert results[1].error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "empty" in results[1].error.message
    assert results[0].features["conv1"].shape == (64,)


def test_pixel_limit_is_the_configured_one(limited):
    ans = extract_raw(limited.address, [
        spec_msg(pre=pb.Preprocessing(mode=pb.Preprocessing.MODE_NATIVE)),
        img_msg(encode(rand_image(200, 200), "PNG")),               # exactly the limit
        img_msg(encode(rand_image(201, 200), "PNG")),
        img_msg(raw=(bytes(201 * 200 * 3), 201, 200)),
    ])
    assert ans.code == grpc.StatusCode.OK
    assert ans.image(0)[0] == grpc.StatusCode.OK
    for i in (1, 2):
        code, msg = ans.image(i)
        assert code == INVALID and "limit of 40,000 pixels" in msg and "--max-image-pixels" in msg


def test_response_over_limit_for_one_image_fails_that_image(limited):
    # Native size: the answer's size is known only once the image is decoded.
    # conv1 of resnet18 at HxW: 64 x H/2 x W/2 float32.
    small = rand_image(32, 32)      # 64*16*16*4 = 65 kB
    big = rand_image(128, 128)      # 64*64*64*4 = 1.05 MB > 1 MB
    ans = extract_raw(limited.address, [
        spec_msg(layer("conv1", pb.REDUCTION_NONE),
                 pre=pb.Preprocessing(mode=pb.Preprocessing.MODE_NATIVE)),
        img_msg(encode(small)), img_msg(encode(big)), img_msg(encode(small)),
    ])
    assert ans.code == grpc.StatusCode.OK
    assert [ans.image(i)[0] for i in range(3)] == [
        grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OK]
    assert "--max-response-bytes" in ans.image(1)[1]


# -- call-level errors: they end the call, after earlier images were answered ---------


@pytest.mark.parametrize("bad_spec, code, words", [
    (spec_msg(model="resnet9000"), grpc.StatusCode.NOT_FOUND, "unknown model 'resnet9000'"),
    (spec_msg(layer("layer4.1.con2")), INVALID, "closest valid layers: layer4.1.conv2"),
    (spec_msg(layer("features.0")), INVALID, "unknown layer 'features.0' for model resnet18"),
    (pb.ExtractRequest(spec=pb.ExtractionSpec()), INVALID, "no layers requested"),
    (spec_msg(layer("conv1"), layer("conv1")), INVALID, "'conv1' is requested twice"),
    (spec_msg(layer("conv1", reduction=99)), INVALID, "invalid reduction"),
    (spec_msg(layer("conv1", dtype=42)), INVALID, "invalid dtype"),
    (spec_msg(*[layer(f"x{i}") for i in range(300)]), INVALID, "over the limit of 256"),
    (spec_msg(pre=pb.Preprocessing(mode=17)), INVALID, "unknown preprocessing mode"),
    (spec_msg(pre=pb.Preprocessing(mode=pb.Preprocessing.MODE_NATIVE, resize=100)),
     INVALID, "takes no resize or crop"),
    (spec_msg(pre=pb.Preprocessing(mode=pb.Preprocessing.MODE_RESIZE_CROP, crop_height=10)),
     INVALID, "must be set together"),
    (spec_msg(pre=pb.Preprocessing(mode=pb.Preprocessing.MODE_RESIZE_CROP)),
     INVALID, "needs a resize or a crop"),
    (spec_msg(pre=pb.Preprocessing(mode=pb.Preprocessing.MODE_RESIZE_CROP, resize=2**32 - 1)),
     INVALID, "over the limit of 8192"),
    (spec_msg(layer("classifier.0"), model="vgg11", pre=pb.Preprocessing(
        mode=pb.Preprocessing.MODE_RESIZE_CROP, crop_height=8, crop_width=8)),
     INVALID, "layer classifier.0 cannot be computed: at input 8x8"),
], ids=["unknown-model", "layer-typo", "other-models-layer", "empty-layers",
        "duplicate-layer", "bad-reduction", "bad-dtype", "too-many-layers", "bad-mode",
        "native-with-resize", "half-crop", "resize-crop-without-either", "huge-resize",
        "crop-too-small"])
def test_bad_spec_ends_the_call_after_earlier_images(server, bad_spec, code, words):
    good = encode(rand_image(48, 48, 7), "PNG")
    ans = extract_raw(server.address, [spec_msg(), img_msg(good, "a"), img_msg(good, "b"),
                                       bad_spec, img_msg(good, "c")])
    assert ans.code == code, ans.details
    assert words in ans.details
    # Both images before the bad spec were answered; the one after was not taken.
    assert [(i, d, c) for i, d, c, _ in ans.images] == [
        (0, "a", grpc.StatusCode.OK), (1, "b", grpc.StatusCode.OK)]


def test_image_before_spec(server):
    ans = extract_raw(server.address, [img_msg(encode(rand_image()))])
    assert ans.code == INVALID and "send a spec first" in ans.details
    assert ans.images == []


def test_sdk_raises_typed_call_errors(client):
    img = rand_image(32, 32)
    with pytest.raises(hookserve.errors.NotFound) as e:
        client.extract(img, "conv1", model="nope")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "resnet18, vgg11" in e.value.message
    with pytest.raises(hookserve.errors.InvalidArgument) as e:
        client.extract(img, "layer3.0.conv", model="resnet18")
    assert "layer3.0.conv1" in e.value.message
    with pytest.raises(ValueError):  # refused locally before anything is sent
        client.extract(img, [])


def test_response_estimate_over_limit_fails_before_compute(server):
    # A fixed input size (default or crop) lets the server check the spec itself:
    # vgg11 features.0 at 8192x8192 is 64*8192*8192*4 B = 17 GB per image.
    huge = pb.Preprocessing(mode=pb.Preprocessing.MODE_RESIZE_CROP, resize=8192,
                            crop_height=8192, crop_width=8192)
    before = server.engine.queued
    ans = extract_raw(server.address, [
        spec_msg(layer("features.0", pb.REDUCTION_NONE), model="vgg11", pre=huge),
        img_msg(encode(rand_image(32, 32)))])
    assert ans.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-response-bytes" in ans.details and "17179.9 MB" in ans.details
    assert ans.images == []          # the image after the spec was never taken
    assert server.engine.queued == before


def test_response_limit_is_checked_against_the_reduced_answer(limited):
    # The same layer fits once reduced (avg pool: 64 floats), so the limit is on what
    # is sent, not on what is computed.
    ans = extract_raw(limited.address, [
        spec_msg(layer("conv1", pb.REDUCTION_NONE)),   # 64*112*112*4 = 3.2 MB at 224
        img_msg(encode(rand_image(64, 64)))])
    assert ans.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "3.2 MB" in ans.details
    ans = extract_raw(limited.address, [
        spec_msg(layer("conv1", pb.REDUCTION_AVG_POOL)), img_msg(encode(rand_image(64, 64)))])
    assert ans.code == grpc.StatusCode.OK and ans.image(0)[0] == grpc.StatusCode.OK


def test_oversized_request_message_is_refused(limited):
    big = bytes(np.random.default_rng(1).integers(0, 256, (1 << 20) + 100, dtype=np.uint8))
    ans = extract_raw(limited.address, [spec_msg(), img_msg(encode(rand_image(32, 32))),
                                        img_msg(big)])
    assert ans.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # gRPC's own refusal names the message's size and the limit (--max-message-bytes).
    m = re.search(r"larger than max \((\d+) vs\. (\d+)\)", ans.details)
    assert m, ans.details
    assert int(m[2]) == 1 << 20 and int(m[1]) > len(big), ans.details
    # The server is fine afterwards.
    with limited.client(timeout=30) as c:
        assert c.extract(rand_image(32, 32), "conv1", reduction="avg")["conv1"].shape == (64,)


def test_describe_model_bad_arguments(server, client):
    with pytest.raises(hookserve.errors.NotFound):
        client.describe("alexnet")
    with pytest.raises(ValueError, match="size must be positive"):   # refused by the SDK
        client.describe("resnet18", (224, 0))
    with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.FeatureExtractorStub(ch).DescribeModel(pb.DescribeModelRequest(
            model="resnet18", input_height=224, input_width=0), timeout=30)
    assert e.value.code() == INVALID and "both" in e.value.details()
    with pytest.raises(hookserve.errors.InvalidArgument, match="over the limit"):
        client.describe("resnet18", (100000, 100000))
    short = client.describe("vgg11", (8, 8))   # the layers that can run at 8x8
    assert short.layers[-1].name == "features.14" and short.gradient_bytes_per_image == 0


def test_huge_names_get_a_short_message(server):
    # A 200 kB model or layer name must not come back whole in the status (gRPC's
    # metadata limit would turn the answer into a transport error).
    name = "x" * 200_000
    emoji = "\U0001F600" * 50_000      # 12 bytes each once percent-encoded in a trailer
    for bad in (spec_msg(model=name), spec_msg(layer(name)), spec_msg(model=emoji),
                spec_msg(layer(emoji))):
        ans = extract_raw(server.address, [bad])
        assert ans.code in (grpc.StatusCode.NOT_FOUND, INVALID), (ans.code, ans.details[:200])
        assert len(ans.details) < 2000
    ans = extract_raw(server.address, [spec_msg(), img_msg(encode(rand_image(32, 32)), name),
                                       img_msg(encode(rand_image(32, 32)), name)])
    assert ans.code == grpc.StatusCode.OK
    assert ans.image(1)[0] == INVALID and len(ans.image(1)[1]) < 2000


def test_activation_memory_is_bounded_whatever_the_requested_layer(limited):
    # A tiny answer (layer4, avg pooled) but conv1/relu at 400x400 would hold
    # 64*200*200*4 = 10.2 MB for one image: refused before compute, naming the layer.
    crop400 = pb.Preprocessing(mode=pb.Preprocessing.MODE_RESIZE_CROP, resize=400,
                               crop_height=400, crop_width=400)
    ans = extract_raw(limited.address, [spec_msg(layer("layer4"), pre=crop400),
                                        img_msg(encode(rand_image(32, 32)))])
    assert ans.code == grpc.StatusCode.RESOURCE_EXHAUSTED and ans.images == []
    assert "--max-batch-bytes" in ans.details and "10.2 MB" in ans.details
    # Resize without a crop: the size follows the image, so the check is per image,
    # and the stream goes on. 32x32 -> 360x360: conv1 64*180*180*4 = 8.3 MB.
    resize = pb.Preprocessing(mode=pb.Preprocessing.MODE_RESIZE_CROP, resize=360)
    ans = extract_raw(limited.address, [
        spec_msg(layer("layer4"), pre=resize), img_msg(encode(rand_image(32, 32))),
        spec_msg(layer("layer4"), pre=pb.Preprocessing(mode=2, resize=200)),
        img_msg(encode(rand_image(32, 32)))])
    assert ans.code == grpc.StatusCode.OK
    assert [ans.image(i)[0] for i in range(2)] == [grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                   grpc.StatusCode.OK]
    assert "--max-batch-bytes" in ans.image(0)[1]


def test_duplicate_ids_are_remembered_within_a_bounded_history(server, monkeypatch):
    # Endless streams must not grow without bound: only the last ID_HISTORY ids count.
    from hookserve_server.engine import session as engine_mod

    monkeypatch.setattr(engine_mod, "ID_HISTORY", 3)
    img = rand_image(32, 32)
    ids = ["a", "b", "a", "c", "d", "a", "d"]
    with hookserve.Client(server.address, timeout=60) as c:
        rs = list(c.extract_many([img] * len(ids), "conv1", ids=ids, native=True))
    # "a" again at 2: within the last 3 -> duplicate. At 5, the history is b, c, d.
    assert [r.ok for r in rs] == [True, True, False, True, True, True, False]
    assert "duplicate image id 'a'" in rs[2].error.message


def test_overlong_id_fails_that_image_alone_and_is_not_echoed(server):
    img = rand_image(32, 32)
    ids = ["ok-1", "x" * 100_000, "ok-2"]
    stub = pb_grpc.FeatureExtractorStub(grpc.insecure_channel(server.address))
    spec = pb.ExtractionSpec(layers=[pb.LayerRequest(name="conv1")],
                             preprocessing=pb.Preprocessing(mode=pb.Preprocessing.MODE_NATIVE))
    reqs = [pb.ExtractRequest(spec=spec)] + [pb.ExtractRequest(image=pb.Image(
        id=i, raw=pb.RawImage(pixels=img.tobytes(), height=32, width=32))) for i in ids]
    statuses = [(m.image_index, m.image_id, m.status) for m in stub.Extract(iter(reqs),
                                                                            timeout=60)
                if m.WhichOneof("payload") == "status"]
    assert [(i, d, st.code) for i, d, st in statuses] == [
        (0, "ok-1", 0), (1, "", grpc.StatusCode.INVALID_ARGUMENT.value[0]), (2, "ok-2", 0)]
    assert "over the limit of 1024" in statuses[1][2].message


def test_overlong_layer_name_is_refused_without_searching_for_close_names(client):
    with pytest.raises(hookserve.InvalidArgument, match="over the limit of 256"):
        client.extract(rand_image(32, 32), ["layer1" * 100_000])


@pytest.mark.parametrize("method", ["ListModels", "DescribeModel"])
def test_undecodable_unary_request_is_invalid_argument(server, method):
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_unary(f"/hookserve.v1.FeatureExtractor/{method}",
                              request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff\xff garbage", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid hookserve.v1." in e.value.details()
