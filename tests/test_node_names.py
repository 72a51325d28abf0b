"""Layer names as users of torchvision's feature extraction have them: a node of its
graph that is no layer here is refused with the layer that holds the same values, and
that layer, asked for over the wire, equals what `create_feature_extractor` returns.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

import hookserve

from conftest import encode, rand_image
from helpers import feature_extractor, graph_node_names

#: architecture -> input side (the transformers take their own size only)
FAMILIES = {"resnet18": 64, "googlenet": 64, "densenet121": 64, "convnext_tiny": 64,
            "regnet_y_400mf": 64, "mobilenet_v3_small": 64, "swin_t": 224, "vit_b_16": 224}
#: at most this many nodes of each model are asked for (in order, evenly spaced)
PER_MODEL = 12
SAME = re.compile(r"the layer (\S+) holds its values(, and the layer (\S+), an in-place "
                  r"module that takes them, holds them changed: torchvision's extractor "
                  r"returns those whenever it also computes a later node)?")
RENAMED = re.compile(r"is torchvision's feature-extraction name for the layer (\S+) "
                     r"\(torchvision renumbers modules")


def refusal(c: hookserve.Client, name: str, model: str, img: bytes) -> str:
    with pytest.raises(hookserve.InvalidArgument) as err:
        c.extract(img, [name], model=model, native=True)
    msg = str(err.value)
    assert "\n" not in msg and f"layer {name!r} of {model} cannot be captured" in msg
    return msg


def test_torchvision_node_names_point_to_their_layer(server):
    """resnet18: the input, the residual sums and the flatten before the head."""
    img = encode(rand_image(64, 64, seed=3))
    with server.client(timeout=120) as c:
        x = refusal(c, "x", "resnet18", img)
        add = refusal(c, "layer1.0.add", "resnet18", img)
        flat = refusal(c, "flatten", "resnet18", img)
        with pytest.raises(hookserve.InvalidArgument, match="unknown layer 'layer9'"):
            c.extract(img, ["layer9"], model="resnet18", native=True)
    assert "x is the model's input" in x and "the layer conv1:input holds its values" in x
    assert ("layer1.0.add is operator.add in resnet18's forward pass, a node of "
            "torchvision's feature-extraction graph but not a module call") in add
    same = SAME.search(add)
    assert same and (same.group(1), same.group(3)) == ("layer1.0.relu_1:input",
                                                       "layer1.0.relu_1")
    assert "flatten is torch.flatten" in flat and "the layer fc:input holds" in flat


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_each_family_node_names_equal_their_layers(make_server, arch):
    """For a model of each family, every refused node (up to PER_MODEL of them) names
    the layer whose answer over the wire equals what torchvision's
    `create_feature_extractor` returns for the node: alone, and together with the
    model's output (where an in-place module changes the node's value, that module's
    layer); a module call torchvision renames (vit's ln_1 is its `ln`) is named as
    hookserve names it."""
    side = FAMILIES[arch]
    s = make_server("--model", arch, "--weights", "random", "--seed", "1")
    model = s.engine.models[arch]
    nodes = model.tables.fx_node_names()
    step = max(1, len(nodes) // PER_MODEL)
    nodes = nodes[::step][:PER_MODEL] + (["encoder.layers.encoder_layer_0.ln"]
                                         if arch == "vit_b_16" else [])
    image = rand_image(side, side, seed=5)
    asked: dict[str, tuple[str, str | None]] = {}   # node -> its layer, the in-place one
    renamed: dict[str, str] = {}
    with s.client(timeout=300) as c:
        for name in nodes:
            msg = refusal(c, name, arch, encode(image))
            if m := SAME.search(msg):
                asked[name] = (m.group(1), m.group(3))
            elif m := RENAMED.search(msg):
                renamed[name] = m.group(1)
            else:
                assert "no layer holds its values" in msg, msg
        layers = {n for pair in asked.values() for n in pair if n} | set(renamed.values())
        got = c.extract(encode(image), sorted(layers), model=arch, native=True,
                        reduction="none")
    assert asked, f"no node of {arch} has a layer holding its values"
    mean = torch.tensor(model.defaults.mean).view(1, 3, 1, 1)
    std = torch.tensor(model.defaults.std).view(1, 3, 1, 1)
    x = (torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255 - mean) / std
    module = copy.deepcopy(model.module)
    output = graph_node_names(module)[-1]   # computing it computes every node

    def same(layer: str, value: torch.Tensor, name: str) -> None:
        np.testing.assert_allclose(got[layer], value[0].numpy(), rtol=1e-4, atol=1e-4,
                                   err_msg=f"{name} -> {layer}")

    with torch.no_grad():
        want = feature_extractor(module, [*asked, *renamed, output])(x)
        for name, (layer, changed) in asked.items():
            same(changed or layer, want[name], name)
            if changed:   # alone, torchvision prunes the in-place module away
                same(layer, feature_extractor(module, [name])(x)[name], name)
    for name, layer in renamed.items():
        same(layer, want[name], name)
    if arch == "vit_b_16":
        assert renamed["encoder.layers.encoder_layer_0.ln"] == \
            "encoder.layers.encoder_layer_0.ln_1"
    if arch in ("resnet18", "regnet_y_400mf"):   # residual sums before in-place ReLUs
        assert any(changed for _, changed in asked.values())


def test_an_input_transformed_inside_the_model_is_no_layer(make_server, tmp_path):
    """googlenet with transform_input re-normalises its input inside the forward pass:
    there `x` is no layer's value, and the transform's last node (`cat`) is the first
    convolution's input."""
    (tmp_path / "models.toml").write_text(
        '[[model]]\narchitecture = "googlenet"\nweights = "random"\n'
        "transform_input = true\n")
    s = make_server("--models", str(tmp_path / "models.toml"))
    model = s.engine.models["googlenet"]
    image = rand_image(64, 64, seed=8)
    with s.client(timeout=120) as c:
        x = refusal(c, "x", "googlenet", encode(image))
        cat = SAME.search(refusal(c, "cat", "googlenet", encode(image)))
        assert cat and cat.group(1) == "conv1.conv:input"
        got = c.extract(encode(image), [cat.group(1)], model="googlenet", native=True)
    assert "x is the model's input" in x and "no layer holds its values" in x
    mean = torch.tensor(model.defaults.mean).view(1, 3, 1, 1)
    std = torch.tensor(model.defaults.std).view(1, 3, 1, 1)
    pixels = (torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255 - mean) / std
    with torch.no_grad():
        want = feature_extractor(copy.deepcopy(model.module), ["cat"])(pixels)
    np.testing.assert_allclose(got[cat.group(1)], want["cat"][0].numpy(), rtol=1e-4,
                               atol=1e-4)
