"""More forms of users' own checkpoints: a head's bias as the file holds it, an EMA
saved alone, a torch.compile'd submodule; and model-file normalisation on the wrong
scale. Served features are compared with the same checkpoint in this process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from test_own_models import hooked

from hookserve_server.errors import ConfigError
from hookserve_server.models import build_model

from conftest import RunningServer, rand_image

SIDE = 64


def _served_equal(make_server, tmp_path, arch: str, ref: torch.nn.Module, saved,
                  layer: str, side: int = SIDE) -> None:
    path = tmp_path / f"{arch}.pt"
    torch.save(saved, path)
    s = make_server("--model", arch, "--weights", str(path))
    img = rand_image(side, side, seed=6)
    with s.client(timeout=120) as c:
        (m,) = c.list_models()
        got = c.extract(img, [layer], model=arch, resize=side, crop=side)
    want = hooked(ref.eval(), img, [layer], m.mean, m.std)
    np.testing.assert_allclose(got[layer], want[layer], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch, head, bias", [
    ("maxvit_t", "classifier.5", True),        # torchvision's has none
    ("regnet_y_400mf", "fc", False),           # a bias-free linear probe
])
def test_a_head_with_or_without_a_bias_is_served_as_saved(make_server, tmp_path, arch,
                                                          head, bias):
    torch.manual_seed(12)
    ref = torchvision.models.get_model(arch, weights=None)
    old = ref.get_submodule(head)
    ref.set_submodule(head, torch.nn.Linear(old.in_features, 7, bias=bias))
    side = 224 if arch == "maxvit_t" else SIDE
    _served_equal(make_server, tmp_path, arch, ref, ref.state_dict(), head, side)


@pytest.mark.parametrize("key", ["model_ema", "state_dict_ema"])
def test_an_ema_saved_alone_is_served(make_server, tmp_path, key):
    torch.manual_seed(13)
    ref = torchvision.models.resnet18(num_classes=5)
    _served_equal(make_server, tmp_path, "resnet18", ref, {key: ref.state_dict(), "epoch": 9},
                  "fc")


def test_a_compiled_submodule_loads(make_server, tmp_path):
    """model.layer4 = torch.compile(model.layer4) saves keys layer4._orig_mod.*."""
    torch.manual_seed(14)
    ref = torchvision.models.resnet18(num_classes=5)
    sd = {k.replace("layer4.", "layer4._orig_mod.", 1) if k.startswith("layer4.") else k: v
          for k, v in ref.state_dict().items()}
    _served_equal(make_server, tmp_path, "resnet18", ref, sd, "layer4")


def test_normalisation_on_the_0_255_scale_is_refused(tmp_path):
    (tmp_path / "models.toml").write_text(
        '[[model]]\narchitecture = "resnet18"\nname = "r"\nweights = "random"\n'
        '[model.preprocessing]\nmean = [123.675, 116.28, 103.53]\n'
        'std = [58.395, 57.12, 57.375]\n')
    with pytest.raises(ConfigError, match="preprocessing.mean .* is on the 0-255 scale.*"
                                          "divide by 255 \\(\\[0.485, 0.456, 0.406\\]\\)"):
        RunningServer(["--models", str(tmp_path / "models.toml")], start=False)


def test_a_maxvit_head_with_a_bias_builds_in_process(tmp_path):
    ref = torchvision.models.maxvit_t()
    ref.classifier[-1] = torch.nn.Linear(512, 3)
    torch.save(ref.state_dict(), tmp_path / "m.pt")
    model, info = build_model("maxvit_t", str(tmp_path / "m.pt"))
    assert info.num_classes == 3 and model.classifier[-1].bias is not None
