"""Attribution cut into passes gives the same maps as one pass, and as the definitions
computed here by hand; error messages name the SDK's parameters.

A server with --attribution-pass-cost 3 runs one row (one image at one point of its
path) and one target slot per pass: top_k=3 becomes three slot groups, each with its
own forward. A server with a cost of 1024 runs each of these jobs in one pass.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from hookserve.v1 import hookserve_pb2 as pb
from hookserve_server.attribution_spec import AttributeInput, AttributionSpec, Method
from hookserve_server.engine.config import EngineConfig
from hookserve_server.engine.core import Engine
from hookserve_server.models import ServedModel, build_model
from hookserve_server.spec import Mode, Preprocess

from conftest import rand_image
from helpers import NATIVE, R18, attribute, call_error, ok
from oracles import model_input, oracle_model

GRAD_TOL = {"rtol": 1e-3, "atol": 1e-7}
CAM_TOL = {"rtol": 1e-4, "atol": 1e-5}
IG = pb.ATTRIBUTION_METHOD_INTEGRATED_GRADIENTS
SG = pb.ATTRIBUTION_METHOD_SMOOTH_GRAD
FLAGS = [*R18, "--max-batch-delay-ms", "200"]


@pytest.fixture(scope="module")
def imgs() -> list[np.ndarray]:
    return [rand_image(32, 32, seed=s) for s in range(3)]


@pytest.fixture
def split_and_whole(make_server):
    """(one row and one slot a pass, everything in one pass)."""
    return (make_server(*FLAGS, "--attribution-pass-cost", "3"),
            make_server(*FLAGS, "--attribution-pass-cost", "1024"))


def input_grad(x: torch.Tensor, target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d logit_target / dx, logits) for one normalised image [1, 3, H, W]."""
    with torch.enable_grad():
        a = x.detach().clone().requires_grad_(True)
        logits = oracle_model("resnet18")(a)
        (g,) = torch.autograd.grad(logits[0, target], a)
    return g[0], logits.detach()[0]


def ig_by_hand(x: torch.Tensor, targets: list[int], steps: int) -> torch.Tensor:
    """Integrated Gradients from the zeros baseline, trapezoid rule: [k, 3, H, W]."""
    maps = []
    for c in targets:
        acc = torch.zeros_like(x[0])
        for m in range(steps, -1, -1):
            g, _ = input_grad(x * (m / steps), c)
            acc += g * (0.5 if m in (0, steps) else 1.0)
        maps.append(x[0] * acc / steps)
    return torch.stack(maps)


def sg_by_hand(x: torch.Tensor, targets: list[int], samples: int, sigma: float,
               seed: int) -> torch.Tensor:
    """SmoothGrad as documented: noise from a CPU generator seeded with `seed`, drawn
    sample by sample, scaled by sigma x the input's range: [k, 3, H, W]."""
    scale = (x.max() - x.min()) * sigma
    maps = []
    for c in targets:
        gen = torch.Generator().manual_seed(seed)
        acc = torch.zeros_like(x[0])
        for _ in range(samples):
            noise = torch.randn(x.shape[1:], generator=gen) * scale
            acc += input_grad(x + noise, c)[0]
        maps.append(acc / samples)
    return torch.stack(maps)


def test_integrated_gradients_split_equals_whole_and_the_definition(split_and_whole, imgs):
    split, whole = split_and_whole
    spec = pb.AttributionSpec(method=IG, preprocessing=NATIVE, ig_steps=6, top_k=3)
    cut, one = attribute(split, spec, imgs[:2]), attribute(whole, spec, imgs[:2])
    passes_cut = 2 * 7 * 3   # images x points x slot groups, one row a pass
    assert split.engine.attribution_passes == passes_cut
    assert whole.engine.attribution_passes < passes_cut
    for a, b, arr in zip(cut, one, imgs[:2], strict=True):
        x = model_input(arr)
        targets = [t.target.class_index for t in ok(a)["summary"].targets]
        assert targets == [t.target.class_index for t in ok(b)["summary"].targets]
        assert targets == input_grad(x, 0)[1].topk(3).indices.tolist()
        want = ig_by_hand(x, targets, 6)
        assert a["map"].shape == (3, 3, 32, 32)
        np.testing.assert_allclose(a["map"], want.numpy(), **GRAD_TOL)
        np.testing.assert_allclose(b["map"], want.numpy(), **GRAD_TOL)
        deltas = [t.completeness_delta for t in a["summary"].targets]
        assert deltas == pytest.approx([t.completeness_delta for t in b["summary"].targets],
                                       rel=1e-3, abs=1e-5)


def test_smooth_grad_split_equals_whole_and_the_definition(split_and_whole, imgs):
    split, whole = split_and_whole
    spec = pb.AttributionSpec(method=SG, preprocessing=NATIVE, sg_samples=4, top_k=2,
                              sg_seed=5)
    cut, one = attribute(split, spec, imgs[:2]), attribute(whole, spec, imgs[:2])
    assert split.engine.attribution_passes == 2 + 2 * 4 * 2   # clean forwards, then rows
    for a, b, arr in zip(cut, one, imgs[:2], strict=True):
        x = model_input(arr)
        targets = [t.target.class_index for t in ok(a)["summary"].targets]
        want = sg_by_hand(x, targets, 4, 0.15, 5)
        np.testing.assert_allclose(a["map"], want.numpy(), **GRAD_TOL)
        np.testing.assert_allclose(b["map"], want.numpy(), **GRAD_TOL)


@pytest.mark.parametrize("method,layer", [(pb.ATTRIBUTION_METHOD_GRAD_CAM, "layer3"),
                                          (pb.ATTRIBUTION_METHOD_LAYER_CAM, "layer4"),
                                          (pb.ATTRIBUTION_METHOD_GRADIENT_X_INPUT, "")])
