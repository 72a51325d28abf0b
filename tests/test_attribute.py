"""Attribute over the wire (raw stubs), checked against the definitions computed with
torch on a model with the same seeded weights (tests/oracles.py). Images are small and
sent raw in MODE_NATIVE, so the model input is the normalised pixels.
"""

from __future__ import annotations

import gc

import grpc
import numpy as np
import pytest
import torch

from hookserve.v1 import hookserve_pb2 as pb

from conftest import rand_image
from helpers import NATIVE, R18, attribute, call_error, ok
from oracles import CAM, grad_at, model_input, oracle_model

TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module")
def imgs() -> list[np.ndarray]:
    return [rand_image(64, 64, seed=s) for s in range(3)]


# -- the CAM methods equal their definitions ----------------------------------------
@pytest.mark.parametrize("arch,layer", [("resnet18", "layer4"), ("resnet18", "layer3"),
                                        ("vgg11", "features.19"), ("vgg11", "features.18")])
@pytest.mark.parametrize("method", list(CAM))
def test_cam_equals_definition(server, imgs, arch, layer, method):
    # resnet layer4 and vgg features.19 (a ReLU(inplace=True)) and features.18 (the
    # conv an in-place ReLU overwrites) are where module backward hooks break.
    spec = pb.AttributionSpec(model=arch, layer=layer, method=method, preprocessing=NATIVE)
    got = attribute(server, spec, imgs[:2], [None, 3])
    for a, arr, t in zip(got, imgs[:2], [None, 3], strict=True):
        ok(a)
        act, g, logits, c = grad_at(arch, layer, model_input(arr), t)
        want = CAM[method](act, g).clamp_min(0)          # ReLU is on by default
        assert a["layer"] == layer and a["map"].shape == tuple(want.shape)
        np.testing.assert_allclose(a["map"], want.numpy(), **TOL)
        (tgt,) = a["summary"].targets
        assert tgt.target.class_index == c
        assert tgt.target.logit == pytest.approx(float(logits[c]), abs=1e-4)
        assert tgt.map_max == pytest.approx(float(want.max()), rel=1e-4, abs=1e-6)
        assert not tgt.HasField("completeness_delta")


@pytest.mark.parametrize("method", [pb.ATTRIBUTION_METHOD_GRADIENT,
                                    pb.ATTRIBUTION_METHOD_GRADIENT_X_INPUT])
def test_input_gradients_equal_definition(server, imgs, method):
    spec = pb.AttributionSpec(method=method, preprocessing=NATIVE,
                              score=pb.ATTRIBUTION_SCORE_SOFTMAX)
    got = attribute(server, spec, imgs[:2], [7, None])
    for a, arr, t in zip(got, imgs[:2], [7, None], strict=True):
        x = model_input(arr)
        _, g, logits, c = grad_at("resnet18", None, x, t, softmax=True)
        want = g if method == pb.ATTRIBUTION_METHOD_GRADIENT else g * x[0]
        assert ok(a)["layer"] == "" and a["map"].shape == (3, 64, 64)
        np.testing.assert_allclose(a["map"], want.numpy(), rtol=1e-3, atol=1e-7)
        assert a["summary"].targets[0].target.class_index == c
        assert a["summary"].targets[0].target.probability == pytest.approx(
            float(logits.softmax(0)[c]), rel=1e-4)


