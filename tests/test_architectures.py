"""Any torchvision classifier by name: layouts (CHW, HWC, TD, D), reductions over the
spatial or token axis, the cls token, and Grad-CAM at each family's default layer,
compared with forward hooks and a hand computation on the same weights in this process.

Random weights, one input size per model (vit_b_16 takes 224 only).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torchvision

import hookserve
from hookserve_server.config import ARCHITECTURES
from hookserve_server.models import build_model

from conftest import RunningServer, rand_image
from helpers import small_server

#: model -> (input side, {layer: (reduction, its layout)}, default CAM layer)
CASES = {
    "mobilenet_v3_small": (96, {"features.6": ("avg", "CHW")}, "features.12"),
    "efficientnet_b0": (96, {"features.5": ("max", "CHW")}, "features.8"),
    "convnext_tiny": (64, {"features.3.0.block.2": ("avg", "HWC"),
                           "features.3.0": ("stats", "CHW")}, "features.7"),
    "vit_b_16": (224, {"encoder.layers.encoder_layer_5": ("cls", "TD"),
                       "encoder.layers.encoder_layer_6": ("avg", "TD")},
                 "encoder.layers.encoder_layer_11.ln_1"),
}
TOL = {"rtol": 1e-3, "atol": 1e-4}


@pytest.fixture(scope="module")
def families():
    s = RunningServer(small_server("--max-batch-delay-ms", "2", models=list(CASES)))
    refs = {arch: build_model(arch, "random", seed=0)[0].eval() for arch in CASES}
    yield s, refs
    s.stop(2.0)


def _input(img: np.ndarray, m: hookserve.ModelInfo) -> torch.Tensor:
    x = torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float() / 255
    return (x - torch.tensor(m.mean).view(1, 3, 1, 1)) / torch.tensor(m.std).view(1, 3, 1, 1)


def _reduce(out: torch.Tensor, reduction: str, layout: str) -> torch.Tensor:
    """What the reduction means, written out per layout (one image, no batch dim)."""
    if reduction == "cls":
        return out[0]
    channels = (out.flatten(1) if layout == "CHW"
                else out.flatten(0, 1).T if layout == "HWC" else out.T)  # [C, positions]
    if reduction == "avg":
        return channels.mean(dim=1)
    if reduction == "max":
        return channels.amax(dim=1)
    std, mean = torch.std_mean(channels, dim=1, correction=0)
    return torch.stack([mean, std, channels.amin(1), channels.amax(1),
                        (channels == 0).float().mean(1)], dim=1)


@pytest.mark.parametrize("arch", CASES)
def test_layouts_reductions_and_default_grad_cam(families, arch):
    s, refs = families
    side, layers, cam_layer = CASES[arch]
    ref = refs[arch]
    img = rand_image(side, side, seed=7)
    geometry = {"resize": side, "crop": side}
    with s.client(timeout=300) as c:
        d = c.describe(arch, side)
        m = d.model
        got = c.extract(img, [hookserve.Layer(n, reduction=r) for n, (r, _) in layers.items()],
                        model=arch, **geometry)
        a = c.attribute(img, model=arch, **geometry)  # grad_cam at the default layer
    assert m.default_cam_layer == cam_layer and m.num_classes == 1000
    assert d.layers[-1].layout == "D"
    for name, (_, layout) in layers.items():
        assert d.layer(name).layout == layout
    # in-process forward hooks on the same weights
    x = _input(img, m)
    outs = {}
    handles = [ref.get_submodule(n).register_forward_hook(
        lambda mod, args, out, n=n: outs.__setitem__(n, out[0].detach()))
        for n in layers]
    with torch.no_grad():
        ref(x)
    for h in handles:
        h.remove()
    for name, (reduction, layout) in layers.items():
        np.testing.assert_allclose(got[name], _reduce(outs[name], reduction, layout).numpy(),
                                   err_msg=f"{arch} {name} {reduction}", **TOL)
    # Grad-CAM by hand at the default layer: alpha = mean gradient over the grid
    saved = {}

    def keep(mod, args, out):
        out.retain_grad()
        saved["a"] = out

    h = ref.get_submodule(cam_layer).register_forward_hook(keep)
    with torch.enable_grad():
        logits = ref(x)
        target = int(logits.argmax())
        logits[0, target].backward()
    h.remove()
    act, grad = saved["a"].detach()[0], saved["a"].grad[0]
    layout = d.layer(cam_layer).layout
    if layout == "TD":  # patch tokens to their grid, the class token left out
        g = int(round((act.shape[0] - 1) ** 0.5))
        act, grad = (t[1:].reshape(g, g, -1).permute(2, 0, 1) for t in (act, grad))
    elif layout == "HWC":
        act, grad = act.permute(2, 0, 1), grad.permute(2, 0, 1)
    want = (grad.mean(dim=(1, 2), keepdim=True) * act).sum(0).clamp_min(0)
    assert a.target == target and a.map.shape == tuple(want.shape)
    np.testing.assert_allclose(a.map, want.numpy(), rtol=2e-3,
                               atol=2e-3 * float(want.abs().max()) + 1e-6)


def test_cls_is_refused_on_a_feature_map(families):
    s, _ = families
    with s.client(timeout=120) as c, pytest.raises(hookserve.InvalidArgument,
                                                   match="cls takes token 0 of a"):
        c.extract(rand_image(96, 96), [hookserve.Layer("features.6", reduction="cls")],
                  model="mobilenet_v3_small", resize=96, crop=96)


def test_the_architectures_are_torchvisions_classifiers():
    assert set(ARCHITECTURES) == set(torchvision.models.list_models(module=torchvision.models))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKSERVE_")}
    r = subprocess.run([sys.executable, "-m", "hookserve.cli", "models", "--available"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == list(ARCHITECTURES)


def test_cam_without_a_layer_explains_the_family_default(client):
    """resnet layer4 and vgg's last convolution (today's "layer4" default fails on vgg)."""
    img = rand_image(64, 64, seed=8)
    for model, layer in (("resnet18", "layer4"), ("vgg11", "features.18")):
        assert client.describe(model).model.default_cam_layer == layer
        auto = client.attribute(img, model=model, resize=64, crop=64)
        named = client.attribute(img, layer, model=model, resize=64, crop=64)
        np.testing.assert_array_equal(auto.map, named.map)


def test_swin_blocks_are_channels_last():
    from hookserve_server.models import ServedModel
    from hookserve_server.spec import Layout

    module, info = build_model("swin_t", "random")
    m = ServedModel("swin_t", "swin_t", module, info, torch.device("cpu"))
    table = m.layer_table(224, 224)
    assert table["features.7"].shape == (7, 7, 768) and table["features.7"].layout is Layout.HWC
    assert table["features.0"].layout is Layout.HWC  # patch embedding, permuted
    assert table["permute"].shape == (768, 7, 7) and table["permute"].layout is Layout.CHW
    assert table["head"].layout is Layout.D
    assert m.default_cam_layer == "features.7"


def test_a_module_that_is_not_one_tensor_says_why_and_what_to_ask_for(families):
    """Attention returns a tuple, an unused projection is never called: the error
    names the reason and a layer that can be captured, which then works."""
    s, _ = families
    block = "encoder.layers.encoder_layer_0"
    cases = {
        f"{block}.self_attention": ("returns a tuple (tensor, None), not one tensor",
                                    f"the next one to run is {block}.dropout"),
        f"{block}.self_attention:input": ("neither its output nor its input is a layer",
                                          f"the layer that ran before it, {block}.ln_1"),
        f"{block}.self_attention.out_proj": ("its forward pass never calls", ""),
    }
    img = rand_image(224, 224, seed=3)
    with s.client(timeout=120) as c:
        for layer, (why, instead) in cases.items():
            with pytest.raises(hookserve.InvalidArgument) as err:
                c.extract(img, [layer], model="vit_b_16", native=True)
            msg = str(err.value)
            assert f"layer {layer!r} of vit_b_16 cannot be captured" in msg, msg
            assert why in msg and instead in msg, msg
        got = c.extract(img, [f"{block}.dropout", f"{block}.ln_1"], model="vit_b_16",
                        native=True)
    assert got[f"{block}.dropout"].shape == got[f"{block}.ln_1"].shape == (197, 768)


def test_a_module_given_a_list_names_the_layer_inside_it():
    from hookserve_server.capture.table import LayerTables

    tables = LayerTables("densenet121", "densenet121", torch.float32)
    table = tables.at(64, 64)
    layer = "features.denseblock2.denselayer3"
    assert layer in table and f"{layer}.norm1" in table   # its output is a layer
    why = tables.why_not(f"{layer}:input")
    assert why == (f"{layer} (_DenseLayer) takes a list of 3 tensors as its input, not one "
                   f"tensor; ask for a layer inside it, such as {layer}.norm1:input")
    assert tables.why_not("features.no_such_block") is None


def test_a_container_the_forward_pass_never_calls_names_what_it_calls():
    from hookserve_server.capture.table import LayerTables

    tables = LayerTables("maxvit_t", "maxvit_t", torch.float32)
    assert "blocks" not in tables.at(224, 224) and "blocks.0" in tables.at(224, 224)
    assert tables.why_not("blocks") == (
        "blocks (ModuleList) is a container the forward pass never calls itself: it calls "
        "the modules inside it, such as blocks.0")
