"""timm models behind the `timm` extra: `--model timm:resnet18`, random weights or a
fine-tuned file, features equal to in-process hooks. Skipped without timm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hookserve_server.errors import ConfigError
from hookserve_server.models import build_model, state_dict_digest

from conftest import rand_image

timm = pytest.importorskip("timm")


def test_timm_model_serves_with_its_own_transforms(make_server, tmp_path):
    torch.manual_seed(3)
    tuned = timm.create_model("resnet18", pretrained=False, num_classes=10).eval()
    torch.save(tuned.state_dict(), tmp_path / "t18-10.pt")
    s = make_server("--model", "timm:resnet18", "--weights", str(tmp_path / "t18-10.pt"),
                    "--max-batch-delay-ms", "2")
    img = rand_image(64, 64, seed=6)
    with s.client(timeout=120) as c:
        m = c.list_models()[0]
        d = c.describe("timm:resnet18", 64)
        got = c.extract(img, ["layer3", "fc"], model="timm:resnet18", resize=64, crop=64)
        a = c.attribute(img, model="timm:resnet18", resize=64, crop=64)
    cfg = timm.data.resolve_model_data_config(tuned)
    assert m.architecture == "timm:resnet18" and m.num_classes == 10
    assert m.weights_digest == state_dict_digest(tuned.state_dict())
    assert m.crop == tuple(cfg["input_size"][1:])
    np.testing.assert_allclose(m.mean, cfg["mean"], rtol=1e-6)
    assert m.interpolation == cfg["interpolation"]
    assert m.default_cam_layer == "layer4" and d.layer("layer3").layout == "CHW"
    x = torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float() / 255
    x = (x - torch.tensor(m.mean).view(1, 3, 1, 1)) / torch.tensor(m.std).view(1, 3, 1, 1)
    outs = {}
    hook = tuned.layer3.register_forward_hook(lambda mod, i, o: outs.__setitem__("l3", o[0]))
    with torch.no_grad():
        logits = tuned(x)[0]
    hook.remove()
    np.testing.assert_allclose(got["layer3"], outs["l3"].numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["fc"], logits.numpy(), rtol=1e-4, atol=1e-4)
    assert a.target == int(logits.argmax())


def test_timm_random_weights_and_refusals():
    _, info = build_model("timm:resnet18", "random", seed=1)
    _, again = build_model("timm:resnet18", "random", seed=1)
    assert info.source == "random" and info.digest == again.digest
    with pytest.raises(ConfigError, match="timm models take their weights from a file"):
        build_model("timm:resnet18", "imagenet")
    with pytest.raises(ConfigError, match="unknown timm model 'resnet19'"):
        build_model("timm:resnet19", "random")


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224.augreg_in21k", "resnet18"])
def test_timm_heads_of_any_size_and_none(tmp_path, name):
    """A timm model's own head size (21843 classes for an in21k model) is read off its
    file, and a file without a head serves the backbone (timm's num_classes=0)."""
    torch.manual_seed(5)
    m = timm.create_model(name, pretrained=False)
    torch.save(m.state_dict(), tmp_path / "full.pt")
    _, info = build_model(f"timm:{name}", str(tmp_path / "full.pt"))
    assert info.num_classes == m.num_classes
    m.reset_classifier(0)
    torch.save({"state_dict": {f"model.{k}": v for k, v in m.state_dict().items()}},
               tmp_path / "backbone.pt")
    model, info = build_model(f"timm:{name}", str(tmp_path / "backbone.pt"))
    assert info.num_classes == 0
    x = torch.rand(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), m.eval()(x))
