"""The files of a user's own model as they come out of common tools:

- labels written by `csv.writer` or pandas (a name with a comma is quoted) are read
  unquoted;
- a safetensors file named otherwise (`.SAFETENSORS`, `.pt`) is read as one;
- a training checkpoint that is not a plain state_dict is refused naming what to change
  (the key holding the weights, or the entry that is no tensor);
- `--models` beside `--weights`, `--labels` or `--model` is refused (they were dropped
  without a word).
"""

from __future__ import annotations

import csv
import re

import numpy as np
import pytest
import torch
import torchvision

from hookserve_server.checkpoints import read_state_dict
from hookserve_server.errors import ConfigError
from hookserve_server.labels import read_labels

from conftest import RunningServer, rand_image


def test_csv_labels_with_quoted_names_are_read_unquoted(tmp_path):
    names = ["tench, Tinca tinca", 'the "great" white', "plain"]
    for header in (True, False):
        path = tmp_path / f"labels-{header}.csv"
        with path.open("w", newline="") as fh:
            w = csv.writer(fh)
            if header:
                w.writerow(["index", "name"])
            w.writerows(enumerate(names))
        assert read_labels(path) == tuple(names)


@pytest.fixture(scope="module")
def weights():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=3).state_dict()


@pytest.mark.parametrize("name", ["w.SAFETENSORS", "w.pt"])
def test_a_safetensors_file_named_otherwise_is_read_as_one(tmp_path, weights, name):
    from safetensors.torch import save_file

    save_file(weights, str(tmp_path / name))
    got = read_state_dict(tmp_path / name, "resnet18", weights.keys())
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], weights[k]) for k in weights)


@pytest.mark.parametrize("wrap, words", [
    (lambda sd: {"net": sd, "acc": 0.9, "epoch": 3},
     "holds a dict whose 'net' holds the weights (with other entries): save that dict alone"),
    (lambda sd: {**sd, "epoch": 3}, "a dict of tensors with 'epoch', which is no tensor: "
                                    "drop it"),
])
def test_a_training_checkpoint_says_what_to_change(tmp_path, weights, wrap, words):
    torch.save(wrap(weights), tmp_path / "ck.pt")
    with pytest.raises(ConfigError) as err:
        read_state_dict(tmp_path / "ck.pt", "resnet18", weights.keys())
    assert words in str(err.value)


@pytest.mark.parametrize("flags, named", [
    (["--weights", "random"], "--weights"), (["--labels", "resnet18=x.txt"], "--labels"),
    (["--model", "vgg11"], "--model"),
])
def test_models_beside_the_flags_it_replaces_is_refused(tmp_path, flags, named):
    (tmp_path / "m.toml").write_text('[[model]]\narchitecture = "resnet18"\n'
                                     'weights = "random"\n')
    with pytest.raises(ConfigError, match=f"declares every model, with its weights and "
                                          f"labels: drop {named}"):
        RunningServer(["--models", str(tmp_path / "m.toml"), *flags], start=False)


def test_models_takes_the_place_of_the_environments_model_and_weights(tmp_path,
                                                                      monkeypatch):
    """The container image sets HOOKSERVE_MODEL and HOOKSERVE_WEIGHTS: a --models file
    given to it serves the file's models."""
    (tmp_path / "m.toml").write_text('[[model]]\nname = "mine"\narchitecture = "resnet18"\n'
                                     'weights = "random"\n')
    monkeypatch.setenv("HOOKSERVE_MODEL", "resnet50")
    monkeypatch.setenv("HOOKSERVE_WEIGHTS", "imagenet")
    s = RunningServer(["--models", str(tmp_path / "m.toml")], start=False)
    assert list(s.engine.models) == ["mine"]