def test_summary_and_postprocessing(server, imgs):
    spec = pb.AttributionSpec(layer="layer3", method=pb.ATTRIBUTION_METHOD_HIRES_CAM,
                              preprocessing=NATIVE, relu=False)
    (raw,) = attribute(server, spec, imgs[:1], [9])
    spec.normalize, spec.upsample = True, True
    (post,) = attribute(server, spec, imgs[:1], [9])
    m = ok(raw)["map"]
    t = raw["summary"].targets[0]
    act, g, _, _ = grad_at("resnet18", "layer3", model_input(imgs[0]), 9)
    want = CAM[pb.ATTRIBUTION_METHOD_HIRES_CAM](act, g)      # ReLU off: negatives stay
    assert want.min() < 0
    np.testing.assert_allclose(m, want.numpy(), **TOL)
    assert (t.map_min, t.map_max) == pytest.approx((m.min(), m.max()), rel=1e-5)
    assert ok(post)["map"].shape == (64, 64)
    assert post["map"].min() >= 0 and post["map"].max() <= 1 + 1e-6
    want = torch.nn.functional.interpolate(
        torch.from_numpy((m - m.min()) / (m.max() - m.min()))[None, None], size=(64, 64),
        mode="bilinear", align_corners=False)[0, 0]
    np.testing.assert_allclose(post["map"], want.numpy(), atol=1e-5)
    top5 = raw["summary"].top5
    _, _, logits, _ = grad_at("resnet18", None, model_input(imgs[0]), None)
    p = logits.softmax(0)
    assert [c.class_index for c in top5] == p.topk(5).indices.tolist()
    assert [c.probability for c in top5] == pytest.approx(p.topk(5).values.tolist(), rel=1e-4)


def test_top_k_stacks_one_map_per_class(server, imgs):
    spec = pb.AttributionSpec(layer="layer4", method=pb.ATTRIBUTION_METHOD_HIRES_CAM,
                              preprocessing=NATIVE, top_k=3)
    (a,) = attribute(server, spec, imgs[:1])
    targets = [t.target.class_index for t in ok(a)["summary"].targets]
    _, _, logits, _ = grad_at("resnet18", None, model_input(imgs[0]), None)
    assert targets == logits.topk(3).indices.tolist()
    assert a["map"].shape == (3, 2, 2)
    for j, c in enumerate(targets):
        act, g, _, _ = grad_at("resnet18", "layer4", model_input(imgs[0]), c)
        np.testing.assert_allclose(a["map"][j], CAM[spec.method](act, g).clamp_min(0), **TOL)


def test_mixed_targets_in_a_batch_equal_one_by_one(make_server, imgs):
    # A long batch delay makes the three images one batch with three targets.
    s = make_server(*R18, "--max-batch-delay-ms", "300")
    spec = pb.AttributionSpec(layer="layer4", method=pb.ATTRIBUTION_METHOD_GRAD_CAM,
                              preprocessing=NATIVE)
    targets = [5, None, 999]
    batched = attribute(s, spec, imgs, targets)
    for a, arr, t in zip(batched, imgs, targets, strict=True):
        (alone,) = attribute(s, spec, [arr], [t])
        np.testing.assert_allclose(ok(a)["map"], ok(alone)["map"], **TOL)
        got, want = a["summary"].targets[0], alone["summary"].targets[0]
        assert got.target.class_index == want.target.class_index
        assert got.target.logit == pytest.approx(want.target.logit, abs=1e-4)
    assert [a["summary"].targets[0].target.class_index for a in batched][::2] == [5, 999]


def test_integrated_gradients_delta_falls_with_steps(server, imgs):
    deltas = []
    for steps in (2, 8, 32):
        spec = pb.AttributionSpec(method=pb.ATTRIBUTION_METHOD_INTEGRATED_GRADIENTS,
                                  preprocessing=NATIVE, ig_steps=steps,
                                  ig_baseline=pb.ATTRIBUTION_BASELINE_BLACK)
        (a,) = attribute(server, spec, [imgs[0][:32, :32]])
        assert ok(a)["map"].shape == (3, 32, 32)
        deltas.append(abs(a["summary"].targets[0].completeness_delta))
    assert deltas[0] > deltas[1] > deltas[2]


