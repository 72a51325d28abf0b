"""End-to-end extraction over the wire, checked against torchvision's own extractor.

The oracle is `torchvision.models.feature_extraction.create_feature_extractor` on a
model with the same weights, fed the same preprocessed input (built with
torchvision's ImageClassification preset, independent of the server's code).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms._presets import ImageClassification

import hookserve
from hookserve.v1 import hookserve_pb2 as pb
from hookserve.v1 import hookserve_pb2_grpc as pb_grpc
from hookserve_server.models import build_model

from conftest import encode, rand_image
from helpers import feature_extractor, in_threads

# CPU convolutions may pick different kernels for different batch sizes.
TOL = {"rtol": 1e-4, "atol": 1e-4}


def oracle_model(arch: str, seed: int = 0, *, inplace: bool = False):
    """The served architecture with the same seeded weights.

    In-place activations are switched off: with ReLU(inplace=True), torchvision's
    extractor returns the *activated* values for a layer followed by that ReLU
    whenever a later layer is also requested (the ReLU overwrites the captured
    tensor). hookserve returns each layer's own output; see the test below.
    """
    model, _ = build_model(arch, "random", seed)
    if not inplace:
        for m in model.modules():
            if hasattr(m, "inplace"):
                m.inplace = False
    return model.eval()


def oracle(arch: str, layers: list[str], x: torch.Tensor, *, inplace: bool = False
           ) -> dict[str, np.ndarray]:
    fe = feature_extractor(oracle_model(arch, inplace=inplace), layers)
    with torch.no_grad():
        out = fe(x)
    return {k: v.numpy() for k, v in out.items()}


def preset(arr: np.ndarray, resize: int = 256, crop: int = 224) -> torch.Tensor:
    """torchvision's standard preset applied to a uint8 HxWx3 array -> 1x3xHxW."""
    t = torch.from_numpy(arr.copy()).permute(2, 0, 1)
    return ImageClassification(crop_size=crop, resize_size=resize)(t)[None]


@pytest.fixture(scope="module")
def img() -> np.ndarray:
    return rand_image(180, 240, seed=1)


@pytest.mark.parametrize("arch,layers", [
    ("resnet18", ["conv1", "layer1", "layer2.0.downsample.0", "layer3.1.conv2",
                  "layer4", "avgpool", "fc"]),
    ("vgg11", ["features.0", "features.4", "features.18", "avgpool", "classifier.3"]),
])
def test_matches_torchvision_extractor(client, img, arch, layers):
    got = client.extract(encode(img), layers, model=arch)
    want = oracle(arch, layers, preset(img))
    assert list(got) == layers  # the spec's order
    for name in layers:
        assert got[name].shape == want[name].shape[1:], name
        np.testing.assert_allclose(got[name], want[name][0], **TOL, err_msg=name)


def test_repeated_module_calls_follow_torchvision_names(client, img):
    # A BasicBlock calls its one ReLU twice: torchvision names the calls relu, relu_1.
    layers = ["layer1.0.relu", "layer1.0.relu_1", "layer2.1.bn2"]
    got = client.extract(img, layers, model="resnet18")
    want = oracle("resnet18", layers, preset(img))
    for name in layers:
        np.testing.assert_allclose(got[name], want[name][0], **TOL, err_msg=name)
    # bn2's output is later modified in place (`out += identity`): we captured it first.
    assert got["layer2.1.bn2"].min() < 0


def test_inplace_relu_does_not_leak_into_conv_output(client, img):
    # vgg's features.1 is ReLU(inplace=True) over features.0's output.
    layers = ["features.0", "features.1"]
    got = client.extract(img, layers, model="vgg11")
    assert got["features.0"].min() < 0
    assert got["features.1"].min() >= 0
    # The stock model through torchvision's extractor loses the pre-ReLU values:
    stock = oracle("vgg11", layers, preset(img), inplace=True)
    assert stock["features.0"].min() >= 0
    np.testing.assert_allclose(got["features.1"], stock["features.1"][0], **TOL)