class _Split(torch.nn.Module):
    """A training module as Lightning users write one: a torchvision backbone without
    its head, and a head of their own beside it."""

    def __init__(self, arch, head_in, classes, hidden=False, bias=True, place="fc"):
        super().__init__()
        self.backbone = torchvision.models.get_model(arch)
        slot = self.backbone.get_submodule(place.rsplit(".", 1)[0]) if "." in place else None
        if slot is not None:
            slot[int(place.rsplit(".", 1)[1])] = torch.nn.Identity()
        else:
            setattr(self.backbone, place, torch.nn.Identity())
        layers = [torch.nn.Dropout(0.2), torch.nn.Linear(head_in, classes, bias=bias)]
        if hidden:
            layers = [torch.nn.Linear(head_in, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes)]
        self.head = torch.nn.Sequential(*layers) if hidden or not bias else layers[1]

    def forward(self, x):
        return self.head(self.backbone(x))


def _native_forward(module, img, mean, std):
    x = torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float() / 255
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    with torch.no_grad():
        return module.eval()(x)[0].numpy()


@pytest.mark.parametrize("arch, head_in, place, bias, save", [
    ("resnet18", 512, "fc", True,   # Lightning: {"state_dict": ...} under its attributes
     lambda m: {"state_dict": m.state_dict(), "epoch": 3}),
    ("resnet18", 512, "fc", False,   # a bias-free probe, in nn.Sequential(Dropout, Linear)
     lambda m: m.state_dict()),
    ("mobilenet_v3_small", 1024, "classifier.3", True,   # the head's last Linear replaced
     lambda m: {"model": {f"module.{k}": v for k, v in m.state_dict().items()}}),
])
def test_a_backbone_with_a_head_beside_it_is_served_with_that_head(
        make_server, tmp_path, arch, head_in, place, bias, save):
    torch.manual_seed(3)
    ref = _Split(arch, head_in, 7, bias=bias, place=place)
    torch.save(save(ref), tmp_path / "split.ckpt")
    s = make_server("--model", arch, "--weights", str(tmp_path / "split.ckpt"))
    img = rand_image(48, 48, seed=2)
    head = place if "." in place else "fc"
    with s.client() as c:
        m = c.list_models()[0]
        got = c.extract(img, [head], native=True)[head]
    assert m.num_classes == 7
    np.testing.assert_allclose(got, _native_forward(ref, img, m.mean, m.std),
                               rtol=1e-4, atol=1e-4)


def test_a_head_that_does_not_fit_the_backbone_is_left_out(make_server, tmp_path):
    torch.manual_seed(3)
    ref = _Split("resnet18", 512, 7, hidden=True)   # two Linears: not the head's slot
    torch.save(ref.state_dict(), tmp_path / "mlp.pt")
    s = make_server("--model", "resnet18", "--weights", str(tmp_path / "mlp.pt"))
    img = rand_image(48, 48, seed=2)
    with s.client() as c:
        m = c.list_models()[0]
        got = c.extract(img, ["fc"], native=True)["fc"]
    assert m.num_classes == 0   # the backbone's features, as the file holds no head
    np.testing.assert_allclose(got, _native_forward(ref.backbone, img, m.mean, m.std),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch, head_in, where, beside", [
    ("resnet18", 512, "", {}),                 # model.fc = Identity(); model.head = Linear
    ("efficientnet_b0", 1280, "backbone.", {}),   # a head named as torchvision's container
    # a weighted loss's class weights beside it (Lightning: self.criterion = ...)
    ("resnet18", 512, "backbone.", {"criterion.weight": torch.ones(5)}),
    ("resnet18", 512, "", {"criterion.pos_weight": torch.ones(5), "n_averaged": torch.tensor(3)}),
])
def test_a_lone_head_is_read_as_the_architectures_head(tmp_path, arch, head_in, where,
                                                       beside):
    from hookserve_server.architectures import head_slot, state_dict_keys

    torch.manual_seed(0)
    own = torchvision.models.get_model(arch).state_dict()
    slot = head_slot(arch)
    sd = {f"{where}{k}": v for k, v in own.items()
          if k not in (slot.weight, slot.bias)}
    name = "head" if where != "backbone." or arch == "resnet18" else "classifier"
    sd[f"{name}.weight"], sd[f"{name}.bias"] = torch.randn(5, head_in), torch.randn(5)
    torch.save({**sd, **beside}, tmp_path / "w.pt")
    got = read_state_dict(tmp_path / "w.pt", arch, state_dict_keys(arch), slot)
    assert got.keys() == own.keys()
    assert torch.equal(got[slot.weight], sd[f"{name}.weight"])
    assert torch.equal(got[slot.bias], sd[f"{name}.bias"])