def test_smooth_grad_is_seeded(server, imgs):
    spec = pb.AttributionSpec(method=pb.ATTRIBUTION_METHOD_SMOOTH_GRAD, preprocessing=NATIVE,
                              sg_samples=3, sg_seed=11)
    small = [i[:32, :32] for i in imgs[:2]]
    first = attribute(server, spec, small)
    again = attribute(server, spec, small[::-1])[::-1]
    for a, b in zip(first, again, strict=True):
        np.testing.assert_allclose(ok(a)["map"], ok(b)["map"], **TOL)
    spec.sg_seed = 12
    other = attribute(server, spec, small[:1])
    assert not np.allclose(ok(other[0])["map"], first[0]["map"])
    # every bit of the 64-bit seed counts (torch's CPU generator takes the low 32 alone):
    # halves swapped or equal too
    maps = []
    for seed in (11 + 2**32, 11 + 2**63, 2**64 - 1, (1 << 32) | 2, (2 << 32) | 1,
                 (7 << 32) | 7):
        spec.sg_seed = seed
        maps.append(ok(attribute(server, spec, small[:1])[0])["map"])
        assert not np.allclose(maps[-1], first[0]["map"]), seed
    for j, a in enumerate(maps):
        assert not any(np.allclose(a, b) for b in maps[j + 1:]), j
    spec.sg_seed = 11 + 2**32   # and stays seeded
    np.testing.assert_allclose(ok(attribute(server, spec, small[:1])[0])["map"], maps[0],
                               **TOL)


# -- errors ----------------------------------------------------------------------------
def test_bad_specs_end_the_call(server, imgs):
    cam = pb.ATTRIBUTION_METHOD_GRAD_CAM
    cases = [
        (pb.AttributionSpec(layer="layer4"), "method"),
        (pb.AttributionSpec(layer="layer4", method=42), "method"),
        (pb.AttributionSpec(method=pb.ATTRIBUTION_METHOD_GRADIENT, layer="layer4"), "layer"),
        (pb.AttributionSpec(method=cam, layer="fc"), "fc"),
        (pb.AttributionSpec(method=cam, layer="layer9"), "layer9"),
        (pb.AttributionSpec(method=cam, layer="layer4", top_k=1001), "1000"),
        (pb.AttributionSpec(method=pb.ATTRIBUTION_METHOD_INTEGRATED_GRADIENTS,
                            ig_steps=5000), "--max-attribution-cost"),
    ]
    for spec, word in cases:
        err = call_error(server, spec, imgs[:1])
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (spec, err.details())
        assert word in err.details(), (word, err.details())


def test_bad_target_fails_only_its_image(server, imgs):
    spec = pb.AttributionSpec(layer="layer4", method=pb.ATTRIBUTION_METHOD_GRAD_CAM,
                              preprocessing=NATIVE)
    got = attribute(server, spec, imgs, [1000, 2, -1])
    assert got[0]["status"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "1000 classes" in got[0]["status"].message and "map" not in got[0]
    assert ok(got[1])["summary"].targets[0].target.class_index == 2
    assert got[2]["status"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    spec.top_k = 2
    got = attribute(server, spec, imgs[:2], [3, None])
    assert got[0]["status"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "top_k" in got[0]["status"].message
    assert ok(got[1])["map"].shape == (2, 2, 2)


# -- captum cross-check (optional) ----------------------------------------------------
def test_matches_captum_layer_grad_cam(server, imgs):
    captum_attr = pytest.importorskip("captum.attr")
    model = oracle_model("resnet18")
    spec = pb.AttributionSpec(layer="layer4", method=pb.ATTRIBUTION_METHOD_GRAD_CAM,
                              preprocessing=NATIVE, relu=False)
    (a,) = attribute(server, spec, imgs[:1], [17])
    with torch.enable_grad():
        want = captum_attr.LayerGradCam(model, model.layer4).attribute(
            model_input(imgs[0]), target=17)
    np.testing.assert_allclose(ok(a)["map"], want[0, 0].detach().numpy(), **TOL)


# -- resources -------------------------------------------------------------------------
def test_memory_bounded_over_200_calls(server):
    spec = pb.AttributionSpec(layer="layer2", method=pb.ATTRIBUTION_METHOD_GRAD_CAM,
                              preprocessing=NATIVE)
    tiny = rand_image(16, 16, seed=5)

    def rss_kb() -> int:
        gc.collect()
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

    for _ in range(20):  # warm caches and allocator pools first
        ok(attribute(server, spec, [tiny])[0])
    before = rss_kb()
    for _ in range(200):
        ok(attribute(server, spec, [tiny])[0])
    grown_mb = (rss_kb() - before) / 1024
    assert grown_mb < 40, f"RSS grew {grown_mb:.1f} MB over 200 Attribute calls"
    assert server.engine.hook_count() == 0
