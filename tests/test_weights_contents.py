"""What a weights file holds, beyond its keys and shapes: values no model can serve
(NaN, infinities, integers or complex numbers where the model's weights are floating
point), archives that hold no state_dict (torch.export, numpy), a state_dict nested
twice, a head of no classes, and a head saved beside a backbone whose whole classifier
was left out. Each is one line at start-up, or served as the user's own model is.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision

from hookserve_server.errors import ConfigError
from hookserve_server.models import build_model

from conftest import rand_image

SIDE = 64
CLASSES = 6


def resnet18_sd(classes: int = CLASSES) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=classes).eval().state_dict()


def refused(path, arch: str = "resnet18") -> str:
    with pytest.raises(ConfigError) as err:
        build_model(arch, str(path))
    text = str(err.value)
    assert "\n" not in text and str(path) in text
    return text


@pytest.mark.parametrize("key,value", [
    ("fc.weight", float("nan")),              # a diverged head
    ("conv1.weight", float("inf")),           # a first layer
    ("layer1.0.bn1.running_var", float("inf")),   # a buffer, not a parameter
    ("layer4.1.bn2.bias", float("-inf")),
])
def test_weights_holding_nan_or_infinities_are_refused_by_key(tmp_path, key, value):
    sd = resnet18_sd()
    sd[key] = sd[key].clone()
    sd[key].view(-1)[3] = value   # one value is enough: every answer would carry it
    torch.save(sd, tmp_path / "w.pt")
    assert f"{key} holds NaN or infinite values" in refused(tmp_path / "w.pt")


def test_a_nan_in_a_buffer_is_refused_and_an_inf_there_is_not_looked_for(tmp_path):
    """FrozenBatchNorm2d keeps its weight and bias as buffers: a NaN there is refused
    (a model's every answer would carry it); a buffer may hold -inf on purpose."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=CLASSES).eval()
    model.register_buffer("mask", torch.full((4,), float("-inf")))   # persistent
    from hookserve_server.checkpoints import load_into
    load_into(model, model.state_dict(), "w", "resnet18")   # -inf in a buffer: loads
    sd = model.state_dict()
    sd["mask"] = torch.tensor([0.0, float("nan"), 0.0, 0.0])
    with pytest.raises(ConfigError, match="mask holds NaN or infinite values"):
        load_into(model, sd, "w", "resnet18")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.bool,
                                   torch.complex64])
def test_weights_of_no_floating_point_type_are_refused_not_cast(tmp_path, dtype):
    sd = resnet18_sd()
    sd["fc.bias"] = sd["fc.bias"].to(dtype)
    torch.save(sd, tmp_path / "w.pt")
    name = str(dtype).removeprefix("torch.")
    assert f"fc.bias holds {name} values where resnet18's are floating point" in refused(
        tmp_path / "w.pt")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_weights_of_other_floating_point_types_load(tmp_path, dtype):
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in resnet18_sd().items()}
    torch.save(sd, tmp_path / "w.pt")
    model, info = build_model("resnet18", str(tmp_path / "w.pt"))
    assert info.num_classes == CLASSES
    torch.testing.assert_close(model.fc.weight, sd["fc.weight"].float())


def test_a_torch_export_program_and_a_numpy_archive_are_named(tmp_path):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=CLASSES).eval()
    torch.export.save(torch.export.export(model, (torch.randn(1, 3, 32, 32),)),
                      tmp_path / "m.pt2")
    assert "is a torch.export program" in refused(tmp_path / "m.pt2")
    np.savez(tmp_path / "w.npz", **{k: v.numpy() for k, v in model.state_dict().items()})
    assert "is a numpy .npz archive" in refused(tmp_path / "w.npz")


@pytest.mark.parametrize("nest", [["state_dict", "model"], ["model", "state_dict"],
                                  ["state_dict", "state_dict", "model"]])
def test_a_state_dict_nested_more_than_once_loads(tmp_path, nest):
    sd = resnet18_sd()
    held: object = sd
    for key in reversed(nest):
        held = {key: held, "epoch": 3}
    # an EMA beside it, one level down: the plain weights are still the ones served
    held["model_ema"] = {k: torch.zeros_like(v) for k, v in sd.items()}
    held["model"] = held.get("model", {"state_dict": {"lr": 0.1}})   # (metadata: no weights)
    torch.save(held, tmp_path / "w.pt")
    model, info = build_model("resnet18", str(tmp_path / "w.pt"))
    assert info.num_classes == CLASSES
    assert torch.equal(model.fc.weight, sd["fc.weight"])


def test_a_head_of_no_classes_and_a_folder_are_named(tmp_path):
    torch.save(resnet18_sd(classes=0), tmp_path / "w.pt")
    assert "its classifier head has no outputs (0 classes)" in refused(tmp_path / "w.pt")
    assert "is a folder" in refused(tmp_path)


class Wrapped(torch.nn.Module):
    """A backbone with its whole classifier left out (Identity) and a Linear of the
    user's beside it, as a wrapper module saves them."""

    def __init__(self, arch: str):
        super().__init__()
        torch.manual_seed(5)
        self.backbone = torchvision.models.get_model(arch, weights=None).eval()
        first = next(m for m in self.backbone.classifier.modules()
                     if isinstance(m, torch.nn.Linear))
        self.backbone.classifier = torch.nn.Identity()
        self.head = torch.nn.Linear(first.in_features, CLASSES)

    def forward(self, x):
        return self.head(self.backbone(x))


@pytest.mark.parametrize("arch", ["mobilenet_v3_small", "mobilenet_v3_large", "vgg11"])
def test_a_linear_beside_a_backbone_without_its_classifier_is_served_as_its_classifier(
        make_server, tmp_path, arch):
    ref = Wrapped(arch).eval()
    path = tmp_path / "w.pt"
    torch.save(ref.state_dict(), path)
    s = make_server("--model", arch, "--weights", str(path))
    img = rand_image(SIDE, SIDE, seed=4)
    with s.client(timeout=120) as c:
        (m,) = c.list_models()
        got = c.extract(img, ["classifier"], model=arch, resize=SIDE, crop=SIDE)
    assert m.num_classes == CLASSES
    x = torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float() / 255
    x = (x - torch.tensor(m.mean).view(1, 3, 1, 1)) / torch.tensor(m.std).view(1, 3, 1, 1)
    with torch.no_grad():
        want = ref(x)[0].numpy()
    np.testing.assert_allclose(got["classifier"], want, rtol=1e-4, atol=1e-4)