def test_top_k_slot_groups_equal_one_pass(split_and_whole, imgs, method, layer):
    split, whole = split_and_whole
    spec = pb.AttributionSpec(method=method, layer=layer, preprocessing=NATIVE, top_k=4,
                              normalize=True, upsample=bool(layer))
    targets = [None, None, None]
    cut, one = attribute(split, spec, imgs, targets), attribute(whole, spec, imgs, targets)
    assert split.engine.attribution_passes == 3 * 4
    tol = CAM_TOL if layer else GRAD_TOL
    shape = (4, 32, 32) if layer else (4, 3, 32, 32)
    for a, b in zip(cut, one, strict=True):
        assert ok(a)["map"].shape == ok(b)["map"].shape == shape
        np.testing.assert_allclose(a["map"], b["map"], **tol)
        got, want = a["summary"].targets, b["summary"].targets
        assert [t.target.class_index for t in got] == [t.target.class_index for t in want]
        assert [t.map_max for t in got] == pytest.approx([t.map_max for t in want],
                                                         rel=1e-4, abs=1e-6)


# -- messages --------------------------------------------------------------------------
SDK_NAMES = ("steps", "samples", "sigma", "baseline", "target", "top_k", "method", "layer")
WIRE_ONLY = ("ig_steps", "ig_baseline", "sg_samples", "sg_sigma", "sg_seed", "target_class",
             "AttributionSpec.")


def test_attribution_messages_name_the_sdk_parameters(server, imgs):
    cases = [
        (pb.AttributionSpec(method=IG, ig_steps=5000), "fewer steps"),
        (pb.AttributionSpec(method=SG, sg_samples=2000), "fewer samples"),
        (pb.AttributionSpec(method=IG, ig_steps=200, top_k=3), "fewer steps or a smaller top_k"),
        (pb.AttributionSpec(method=pb.ATTRIBUTION_METHOD_GRAD_CAM, layer="layer4",
                            top_k=600), "a smaller top_k"),
        (pb.AttributionSpec(method=SG, sg_sigma=-1.0), "sigma"),
        (pb.AttributionSpec(method=SG, sg_sigma=float("nan")), "sigma"),
        (pb.AttributionSpec(method=IG, ig_baseline=9), "baseline"),
        (pb.AttributionSpec(layer="layer4"), "method"),
        (pb.AttributionSpec(method=42), "method"),
        (pb.AttributionSpec(method=IG, score=7), "score"),
    ]
    for spec, words in cases:
        spec.preprocessing.CopyFrom(NATIVE)
        err = call_error(server, spec, imgs[:1])
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (spec, err.details())
        assert words in err.details(), (words, err.details())
        assert not any(w in err.details() for w in WIRE_ONLY), err.details()
    spec = pb.AttributionSpec(method=pb.ATTRIBUTION_METHOD_GRAD_CAM, layer="layer4",
                              preprocessing=NATIVE)
    bad_target = attribute(server, spec, imgs[:1], [1000])[0]["status"].message
    spec.top_k = 2
    both = attribute(server, spec, imgs[:1], [3])[0]["status"].message
    for msg, words in ((bad_target, "target 1000 is out of range"), (both, "target")):
        assert words in msg and not any(w in msg for w in WIRE_ONLY), msg


def test_an_image_over_the_memory_cap_is_refused_naming_what_to_lower(make_server):
    s = make_server(*FLAGS, "--max-batch-bytes", str(30 << 20))
    with s.client(timeout=60) as c:
        need = c.describe("resnet18").gradient_bytes_per_image
        assert need > 30 << 20                 # the input-space figure at 224x224
        spec = pb.AttributionSpec(method=pb.ATTRIBUTION_METHOD_GRADIENT)   # default: 224
        err = call_error(s, spec, [rand_image(64, 64)])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-batch-bytes" in err.details() and "top_k" in err.details()
    # a CAM map at layer4 holds far less, and runs
    spec = pb.AttributionSpec(method=pb.ATTRIBUTION_METHOD_GRAD_CAM, layer="layer4")
    assert ok(attribute(s, spec, [rand_image(64, 64)])[0])["map"].shape == (7, 7)


def test_a_pass_out_of_memory_restarts_its_batch_with_fewer_rows(imgs):
    # The model refuses any forward of more than one row, as a host allocation that
    # fails would: the batch starts over with half the rows, down to one.
    module, info = build_model("resnet18", "random", 0)

    def one_row_only(mod, args):
        if args[0].shape[0] > 1:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    module.register_forward_pre_hook(one_row_only)
    m = ServedModel("resnet18", "resnet18", module, info, torch.device("cpu"), "float32",
                    False)
    engine = Engine([m], EngineConfig(attribution_pass_cost=1024)).start()
    try:
        spec = AttributionSpec("resnet18", Method.INTEGRATED_GRADIENTS, ig_steps=4,
                               preprocessing=Preprocess(Mode.NATIVE))
        images = [AttributeInput(f"i{n}", raw=a.tobytes(), height=32, width=32)
                  for n, a in enumerate(imgs[:2])]
        results = list(engine.session().run([spec, *images]))
        assert engine.attribution_passes == 2 * 5     # one row a pass, in the end
    finally:
        engine.close()
    for r, arr in zip(results, imgs[:2], strict=True):
        assert r.error is None, r.error
        (out,) = r.outputs
        x = model_input(arr)
        want = ig_by_hand(x, [out.targets[0].target.class_index], 4)[0]
        got = np.frombuffer(out.data, "<f4").reshape(out.shape)
        np.testing.assert_allclose(got, want.numpy(), **GRAD_TOL)
