"""ExtractImage: the one-image RPC (one request, the image's tensors back, the call's
status as the image's). Real servers on 127.0.0.1:0, over the wire.

It must give exactly what an Extract stream gives for the same spec and image, end
every kind of bad input with the right code before any tensor, count against
--max-streams, honour deadlines, cancels and auth, and leave the engine idle.
`Client.extract` uses it; against a server without it, the SDK falls back to Extract.
"""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest

import hookserve
from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc

from conftest import encode, rand_image
from helpers import METRICS, R18, in_threads, small_server, wait_until

AVG = {"reduction": "avg"}


def raw_request(image: pb.Image | None = None, layers=(("layer4", pb.REDUCTION_AVG_POOL),),
                model: str = "", pre: pb.Preprocessing | None = None) -> pb.ExtractImageRequest:
    spec = pb.ExtractionSpec(model=model, layers=[pb.LayerRequest(name=n, reduction=r)
                                                  for n, r in layers])
    if pre is not None:
        spec.preprocessing.CopyFrom(pre)
    req = pb.ExtractImageRequest(spec=spec)
    if image is not None:
        req.image.CopyFrom(image)
    return req


def png_image(h=48, w=56, seed=0, image_id="") -> pb.Image:
    return pb.Image(id=image_id, encoded=encode(rand_image(h, w, seed)))