@pytest.mark.parametrize("head", [
    # a Linear with another part of its own head (a norm before it): not one Linear
    {"head.0.weight": torch.ones(512), "head.0.bias": torch.zeros(512),
     "head.1.weight": torch.randn(5, 512), "head.1.bias": torch.randn(5)},
    # the same as two modules beside each other (re-ID's BNNeck: a norm, a classifier)
    {"bottleneck.weight": torch.ones(512), "bottleneck.bias": torch.zeros(512),
     "bottleneck.running_mean": torch.zeros(512), "bottleneck.running_var": torch.ones(512),
     "classifier.weight": torch.randn(5, 512)},
    # two Linears that read the features (two heads): which one is not clear
    {"head.weight": torch.randn(5, 512), "aux.weight": torch.randn(3, 512)},
])
def test_a_head_of_more_than_one_linear_is_not_taken_for_one(tmp_path, head):
    from hookserve_server.architectures import head_slot, state_dict_keys

    own = torchvision.models.resnet18().state_dict()
    slot = head_slot("resnet18")
    sd = {f"backbone.{k}": v for k, v in own.items() if k not in (slot.weight, slot.bias)}
    torch.save({**sd, **head}, tmp_path / "w.pt")
    got = read_state_dict(tmp_path / "w.pt", "resnet18", state_dict_keys("resnet18"), slot)
    assert slot.weight not in got


def _flip(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x41
    path.write_bytes(bytes(data))


def _corrupt_a_record(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + 100] = bytes(100)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_bytes(p.read_bytes()[:-300]), "is incomplete: it starts as a file "
     "torch.save writes, but its end is missing (a copy or download cut short?): copy it "
     "again"),
    (lambda p: p.write_bytes(p.read_bytes()[:1000]), "is incomplete"),
    (lambda p: _corrupt_a_record(p, p.stat().st_size // 2), "is damaged: its record "),
    (lambda p: _flip(p, 26), "is damaged: its record "),   # a record's name
])
def test_a_file_cut_short_or_damaged_is_refused_not_served(tmp_path, weights, damage, words):
    path = tmp_path / "w.pt"
    torch.save(weights, path)
    damage(path)
    with pytest.raises(ConfigError) as err:
        read_state_dict(path, "resnet18", weights.keys())
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_torch_save_file_named_safetensors_is_read_as_what_it_is(tmp_path, weights):
    path = tmp_path / "w.safetensors"
    torch.save(weights, path)
    got = read_state_dict(path, "resnet18", weights.keys())
    assert all(torch.equal(got[k], weights[k]) for k in weights)


def test_a_class_name_may_hold_any_character_but_a_line_end(tmp_path):
    names = ["plain", "line\u2028separated", "next\x85line", "form\x0cfeed", "last"]
    path = tmp_path / "labels.txt"
    path.write_text("\r\n".join(names) + "\r\n", encoding="utf-8")
    assert read_labels(path) == tuple(names)


def test_labels_in_a_model_file_are_named_as_the_model_files(tmp_path):
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(num_classes=3).state_dict(), tmp_path / "w.pt")
    (tmp_path / "two.txt").write_text("a\nb\n")
    (tmp_path / "m.toml").write_text(f'[[model]]\narchitecture = "resnet18"\n'
                                     f'weights = "{tmp_path / "w.pt"}"\n'
                                     f'labels = "{tmp_path / "two.txt"}"\n')
    with pytest.raises(ConfigError) as err:
        RunningServer(["--models", str(tmp_path / "m.toml")], start=False)
    assert str(err.value).startswith(f"model resnet18 in {tmp_path / 'm.toml'}: labels "
                                     f"{tmp_path / 'two.txt'} has 2 class names but the "
                                     "weights of resnet18 have 3 classes")
    assert "--labels" not in str(err.value)


