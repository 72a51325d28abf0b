"""Property-based: random bytes and random specs thrown at a live server.

Whatever arrives, the server never crashes or hangs (every call has a deadline) and
always answers with a proper status: a per-image google.rpc.Status or a call status
from the documented set, never INTERNAL/UNKNOWN. The default suite runs a small,
derandomised profile; the `slow` one runs many more random examples.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc

from conftest import RunningServer, encode, rand_image
from helpers import small_server

CODE = {c.value[0]: c for c in grpc.StatusCode}
S = grpc.StatusCode
CALL_CODES = {S.OK, S.INVALID_ARGUMENT, S.NOT_FOUND, S.RESOURCE_EXHAUSTED}
IMAGE_CODES = {S.OK, S.INVALID_ARGUMENT, S.RESOURCE_EXHAUSTED}
CALL_DEADLINE = 60.0

# Small limits keep every random example cheap on a CPU (at most 256x256 model input).
FLAGS = [*small_server(models=("resnet18", "vgg11")),
         "--max-batch-delay-ms", "1", "--max-input-side", "256",
         "--max-image-pixels", "250000", "--max-response-bytes", str(8 << 20),
         "--max-message-bytes", str(1 << 20)]

LAYERS = ["conv1", "bn1", "relu", "relu_1", "layer1", "layer1.0.relu_1", "layer4.1.conv2",
          "avgpool", "fc", "features.0", "features.1", "features.20", "classifier.6",
          "classifier", "avgpool_1", "", ".", "layer9"]
SAMPLES = [encode(rand_image(24, 32, 1), "PNG"), encode(rand_image(40, 40, 2), "JPEG"),
           encode(rand_image(8, 8, 3), "GIF"), encode(rand_image(16, 16, 4), "BMP"),
           encode(rand_image(20, 12, 5), "WEBP"), encode(rand_image(9, 9, 6), "TIFF")]


@pytest.fixture(scope="module")
def fuzz_server():
    s = RunningServer(FLAGS)
    yield s
    s.stop(2.0)


enums = st.one_of(st.integers(-3, 8), st.sampled_from([2**31 - 1, -(2**31)]))
sizes = st.one_of(st.integers(0, 300), st.sampled_from([1, 7, 2**31, 2**32 - 1]))
names = st.one_of(st.sampled_from(LAYERS), st.text(max_size=30))

layer_req = st.builds(pb.LayerRequest, name=names, reduction=enums, dtype=enums,
                      l2_normalize=st.booleans())
preprocessing = st.one_of(
    st.none(),
    st.builds(pb.Preprocessing, mode=enums, resize=sizes, crop_height=sizes, crop_width=sizes),
    st.builds(pb.Preprocessing, mode=st.just(2), resize=st.integers(0, 256),
              crop_height=st.integers(0, 256), crop_width=st.integers(0, 256)),
)
wild_spec = st.builds(
    lambda model, layers, pre: pb.ExtractRequest(spec=pb.ExtractionSpec(
        model=model, layers=layers, preprocessing=pre)),
    st.one_of(st.sampled_from(["", "resnet18", "vgg11"]), st.text(max_size=12)),
    st.lists(layer_req, max_size=4), preprocessing)

VALID = {"resnet18": ["conv1", "relu_1", "layer1", "layer1.0.relu_1", "layer2.1.conv2",
                      "layer4", "avgpool", "fc"],
         "vgg11": ["features.0", "features.4", "features.20", "avgpool", "classifier.0",
                   "classifier.6"]}


@st.composite
def plausible_spec(draw):
    """Mostly valid specs (so images really run), with an occasional wild value."""
    model = draw(st.sampled_from(["", "resnet18", "vgg11"]))
    names = draw(st.lists(st.sampled_from(VALID[model or "resnet18"]), min_size=1,
                          max_size=3, unique=True))
    layers = [pb.LayerRequest(name=n,
                              reduction=draw(st.sampled_from([0, 1, 2, 3, 4] * 4 + [5, -1])),
                              dtype=draw(st.sampled_from([0, 1, 2, 3] * 4 + [4, 2**31 - 1])),
                              l2_normalize=draw(st.booleans())) for n in names]
    pre = draw(st.one_of(
        st.none(), st.just(pb.Preprocessing(mode=1)), st.just(pb.Preprocessing(mode=3)),
        st.builds(lambda r, c: pb.Preprocessing(mode=2, resize=r, crop_height=c,
                                                crop_width=c),
                  st.integers(0, 256), st.one_of(st.just(0), st.integers(16, 256)))))
    return pb.ExtractRequest(spec=pb.ExtractionSpec(model=model, layers=layers,
                                                    preprocessing=pre))


spec = st.one_of(plausible_spec(), plausible_spec(), wild_spec)


@st.composite
def encoded(draw):
    kind = draw(st.sampled_from(["random", "sample", "sample", "truncated", "flipped"]))
    if kind == "random":
        return draw(st.binary(max_size=2048))
    data = bytearray(draw(st.sampled_from(SAMPLES)))
    if kind == "truncated":
        return bytes(data[:draw(st.integers(0, len(data)))])
    if kind == "flipped":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    return bytes(data)


@st.composite
def raw(draw):
    h, w = draw(st.integers(0, 70)), draw(st.integers(0, 70))
    n = h * w * 3 if draw(st.booleans()) else draw(st.integers(0, 20000))
    return pb.RawImage(pixels=bytes(n), height=h, width=w)


image = st.one_of(
    st.builds(lambda i, d: pb.ExtractRequest(image=pb.Image(id=i, encoded=d)),
              st.text(max_size=6), encoded()),
    st.builds(lambda i, r: pb.ExtractRequest(image=pb.Image(id=i, raw=r)),
              st.text(max_size=6), raw()),
    st.builds(lambda i: pb.ExtractRequest(image=pb.Image(id=i)), st.text(max_size=6)),
    st.just(pb.ExtractRequest()),
)
spec_first = st.tuples(spec, st.lists(st.one_of(image, image, image, spec), max_size=6)).map(
    lambda t: [t[0], *t[1]])
stream = st.one_of(spec_first, spec_first, spec_first,
                   st.lists(st.one_of(image, spec), min_size=1, max_size=6))


def check_call(address: str, requests: list[pb.ExtractRequest]) -> None:
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.FeatureExtractorStub(ch)
        n_images = sum(1 for r in requests if r.WhichOneof("payload") != "spec")
        indices, tensors_for = [], 0
        try:
            for r in stub.Extract(iter(requests), timeout=CALL_DEADLINE):
                if r.WhichOneof("payload") == "status":
                    code = CODE[r.status.code]
                    assert code in IMAGE_CODES, (code, r.status.message)
                    assert code == S.OK or r.status.message
                    assert code != S.OK or tensors_for > 0
                    indices.append(r.image_index)
                    tensors_for = 0
                else:
                    tensors_for += 1
            code, details = S.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
        event(f"call {code.name}")
        event(f"images answered: {min(len(indices), 3)}{'+' if len(indices) > 3 else ''}")
        assert code in CALL_CODES, (code, details)
        assert code == S.OK or details
        assert indices == list(range(len(indices)))
        assert len(indices) <= n_images
        if code == S.OK:
            assert len(indices) == n_images


def check_server_fine(s: RunningServer) -> None:
    assert s.engine.hook_count() == 0
    with s.client(timeout=30) as c:
        assert c.health() == "SERVING"


SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck))


@settings(max_examples=30, derandomize=True, **SETTINGS)
@given(requests=stream)
def test_random_streams_get_proper_statuses(fuzz_server, requests):
    check_call(fuzz_server.address, requests)


@pytest.mark.slow
@settings(max_examples=600, **SETTINGS)
@given(requests=stream)
def test_random_streams_get_proper_statuses_long(fuzz_server, requests):
    check_call(fuzz_server.address, requests)


@settings(max_examples=40, derandomize=True, **SETTINGS)
@given(model=st.text(max_size=20), h=sizes, w=sizes)
def test_random_describe_gets_proper_statuses(fuzz_server, model, h, w):
    with grpc.insecure_channel(fuzz_server.address) as ch:
        stub = pb_grpc.FeatureExtractorStub(ch)
        try:
            stub.DescribeModel(pb.DescribeModelRequest(model=model, input_height=h,
                                                       input_width=w), timeout=CALL_DEADLINE)
        except grpc.RpcError as exc:
            assert exc.code() in (S.NOT_FOUND, S.INVALID_ARGUMENT), (exc.code(), exc.details())
            assert exc.details()


@settings(max_examples=30, derandomize=True, **SETTINGS)
@given(frames=st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_undecodable_request_messages(fuzz_server, frames):
    # Bytes that are not an ExtractRequest at all, sent through an identity serializer.
    with grpc.insecure_channel(fuzz_server.address) as ch:
        call = ch.stream_stream("/hookserve.v1.FeatureExtractor/Extract",
                                request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
        try:
            for _ in call(iter(frames), timeout=CALL_DEADLINE):
                pass
            code = S.OK
        except grpc.RpcError as exc:
            code = exc.code()
    # Random bytes can happen to parse as a valid (e.g. empty) message; those that do
    # not end the call with INVALID_ARGUMENT from the servicer, not grpc's INTERNAL.
    assert code in CALL_CODES, code


def test_server_is_fine_after_fuzzing(fuzz_server):
    check_server_fine(fuzz_server)
    assert fuzz_server.engine.queued == 0
    # Every fuzzed call really ended: a call left half-finished inside grpc would make
    # the drain (and so SIGTERM) hang forever.
    stopper = threading.Thread(target=fuzz_server.stop, args=(2.0,))
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive(), "server.stop() hung after fuzzing"