def call_raw(address: str, request, timeout: float = 60.0, metadata=()):
    """The raw RPC on a plain channel: (messages, code, details)."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.FeatureExtractorStub(ch)
        got = []
        try:
            for m in stub.ExtractImage(request, timeout=timeout, metadata=metadata):
                got.append(m)
        except grpc.RpcError as exc:
            return got, exc.code(), exc.details()
        return got, grpc.StatusCode.OK, ""


# -- the same answer as Extract ----------------------------------------------------------

CASES = [
    ("resnet18", {"layer4": AVG}, {}),
    ("resnet18", {"layer1": {"reduction": "max"}, "layer3": {"reduction": "none"}}, {}),
    ("resnet18", {"layer2:input": {"reduction": "flatten"}}, {"native": True}),
    ("resnet18", {"fc": {"dtype": "float16"}, "avgpool": {"dtype": "bfloat16"}}, {}),
    ("resnet18", {"layer3": {"reduction": "stats"}}, {"resize": 96, "crop": 80}),
    ("resnet18", {"layer4": {"reduction": "avg", "l2_normalize": True}}, {}),
    ("vgg11", {"features.3": AVG, "classifier.0": {}}, {}),
]


@pytest.mark.parametrize("model,layers,options", CASES)
@pytest.mark.parametrize("form", ["png", "array"])
def test_same_answer_as_an_extract_stream(client, model, layers, options, form):
    img = rand_image(70, 90, seed=3)
    src = encode(img) if form == "png" else img
    one = client.extract(src, layers, model=model, **options)
    (streamed,) = client.extract_many([src], layers, model=model, **options)
    assert set(one) == set(layers) == set(streamed.features)
    for name in layers:
        assert one[name].dtype == streamed.features[name].dtype
        assert one[name].shape == streamed.features[name].shape
        np.testing.assert_array_equal(one[name], streamed.features[name])


def test_big_answer_comes_in_chunks_with_no_status_message(make_server):
    s = make_server(*small_server(models=("vgg11",)), "--chunk-bytes", str(1 << 20))
    req = raw_request(png_image(image_id="cat"), layers=(("features.0", pb.REDUCTION_NONE),))
    msgs, code, _ = call_raw(s.address, req)
    assert code == grpc.StatusCode.OK
    kinds = {m.WhichOneof("payload") for m in msgs}
    assert kinds == {"tensor"}, kinds          # the call's status is the image's
    total = 64 * 224 * 224 * 4
    assert len(msgs) == -(-total // (1 << 20))
    assert [m.tensor.offset for m in msgs] == list(range(0, total, 1 << 20))
    assert all(m.image_id == "cat" and m.image_index == 0 for m in msgs)
    with s.client(timeout=60) as c:
        one = c.extract(req.image.encoded, ["features.0"])["features.0"]
        (ref,) = c.extract_many([req.image.encoded], ["features.0"])
    assert one.shape == (64, 224, 224)
    np.testing.assert_array_equal(one, ref.features["features.0"])


# -- every kind of bad input: the right code, nothing sent, the server goes on -----------

BAD = [
    ("no spec", pb.ExtractImageRequest(image=png_image()), grpc.StatusCode.INVALID_ARGUMENT,
     "spec is not set"),
    ("no image", raw_request(None), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    ("corrupt bytes", raw_request(pb.Image(encoded=b"\xff\xd8\xff garbage")),
     grpc.StatusCode.INVALID_ARGUMENT, "start as a JPEG but its header could not be read"),
    ("truncated png", raw_request(pb.Image(encoded=encode(rand_image(40, 40))[:120])),
     grpc.StatusCode.INVALID_ARGUMENT, ""),
    ("raw size mismatch", raw_request(pb.Image(raw=pb.RawImage(pixels=b"\0" * 10, height=4,
                                                               width=4))),
     grpc.StatusCode.INVALID_ARGUMENT, "48"),
    ("unknown layer", raw_request(png_image(), layers=(("layer9", 0),)),
     grpc.StatusCode.INVALID_ARGUMENT, "unknown layer 'layer9'"),
    ("no layers", raw_request(png_image(), layers=()), grpc.StatusCode.INVALID_ARGUMENT,
     "no layers requested"),
    ("unknown model", raw_request(png_image(), model="resnet999"), grpc.StatusCode.NOT_FOUND,
     "unknown model"),
    ("bad reduction", raw_request(png_image(), layers=(("layer4", 77),)),
     grpc.StatusCode.INVALID_ARGUMENT, "invalid reduction"),
    ("over-long id", raw_request(png_image(image_id="x" * 5000)),
     grpc.StatusCode.INVALID_ARGUMENT, "image id is 5000 characters"),
    ("resize over the side limit", raw_request(
        png_image(), pre=pb.Preprocessing(mode=pb.Preprocessing.MODE_RESIZE_CROP, resize=60_000,
                                          crop_height=224, crop_width=224)),
     grpc.StatusCode.INVALID_ARGUMENT, "--max-input-side"),
]


@pytest.mark.parametrize("case,request_,code,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_ends_the_call_with_its_code_and_nothing_sent(server, case, request_,
                                                                code, words):
    msgs, got, details = call_raw(server.address, request_)
    assert got == code, (got, details)
    assert msgs == []
    assert words in details, details
    # The server goes on: the next call is answered.
    msgs, got, _ = call_raw(server.address, raw_request(png_image(seed=1)))
    assert got == grpc.StatusCode.OK and msgs[0].tensor.shape == [512]


def test_unparsable_request_bytes_are_invalid_argument(server):
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_stream("/hookserve.v1.FeatureExtractor/ExtractImage",
                               request_serializer=lambda b: b,
                               response_deserializer=pb.ExtractResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(call(b"\x0a\xff\xff\xff", timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ExtractImageRequest" in e.value.details()


def test_sdk_raises_the_typed_error(client):
    with pytest.raises(hookserve.errors.InvalidArgument, match="not a recognised image"):
        client.extract(b"not an image", "layer4", reduction="avg")
    with pytest.raises(hookserve.errors.NotFound):
        client.extract(rand_image(), "layer4", model="nope")
    with pytest.raises(hookserve.errors.InvalidArgument, match="could not read image"):
        client.extract("/no/such/file.jpg", "layer4")


def test_pixel_limit_and_answer_budget(make_server):
    s = make_server(*R18, *METRICS, "--max-image-pixels", "4000", "--max-stream-buffer-bytes",
                    str(1 << 20))
    msgs, code, details = call_raw(s.address, raw_request(png_image(80, 80)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-image-pixels" in details
    # layer1 unreduced at 224: 64*56*56*4 = 802816 bytes fits; conv1's 3.2 MB does not.
    msgs, code, details = call_raw(s.address, raw_request(
        png_image(40, 40), layers=(("conv1", pb.REDUCTION_NONE),)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and msgs == []
    assert "--max-stream-buffer-bytes" in details
    msgs, code, _ = call_raw(s.address, raw_request(
        png_image(40, 40), layers=(("layer1", pb.REDUCTION_NONE),)))
    assert code == grpc.StatusCode.OK
    assert sum(len(m.tensor.data) for m in msgs) == 64 * 56 * 56 * 4
    wait_until(lambda: s.engine.budget.reserved == 0, what="the budget to empty")


# -- deadlines, cancels, the stream cap, drain, auth --------------------------------------

def test_deadline_is_deadline_exceeded_and_the_server_goes_on(server):
    # A 1 ms deadline cannot cover a resnet18 forward pass on this CPU.
    msgs, code, _ = call_raw(server.address, raw_request(png_image()), timeout=0.001)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and msgs == []
    wait_until(lambda: server.engine.queued == 0, what="the queue to drain")
    msgs, code, _ = call_raw(server.address, raw_request(png_image()))
    assert code == grpc.StatusCode.OK


def test_calls_count_against_max_streams_and_cancel_frees_them(make_server, caplog):
    s = make_server(*small_server(models=("vgg11",)), "--max-streams", "2")
    # 12.8 MB answers that nobody reads: the handlers block in flow control.
    big = raw_request(png_image(), layers=(("features.0", pb.REDUCTION_NONE),))
    channels = [grpc.insecure_channel(s.address) for _ in range(2)]
    held = [pb_grpc.FeatureExtractorStub(ch).ExtractImage(big, timeout=60) for ch in channels]
    try:
        wait_until(lambda: s.server.stream_caps.work_streams == 2, what="two held calls")
        with s.client(timeout=10, retries=0) as c:
            with pytest.raises(hookserve.errors.ResourceExhausted) as e:
                c.extract(rand_image(32, 32), "features.3", reduction="avg")
            assert "--max-streams" in e.value.message and e.value.retry_after_s == 1.0
            assert c.health() == "SERVING"
        with caplog.at_level(logging.ERROR, logger="hookserve"):
            for call in held:
                call.cancel()
            wait_until(lambda: s.server.stream_caps.work_streams == 0, what="cancels to end")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        for ch in channels:
            ch.close()
    wait_until(lambda: s.engine.budget.reserved == 0 and s.engine.queued == 0,
               what="the cancelled calls' reservations to go")
    with s.client(timeout=60) as c:
        assert c.extract(rand_image(32, 32), "features.3", reduction="avg")[
            "features.3"].shape == (128,)


def test_side_stream_caps_do_not_apply(make_server):
    """ExtractImage is work, like Extract: neither --max-side-streams (meant for health
    Watch and reflection) nor their idle timeout applies to it."""
    from hookserve_server.stream_caps import SIDE_STREAMS, WORK_STREAMS

    method = "/hookserve.v1.FeatureExtractor/ExtractImage"
    assert method in WORK_STREAMS and method not in SIDE_STREAMS
    s = make_server(*small_server(models=("vgg11",)),
                    "--max-streams", "8", "--max-side-streams", "1",
                    "--stream-idle-seconds", "1")
    big = raw_request(png_image(), layers=(("features.0", pb.REDUCTION_NONE),))
    channels = [grpc.insecure_channel(s.address) for _ in range(3)]
    held = [pb_grpc.FeatureExtractorStub(ch).ExtractImage(big, timeout=60) for ch in channels]
    try:
        wait_until(lambda: s.server.stream_caps.work_streams == 3, what="three held calls")
        # Each is then read to its end: none was refused or cut for idling.
        for call in held:
            assert sum(len(m.tensor.data) for m in call) == 64 * 224 * 224 * 4
    finally:
        for ch in channels:
            ch.close()


def test_drain_refuses_new_calls_and_the_sdk_moves_to_another_address(make_server):
    a, b = make_server(*R18, *METRICS), make_server(*R18, *METRICS)
    a.server.stream_caps.start_drain(a.server.engine.start_drain)
    msgs, code, details = call_raw(a.address, raw_request(png_image()))
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
    with hookserve.Client([a.address, b.address], timeout=60) as c:
        for _ in range(4):  # round-robin would hit the draining one at least once
            assert c.extract(rand_image(), "layer4", reduction="avg")["layer4"].shape == (512,)


def test_token_is_required(make_server, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    s = make_server(*R18, *METRICS, "--auth-token-file", str(token))
    msgs, code, _ = call_raw(s.address, raw_request(png_image()))
    assert code == grpc.StatusCode.UNAUTHENTICATED and msgs == []
    msgs, code, _ = call_raw(s.address, raw_request(png_image()),
                             metadata=(("authorization", "Bearer s3cret"),))
    assert code == grpc.StatusCode.OK


def test_concurrent_calls_each_get_their_own_answer(server, client):
    imgs = [rand_image(50, 60, seed=i) for i in range(12)]
    refs = [r.features["layer3"] for r in client.extract_many(imgs, {"layer3": AVG})]
    got: dict[int, np.ndarray] = {}

    def one(i):
        with server.client(timeout=120) as c:
            got[i] = c.extract(imgs[i], {"layer3": AVG})["layer3"]

    in_threads(one, range(12))
    for i in range(12):  # batched with others or not: within batching's float noise
        np.testing.assert_allclose(got[i], refs[i], rtol=1e-4, atol=1e-5)
    wait_until(lambda: server.engine.queued == 0 and server.engine.hook_count() == 0,
               what="the engine to be idle")


# -- an older server without the RPC ------------------------------------------------------

def test_sdk_falls_back_to_extract_on_a_server_without_it(server):
    """A real gRPC server that serves only Extract (as a server from before ExtractImage
    did), forwarding to the shared server over the wire."""
    from concurrent import futures

    upstream = grpc.insecure_channel(server.address)
    forward = pb_grpc.FeatureExtractorStub(upstream).Extract
    old = grpc.server(futures.ThreadPoolExecutor(4))
    old.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "hookserve.v1.FeatureExtractor",
        {"Extract": grpc.stream_stream_rpc_method_handler(
            lambda it, ctx: forward(it, timeout=60),
            request_deserializer=pb.ExtractRequest.FromString,
            response_serializer=pb.ExtractResponse.SerializeToString)}),))
    port = old.add_insecure_port("127.0.0.1:0")
    old.start()
    try:
        with hookserve.Client(f"127.0.0.1:{port}", timeout=60) as c:
            img = rand_image()
            a = c.extract(img, "layer4", reduction="avg")["layer4"]
            assert c._image_rpc is False  # it asked once, then remembered
            b = c.extract(img, "layer4", reduction="avg")["layer4"]
        with server.client(timeout=60) as c:
            ref = c.extract(img, "layer4", reduction="avg")["layer4"]
        np.testing.assert_array_equal(a, ref)
        np.testing.assert_array_equal(b, ref)
    finally:
        old.stop(0)
        upstream.close()


def test_calls_are_logged_and_counted_by_method(make_server, caplog):
    s = make_server(*R18, *METRICS)
    with caplog.at_level(logging.INFO, logger="hookserve.calls"):
        with s.client(timeout=60) as c:
            c.extract(rand_image(), "layer4", reduction="avg")
            with pytest.raises(hookserve.errors.InvalidArgument):
                c.extract(b"junk", "layer4")
    lines = [r.getMessage() for r in caplog.records if '"ExtractImage"' in r.getMessage()]
    assert len(lines) == 2
    assert '"code": "OK"' in lines[0] and '"images": 1' in lines[0]
    assert '"code": "INVALID_ARGUMENT"' in lines[1] and '"failed": 1' in lines[1]
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics").read().decode()
    assert 'method="ExtractImage"' in text