def test_reductions_dtypes_and_l2(client, img):
    x = preset(img)
    full = oracle("resnet18", ["layer3", "fc"], x)
    got = client.extract(img, {
        "layer3": {"reduction": "avg"},
        "layer2": {"reduction": "max", "dtype": "float16"},
        "layer4": {"reduction": "flatten", "dtype": "bfloat16"},
        "fc": {"l2_normalize": True},
        "layer1": {"reduction": "avg", "l2_normalize": True},
    }, model="resnet18")
    np.testing.assert_allclose(got["layer3"], full["layer3"][0].mean(axis=(1, 2)), **TOL)
    ref = oracle("resnet18", ["layer2", "layer4", "layer1"], x)
    assert got["layer2"].dtype == np.float16 and got["layer2"].shape == (128,)
    np.testing.assert_allclose(got["layer2"], ref["layer2"][0].max(axis=(1, 2)), rtol=2e-3,
                               atol=2e-3)
    l4 = got["layer4"]
    assert l4.dtype == np.uint16 and l4.shape == (512 * 7 * 7,)
    np.testing.assert_allclose(hookserve.bfloat16_to_float32(l4), ref["layer4"][0].ravel(),
                               rtol=1e-2, atol=1e-2)
    fc = full["fc"][0]
    np.testing.assert_allclose(got["fc"], fc / np.linalg.norm(fc), **TOL)
    assert np.linalg.norm(got["fc"]) == pytest.approx(1.0, abs=1e-5)
    l1 = ref["layer1"][0].mean(axis=(1, 2))
    np.testing.assert_allclose(got["layer1"], l1 / np.linalg.norm(l1), **TOL)


def test_input_forms_agree(client, img, tmp_path):
    from PIL import Image

    path = tmp_path / "img.png"
    path.write_bytes(encode(img))
    forms = [str(path), path, encode(img), img, Image.fromarray(img)]
    outs = [client.extract(f, ["layer2"], reduction="avg") for f in forms]
    for o in outs[1:]:
        np.testing.assert_array_equal(o["layer2"], outs[0]["layer2"])