@pytest.mark.parametrize("change, words", [
    (lambda m: __import__("torch.nn.utils.prune").nn.utils.prune.l1_unstructured(
        m.conv1, "weight", 0.5),
     "it holds pruned weights (conv1.weight_orig, conv1.weight_mask): make the pruning "
     "permanent before saving, torch.nn.utils.prune.remove(module, 'weight')"),
    (lambda m: setattr(m, "conv1", torch.nn.utils.weight_norm(m.conv1)),
     "it holds weight-normalised weights (conv1.weight_g, conv1.weight_v): "
     "torch.nn.utils.remove_weight_norm(module)"),
    (lambda m: torch.nn.utils.parametrizations.weight_norm(m.fc),
     "it holds reparametrized weights (fc.parametrizations.weight.original0, "
     "fc.parametrizations.weight.original1): remove the parametrization before saving"),
])
def test_pruned_or_reparametrized_weights_say_how_to_save_them(tmp_path, change, words):
    from hookserve_server.models import build_model

    m = torchvision.models.resnet18(num_classes=4)
    change(m)
    torch.save(m.state_dict(), tmp_path / "w.pt")
    with pytest.raises(ConfigError) as err:
        build_model("resnet18", str(tmp_path / "w.pt"))
    assert words in str(err.value)


@pytest.mark.parametrize("flags, words", [
    (["--host", "localhost:5"], "give the host alone (localhost), and the port with --port"),
    (["--weights", "{tmp}"], "is a folder, not a file: give the weights file in it"),
])
def test_serve_flags_given_in_the_wrong_shape_say_the_right_one(tmp_path, flags, words):
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    with pytest.raises(ConfigError, match=re.escape(words)):
        RunningServer(["--model", "resnet18", *flags], start=False)


def test_a_file_saved_without_checksums_loads(tmp_path, weights):
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(weights, tmp_path / "nocrc.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    got = read_state_dict(tmp_path / "nocrc.pt", "resnet18", weights.keys())
    assert all(torch.equal(got[k], weights[k]) for k in weights)


def test_a_buffer_named_mask_is_not_taken_for_pruning(tmp_path):
    from hookserve_server.models import build_model

    sd = torchvision.models.resnet18(num_classes=4).state_dict()
    sd["layer1.0.attn_mask"] = torch.zeros(3)
    torch.save(sd, tmp_path / "w.pt")
    with pytest.raises(ConfigError) as err:
        build_model("resnet18", str(tmp_path / "w.pt"))
    assert "pruned" not in str(err.value) and "layer1.0.attn_mask" in str(err.value)


@pytest.mark.parametrize("kind", ["dynamic", "qat"])
def test_quantized_weights_are_named_as_such(tmp_path, kind):
    """(the message was a spliced "drop it, not a state_dict" naming one packed key)"""
    import warnings

    from hookserve_server.architectures import head_slot, state_dict_keys
    from hookserve_server.errors import ConfigError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "dynamic":
            m = torch.ao.quantization.quantize_dynamic(
                torchvision.models.resnet18(num_classes=10), {torch.nn.Linear})
        else:
            m = torchvision.models.quantization.resnet18(quantize=False).train()
            m.fuse_model(is_qat=True)
            m.qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
            torch.ao.quantization.prepare_qat(m, inplace=True)
    torch.save(m.state_dict(), tmp_path / "q.pt")
    with pytest.raises(ConfigError, match=r"holds quantized \(or quantization-aware\) "
                                          r"weights \('.*'\), which hookserve does not "
                                          r"serve: save the float model's state_dict"):
        read_state_dict(tmp_path / "q.pt", "resnet18", state_dict_keys("resnet18"),
                        head_slot("resnet18"))
