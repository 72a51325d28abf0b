"""The SDK surface of Attribute: types, values, laziness and order, typed errors, the
overlay, and reduction="stats" through Client.extract.

The math itself is checked at wire level in test_attribute.py; here the oracle is the
same (its `grad_at` splits the seeded model at the layer), fed with the model input
the SDK's preprocessing options ask for (resize + centre crop, done as the server
does it: torchvision on the uint8 tensor).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as F

import hookserve
from hookserve.v1 import hookserve_pb2 as pb

from conftest import encode, rand_image
from helpers import numpy_stats
from oracles import CAM, grad_at, oracle_model

TOL = {"rtol": 1e-4, "atol": 1e-5}
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
GEOMETRY = {"resize": 64, "crop": (56, 48)}      # small, and not square


def preprocessed(arr: np.ndarray, resize: int = 64, crop=(56, 48)) -> torch.Tensor:
    t = torch.from_numpy(arr.copy()).permute(2, 0, 1)
    t = F.resize(t, [resize], interpolation=InterpolationMode.BILINEAR, antialias=True)
    t = F.center_crop(t, list(crop))
    return ((t[None].float() / 255) - MEAN) / STD


@pytest.fixture(scope="module")
def imgs() -> list[np.ndarray]:
    return [rand_image(72, 90, seed=s) for s in range(5)]


def test_attribute_returns_an_attribution_equal_to_grad_cam_by_hand(client, imgs, tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(encode(imgs[0]))
    a = client.attribute(str(path), "layer4", "grad_cam", **GEOMETRY)
    act, g, logits, c = grad_at("resnet18", "layer4", preprocessed(imgs[0]), None)
    want = CAM[pb.ATTRIBUTION_METHOD_GRAD_CAM](act, g).clamp_min(0)
    assert isinstance(a, hookserve.Attribution) and a.ok and a.error is None
    assert a.id == str(path) and a.index == 0
    assert a.map.dtype == np.float32 and a.map.shape == (2, 2) == tuple(want.shape)
    np.testing.assert_allclose(a.map, want.numpy(), **TOL)
    p = logits.softmax(0)
    assert isinstance(a.target, int) and a.target == c == int(logits.argmax())
    assert a.logit == pytest.approx(float(logits[c]), abs=1e-4)
    assert a.prob == pytest.approx(float(p[c]), rel=1e-4)
    assert (a.min, a.max) == pytest.approx((float(want.min()), float(want.max())), abs=1e-5)
    assert a.delta is None
    assert [s.index for s in a.top5] == p.topk(5).indices.tolist()
    assert all(isinstance(s, hookserve.ClassScore) for s in a.top5)
    assert [s.prob for s in a.top5] == pytest.approx(p.topk(5).values.tolist(), rel=1e-4)
    assert a.geometry == (64, (56, 48))


def test_input_space_methods_take_no_layer_by_default(client, imgs):
    x = preprocessed(imgs[1])
    a = client.attribute(imgs[1], method="gradient_x_input", target=9, **GEOMETRY)
    _, g, _, _ = grad_at("resnet18", None, x, 9)
    assert a.map.shape == (3, 56, 48) and a.target == 9
    np.testing.assert_allclose(a.map, (g * x[0]).numpy(), rtol=1e-3, atol=1e-7)
    ig = client.attribute(imgs[1][:32, :32], method="integrated_gradients", steps=4,
                          baseline="black", native=True)
    assert ig.map.shape == (3, 32, 32) and isinstance(ig.delta, float)
    top = client.attribute(imgs[1], "layer3", "hires_cam", top_k=3, normalize=True,
                           upsample=True, **GEOMETRY)
    assert top.map.shape == (3, 56, 48) and len(top.targets) == 3
    assert [t.target.index for t in top.targets] == [s.index for s in top.top5[:3]]
    assert top.map.min() >= 0 and top.map.max() <= 1 + 1e-6
    assert top.target == top.targets[0].target.index


def test_attribute_many_is_lazy_ordered_with_per_image_targets_and_errors(client, imgs):
    pulled = []
    items = [imgs[0], imgs[1], b"not an image", imgs[2], imgs[3], imgs[4]]
    targets = [3, None, 5, 700, None, 1]

    def source():
        for i, item in enumerate(items):
            pulled.append(i)
            yield item

    it = client.attribute_many(source(), "layer4", "layer_cam", targets=targets,
                               max_in_flight=2, **GEOMETRY)
    first = next(it)
    assert len(pulled) < len(items)                  # lazy: bounded read-ahead
    results = [first, *it]
    assert [r.index for r in results] == list(range(6))
    assert [r.ok for r in results] == [True, True, False, True, True, True]
    bad = results[2]
    assert isinstance(bad.error, hookserve.InvalidArgument)
    assert bad.error.code.name == "INVALID_ARGUMENT" and bad.map is None
    with pytest.raises(hookserve.InvalidArgument):
        bad.raise_for_error()
    for r, arr, t in zip(results, items, targets, strict=True):
        if not r.ok:
            continue
        alone = client.attribute(arr, "layer4", "layer_cam", target=t, **GEOMETRY)
        assert r.target == alone.target and (t is None or r.target == t)
        np.testing.assert_allclose(r.map, alone.map, **TOL)


def test_errors_are_typed(client, imgs):
    with pytest.raises(hookserve.InvalidArgument, match="1000 classes"):
        client.attribute(imgs[0], target=1000, **GEOMETRY)
    with pytest.raises(hookserve.InvalidArgument, match="layer"):  # fc is not a map
        client.attribute(imgs[0], "fc", "grad_cam", **GEOMETRY)
    with pytest.raises(hookserve.InvalidArgument, match="--max-attribution-cost"):
        client.attribute(imgs[0], method="integrated_gradients", steps=5000)
    with pytest.raises(hookserve.NotFound):
        client.attribute(imgs[0], model="resnet9000")
    with pytest.raises(ValueError, match="grad_cam"):  # cannot be encoded: never sent
        client.attribute(imgs[0], method="gradcam")
    with pytest.raises(ValueError, match="targets"):
        list(client.attribute_many(imgs[:2], targets=[1]))


def test_overlay_is_the_model_view_with_a_colour_map(client, imgs, tmp_path):
    path = tmp_path / "b.jpg"
    Image.fromarray(imgs[2]).save(path, quality=95)
    a = client.attribute(str(path))                  # default preprocessing: 256, 224
    assert a.map.shape == (7, 7) and a.geometry == (256, (224, 224))
    out = hookserve.overlay(str(path), a)
    assert out.mode == "RGB" and out.size == (224, 224)
    plain = np.asarray(hookserve.overlay(str(path), a, alpha=0.0), dtype=float)
    view = preprocessed(np.asarray(Image.open(path)), 256, (224, 224)) * STD + MEAN
    assert np.abs(plain - view[0].permute(1, 2, 0).numpy() * 255).mean() < 2.0
    assert np.abs(np.asarray(out, dtype=float) - plain).mean() > 10   # the heat shows
    native = hookserve.overlay(imgs[2], np.ones((3, 72, 90), np.float32))
    assert native.size == (90, 72)
    with pytest.raises(ValueError, match="alpha"):
        hookserve.overlay(imgs[2], a, alpha=1.5)


def test_matches_captum_layer_grad_cam_through_the_sdk(client, imgs):
    captum_attr = pytest.importorskip("captum.attr")
    model = oracle_model("resnet18")
    a = client.attribute(imgs[3], "layer3", "grad_cam", target=42, relu=False, **GEOMETRY)
    with torch.enable_grad():
        want = captum_attr.LayerGradCam(model, model.layer3).attribute(
            preprocessed(imgs[3]), target=42)
    np.testing.assert_allclose(a.map, want[0, 0].detach().numpy(), **TOL)


def test_stats_reduction_through_the_sdk(client, imgs):
    got = client.extract_many([imgs[0]], {"layer1": {"reduction": "stats"}, "fc": None,
                                          "layer2:input": {"reduction": "stats"}}, native=True)
    (r,) = list(got)
    full = client.extract(imgs[0], ["layer1", "layer2:input"], native=True)
    assert r.features["layer1"].shape == (64, 5)
    assert r.columns["layer1"] == hookserve.STATS_COLUMNS
    np.testing.assert_allclose(r.features["layer1"], numpy_stats(full["layer1"]), **TOL)
    np.testing.assert_allclose(r.features["layer2:input"],
                               numpy_stats(full["layer2:input"]), **TOL)
    assert "fc" not in r.columns
    vec = client.extract(imgs[0], "fc", reduction="stats", native=True)["fc"]
    assert vec.shape == (1, 5)


def test_overlay_heat_clips_at_a_percentile_and_picks_a_sign():
    from hookserve.overlays import diverging, heat, jet

    # One outlier among 0..98: without clipping every other value is near zero.
    m = np.arange(100, dtype=np.float32).reshape(10, 10)
    m[9, 9] = 1e6
    h = heat(m)                                 # a layer map: clip 100, min-max
    assert h[9, 9] == 1.0 and h[8, 9] == pytest.approx(89 / 1e6)
    h = heat(m, clip=90)                        # 90th percentile of 100 values: 89.1
    np.testing.assert_allclose(h.ravel()[:89], np.arange(89) / 89.1, rtol=1e-6)
    assert (h.ravel()[90:] == 1.0).all()
    # Input-space maps: per pixel, sum |x| over channels for "absolute", the signed sum
    # for the other signs. Pixels: (1,1,1) (-1,-1,-1) (2,-2,0) (0,0,0).
    x = np.array([[1, -1, 2, 0], [1, -1, -2, 0], [1, -1, 0, 0]], np.float32)[:, None, :]
    cases = {"absolute": [0.75, 0.75, 1, 0], "positive": [1, 0, 0, 0],
             "negative": [0, 1, 0, 0], "all": [1, -1, 0, 0]}
    for sign, want in cases.items():
        np.testing.assert_allclose(heat(x, clip=100, sign=sign)[0], want, atol=1e-7)
    # The input-space default is clip=99: |x| sums (0, 3, 3, 4) -> p99 = 3.97.
    np.testing.assert_allclose(heat(x)[0], [3 / 3.97, 3 / 3.97, 1, 0], rtol=1e-6)
    np.testing.assert_allclose(heat(-x, sign="negative")[0], heat(x, sign="positive")[0])
    flat = np.full((4, 4), 7.0, np.float32)
    assert not heat(flat).any() and (heat(flat, sign="all") == 1).all()   # constant maps
    assert not heat(np.zeros((4, 4), np.float32), sign="all").any()
    for bad in ({"clip": 0}, {"clip": 101}, {"sign": "both"}):
        with pytest.raises(ValueError):
            heat(x, **bad)
    # Colours: magnitudes on jet, signed values on blue - grey - red.
    assert jet(np.array([0.0, 1.0])).tolist() == [[0, 0, 128], [128, 0, 0]]
    assert diverging(np.array([-1.0, 0.0, 1.0])).tolist() == [
        [59, 76, 192], [221, 221, 221], [180, 4, 38]]
    # Signed overlays weigh each pixel by |value|: where the map is zero, the image.
    img = np.full((1, 4, 3), 100, np.uint8)
    out = np.asarray(hookserve.overlay(img, x, alpha=1.0, sign="all", clip=100))
    assert out[0].tolist() == [[180, 4, 38], [59, 76, 192], [100, 100, 100], [100, 100, 100]]
    out = np.asarray(hookserve.overlay(img, x, alpha=0.5, sign="negative", clip=100))
    assert out[0].tolist() == [[100, 100, 100], [80, 88, 146], [100, 100, 100], [100, 100, 100]]


def test_softmax_of_a_one_class_head_is_refused_and_its_logit_explained(make_server,
                                                                       tmp_path, imgs):
    """A binary classifier with one output (BCE training): the softmax of one score is
    always 1, its gradient 0, and every map blank; the logit is what to explain."""
    import torchvision

    torch.manual_seed(3)
    model = torchvision.models.resnet18(num_classes=1)
    path = tmp_path / "binary.pt"
    torch.save(model.state_dict(), path)
    s = make_server("--model", "resnet18", "--weights", str(path))
    with s.client(timeout=120) as c:
        with pytest.raises(hookserve.errors.InvalidArgument,
                           match="one class score, whose softmax is always 1.*score=logit"):
            c.attribute(imgs[0], "layer4", score="softmax", **GEOMETRY)
        a = c.attribute(imgs[0], "layer4", **GEOMETRY)
    assert np.ptp(a.map) > 0   # not blank