def test_preprocessing_modes(client, img):
    # custom resize + crop
    got = client.extract(img, ["layer1"], resize=128, crop=(96, 112))
    want = oracle("resnet18", ["layer1"], _custom(img, 128, (96, 112)))
    np.testing.assert_allclose(got["layer1"], want["layer1"][0], **TOL)
    # native: feature maps follow the image's own size (180x240 -> /32 = 6x8)
    got = client.extract(img, ["layer4", "layer1"], native=True)
    assert got["layer4"].shape == (512, 6, 8)
    x = torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float() / 255
    x = (x - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor(
        [0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    want = oracle("resnet18", ["layer1"], x)
    np.testing.assert_allclose(got["layer1"], want["layer1"][0], **TOL)


def _custom(arr, resize, crop):
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    t = torch.from_numpy(arr.copy()).permute(2, 0, 1)
    t = F.resize(t, [resize], interpolation=InterpolationMode.BILINEAR, antialias=True)
    t = F.center_crop(t, list(crop)).float() / 255
    return F.normalize(t, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])[None]


def test_large_tensor_arrives_whole_in_chunks(server, img):
    """vgg11 features.0 at 224 px is 64x224x224 float32 = 12.8 MB: several chunks."""
    stub = pb_grpc.FeatureExtractorStub(__import__("grpc").insecure_channel(server.address))
    spec = pb.ExtractionSpec(model="vgg11", layers=[pb.LayerRequest(name="features.0")])
    h, w = img.shape[:2]
    reqs = [pb.ExtractRequest(spec=spec),
            pb.ExtractRequest(image=pb.Image(id="a", raw=pb.RawImage(
                pixels=img.tobytes(), height=h, width=w)))]
    msgs = list(stub.Extract(iter(reqs), timeout=120))
    chunks = [m.tensor for m in msgs if m.WhichOneof("payload") == "tensor"]
    assert msgs[-1].status.code == 0 and all(m.image_id == "a" for m in msgs)
    assert len(chunks) >= 4 and all(len(c.data) < 4 << 20 for c in chunks)
    assert [c.offset for c in chunks] == sorted(c.offset for c in chunks)
    data = b"".join(c.data for c in chunks)
    assert len(data) == chunks[0].total_bytes == 64 * 224 * 224 * 4
    got = np.frombuffer(data, "<f4").reshape(tuple(chunks[0].shape))
    want = oracle("vgg11", ["features.0"], preset(img))["features.0"][0]
    np.testing.assert_allclose(got, want, **TOL)
    # The SDK reassembles the same bytes, bit for bit.
    with hookserve.Client(server.address) as c:
        again = c.extract(img, ["features.0"], model="vgg11")["features.0"]
    assert again.tobytes() == data


def test_compute_stops_after_last_requested_layer(server, client, img):
    model = server.engine.models["resnet18"].module
    ran: dict[str, int] = {"layer1": 0, "layer2": 0, "fc": 0}
    handles = [getattr(model, name).register_forward_hook(
        lambda m, i, o, name=name: ran.__setitem__(name, ran[name] + 1)) for name in ran]
    try:
        client.extract(img, ["layer1.1.conv1"])
        assert ran == {"layer1": 0, "layer2": 0, "fc": 0}  # stopped inside layer1
        client.extract(img, ["layer1"])
        assert ran == {"layer1": 1, "layer2": 0, "fc": 0}
        client.extract(img, ["layer2", "conv1"])
        assert ran == {"layer1": 2, "layer2": 1, "fc": 0}
    finally:
        for h in handles:
            h.remove()
    assert server.engine.hook_count() == 0


@pytest.mark.parametrize("arch,size", [("resnet18", (224, 224)), ("resnet18", (100, 150)),
                                       ("vgg11", (64, 96))])
def test_describe_shapes_equal_real_outputs(client, arch, size):
    d = client.describe(arch, size)
    assert d.input_size == size and d.model.name == arch
    assert not d.model.pretrained and d.model.weights_source == "random"
    assert d.model.weights_digest.startswith("sha256:")
    names = [li.name for li in d.layers]
    assert len(names) == len(set(names)) and [li.order for li in d.layers] == sorted(
        li.order for li in d.layers)
    img = rand_image(*size, seed=3)
    got = client.extract(img, names, model=arch, native=True)
    for li in d.layers:
        assert got[li.name].shape == li.shape, li.name
        assert got[li.name].nbytes == li.bytes_per_image, li.name


def test_list_models(client):
    models = client.list_models()
    assert [m.name for m in models] == ["resnet18", "vgg11"]
    assert models[0].device == "cpu" and models[0].crop == (224, 224)
    assert models[0].resize == 256 and len(models[0].mean) == 3


def test_concurrent_clients_get_exactly_their_layers(server):
    imgs = [rand_image(64, 64, seed=s) for s in range(12)]
    asks = {"a": ["layer1", "fc"], "b": ["layer3.0.conv1", "avgpool"]}
    with hookserve.Client(server.address) as c:
        ref = {k: [c.extract(i, v, resize=64, crop=64) for i in imgs]
               for k, v in asks.items()}
    results: dict[str, list] = {}

    def run(key):
        with hookserve.Client(server.address) as c:
            results[key] = list(c.extract_many(imgs * 2, asks[key], resize=64, crop=64))

    in_threads(run, asks)
    for key, rs in results.items():
        assert [r.index for r in rs] == list(range(len(imgs) * 2))
        for r in rs:
            assert r.ok and list(r.features) == asks[key]
            for layer in asks[key]:
                np.testing.assert_allclose(r.features[layer],
                                           ref[key][r.index % len(imgs)][layer], **TOL)


def test_corrupt_image_mid_stream_fails_alone(client, img):
    good = encode(img, "JPEG", quality=90)
    truncated = good[: len(good) // 2]
    inputs = [good, truncated, b"not an image at all", img, b"", good]
    rs = list(client.extract_many(inputs, ["layer2"], reduction="avg",
                                  ids=[f"i{k}" for k in range(6)]))
    assert [r.id for r in rs] == [f"i{k}" for k in range(6)]
    assert [r.ok for r in rs] == [True, False, False, True, False, True]
    for r in rs[1], rs[2], rs[4]:
        assert isinstance(r.error, hookserve.InvalidArgument)
    assert "truncated" in rs[1].error.message or "corrupt" in rs[1].error.message
    assert "not a recognised image" in rs[2].error.message
    assert "empty" in rs[4].error.message
    np.testing.assert_array_equal(rs[0].features["layer2"], rs[5].features["layer2"])


def test_unknown_layer_names_closest(client, img):
    with pytest.raises(hookserve.InvalidArgument) as e:
        client.extract(img, ["layer3.1.conv3"], model="resnet18")
    assert "layer3.1.conv3" in e.value.message
    assert "layer3.1.conv1" in e.value.message and "DescribeModel" in e.value.message


def test_unknown_model_is_not_found(client, img):
    with pytest.raises(hookserve.NotFound) as e:
        client.extract(img, ["layer1"], model="resnet9000")
    assert "resnet18" in e.value.message and "vgg11" in e.value.message


def test_spec_can_be_replaced_mid_stream(server, img):
    stub = pb_grpc.FeatureExtractorStub(__import__("grpc").insecure_channel(server.address))
    raw = pb.RawImage(pixels=img.tobytes(), height=img.shape[0], width=img.shape[1])
    s1 = pb.ExtractionSpec(layers=[pb.LayerRequest(name="layer1",
                                                   reduction=pb.REDUCTION_AVG_POOL)])
    s2 = pb.ExtractionSpec(model="vgg11", layers=[pb.LayerRequest(
        name="features.3", reduction=pb.REDUCTION_MAX_POOL)])
    reqs = [pb.ExtractRequest(spec=s1), pb.ExtractRequest(image=pb.Image(id="x", raw=raw)),
            pb.ExtractRequest(spec=s2), pb.ExtractRequest(image=pb.Image(id="y", raw=raw))]
    msgs = list(stub.Extract(iter(reqs), timeout=60))
    tensors = [(m.image_id, m.image_index, m.tensor.layer, tuple(m.tensor.shape))
               for m in msgs if m.WhichOneof("payload") == "tensor"]
    assert tensors == [("x", 0, "layer1", (64,)), ("y", 1, "features.3", (128,))]


def test_engine_is_idle_after_calls(server, client, img):
    client.extract(img, ["layer1"])
    assert server.engine.hook_count() == 0
    assert server.engine.queued == 0


def _root(a: np.ndarray):
    """The object that owns an array's memory."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


def test_result_arrays_are_writable_with_one_copy_at_most(client, img):
    """Single-chunk and multi-chunk tensors, features and maps: writable in place, each
    wrapping the one buffer its chunks were copied into (no second copy)."""
    got = client.extract(img, {"layer4": {"reduction": "avg"}, "fc": None})
    big = client.extract(img, ["features.0"], model="vgg11")["features.0"]   # 12.8 MB
    amap = client.attribute(img, "layer4").map
    for a in (got["layer4"], got["fc"], big, amap):
        assert a.flags.writeable and a.flags.c_contiguous
        assert isinstance(_root(a), bytearray), type(_root(a))
    before = got["fc"].copy()
    got["fc"] -= got["fc"].mean()                    # in place, as with a torch tensor
    np.testing.assert_allclose(got["fc"], before - before.mean(), rtol=1e-6)
    big[0, 0, 0] = 42.0
    assert big[0, 0, 0] == 42.0
    amap /= max(float(amap.max()), 1e-12)
    (r,) = client.extract_many([img], ["layer1"], reduction="stats")
    r.features["layer1"][:, 0] = 0.0                 # stats arrays too
    assert not r.features["layer1"][:, 0].any()


@pytest.mark.parametrize("size,want", [
    ("480x640", (480, 640)), ("288X288", (288, 288)), ("224", (224, 224)), (224, (224, 224)),
    ((96, 128), (96, 128)), ([96, 128], (96, 128)), (np.int64(64), (64, 64)),
])
def test_sdk_takes_the_cli_size_strings(client, img, size, want):
    d = client.describe("resnet18", size)
    assert d.input_size == want
    assert d.layer("conv1").shape == (64, (want[0] + 1) // 2, (want[1] + 1) // 2)
    got = client.extract(img, ["conv1"], crop=size, resize=max(want))
    assert got["conv1"].shape == d.layer("conv1").shape
    a = client.attribute(img, "layer4", crop=size, resize=str(max(want)))
    assert a.geometry == (max(want), want)


@pytest.mark.parametrize("bad", ["480x", "x640", "big", "0x10", "-5", (1, 2, 3), 2.5, True])
def test_sdk_refuses_bad_sizes_before_calling(client, img, bad):
    with pytest.raises(ValueError, match="HxW such as '480x640'|must be positive"):
        client.describe("resnet18", bad)
    with pytest.raises(ValueError, match="crop"):
        client.extract(img, ["conv1"], crop=bad)
