"""Weights: a state_dict file, torchvision's cache under TORCH_HOME, auto, random.

No download is possible here, so the ImageNet path is exercised with a file the
test writes where torchvision would cache it.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torchvision

from hookserve_server.errors import ConfigError
from hookserve_server.models import build_model, imagenet_cache_path, state_dict_digest

from conftest import rand_image
from helpers import R18, small_server


def _save_seeded(path, arch="resnet18", seed=123):
    torch.manual_seed(seed)
    m = torchvision.models.get_model(arch, weights=None)
    torch.save(m.state_dict(), path)
    return m.eval()


def test_state_dict_file_is_loaded_and_reported(make_server, tmp_path):
    path = tmp_path / "mine.pth"
    ref = _save_seeded(path)
    s = make_server("--model", "resnet18", "--weights", str(path))
    img = rand_image(64, 64, seed=5)
    with s.client() as c:
        m = c.list_models()[0]
        got = c.extract(img, ["fc"], resize=64, crop=64)["fc"]
    assert m.weights_source == "file" and m.weights_name == "mine.pth" and m.pretrained
    assert m.weights_digest == state_dict_digest(ref.state_dict())
    x = torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float() / 255
    x = (x - torch.tensor(m.mean).view(1, 3, 1, 1)) / torch.tensor(m.std).view(1, 3, 1, 1)
    with torch.no_grad():
        want = ref(x)[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_per_model_weights_and_dataparallel_prefix(make_server, tmp_path):
    path = tmp_path / "dp.pth"
    ref = _save_seeded(path, "vgg11", seed=7)
    sd = {f"module.{k}": v for k, v in ref.state_dict().items()}  # saved from DataParallel
    torch.save(sd, path)
    s = make_server(*small_server(models=("resnet18", "vgg11")), "--weights", f"vgg11={path}")
    with s.client() as c:
        by_name = {m.name: m for m in c.list_models()}
    assert by_name["resnet18"].weights_source == "random"
    assert by_name["vgg11"].weights_source == "file"
    assert by_name["vgg11"].weights_digest == state_dict_digest(ref.state_dict())


def test_imagenet_weights_from_torch_home_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    path = imagenet_cache_path("resnet18")
    assert path == tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    path.parent.mkdir(parents=True)
    ref = _save_seeded(path, seed=11)
    model, info = build_model("resnet18", "imagenet")
    assert info.source == "imagenet" and info.pretrained
    assert info.name == "ResNet18_Weights.IMAGENET1K_V1"
    assert not info.verified  # our file is not torchvision's published one
    assert info.digest == state_dict_digest(ref.state_dict())
    # auto prefers the cached ImageNet weights too
    _, auto = build_model("resnet18", "auto")
    assert auto.source == "imagenet" and auto.digest == info.digest


def test_auto_falls_back_to_random_loudly_when_offline(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # empty cache
    for var in ("https_proxy", "HTTPS_PROXY"):  # and no network, even on a machine with one
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    _, info = build_model("resnet18", "auto", seed=3)
    assert info.source == "random" and info.name == "seed=3" and not info.pretrained
    assert "NO PRETRAINED WEIGHTS" in caplog.text
    with pytest.raises(ConfigError, match="not cached at .* could not be downloaded"):
        build_model("resnet18", "imagenet")


@pytest.mark.parametrize("damage", ["truncated", "not a torch file"])
def test_auto_stops_at_a_damaged_cached_file_instead_of_serving_random(monkeypatch, tmp_path,
                                                                       damage):
    """Random weights are for a file that is not there and cannot be fetched; one that
    is there and damaged stops start-up, as for imagenet (a fleet served random)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    path = imagenet_cache_path("resnet18")
    path.parent.mkdir(parents=True)
    _save_seeded(path, seed=11)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"<html>oops")
    for weights in ("auto", "imagenet"):
        with pytest.raises(ConfigError, match=str(path)):
            build_model("resnet18", weights)


def test_random_is_seeded():
    _, a = build_model("resnet18", "random", seed=1)
    _, b = build_model("resnet18", "random", seed=1)
    _, c = build_model("resnet18", "random", seed=2)
    assert a.digest == b.digest != c.digest


SAVE_HINT = r"torch\.save\(model\.state_dict\(\), PATH\)"


@pytest.mark.parametrize("content,match", [
    ("missing", "does not exist"),
    ("vgg", "does not match architecture resnet18: .*missing keys"),
    ("garbage", f"could not load .* \\(it is not a file torch.save writes\\); .*{SAVE_HINT}"),
    ("labels", f"could not load .* \\(it is not a file torch.save writes\\); .*{SAVE_HINT}"),
    ("legacy-module", "holds a pickled torchvision.models.resnet.ResNet \\(a whole model"),
    ("module", "holds a pickled torchvision.models.resnet.ResNet \\(a whole model, saved "
               f"with torch.save\\(model\\)\\), not a state_dict.*{SAVE_HINT}"),
    ("checkpoint", "holds a dict whose 'net' holds the weights .with other entries.: save "
                   f"that dict alone; it is not a state_dict.*{SAVE_HINT}"),
    ("empty", f"holds an empty dict; it is not a state_dict.*{SAVE_HINT}"),
    ("torchscript", "is a TorchScript archive \\(torch.jit.save: a program\\), not a "
                    f"state_dict: .*{SAVE_HINT}"),
])
def test_bad_weights_file_is_a_clear_startup_error(tmp_path, content, match):
    path = tmp_path / "w.pth"
    if content == "vgg":
        torch.save(torchvision.models.vgg11().state_dict(), path)
    elif content == "garbage":
        path.write_bytes(b"\x00not a checkpoint")
    elif content == "labels":   # a text file given as weights: read as a pickle, "c..."
        path.write_text("class0\nclass1\n")   # would name a class "lass0.class1"
    elif content == "legacy-module":   # torch.save's format before zip archives
        torch.save(torchvision.models.resnet18(), path, _use_new_zipfile_serialization=False)
    elif content == "module":  # a whole pickled model: refused by weights_only=True
        torch.save(torchvision.models.resnet18(), path)
    elif content == "checkpoint":  # a state_dict under a key no training script uses
        torch.save({"epoch": 3, "net": torchvision.models.resnet18().state_dict()}, path)
    elif content == "empty":
        torch.save({}, path)
    elif content == "torchscript":
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    with pytest.raises(ConfigError, match=match) as err:
        build_model("resnet18", str(path))
    # one line, no terminal colour codes, and never torch's advice to unpickle code
    message = str(err.value)
    assert "\n" not in message and "\x1b" not in message
    assert "weights_only=False" not in message and len(message) < 600


@pytest.mark.parametrize("flag,value", [("--chunk-bytes", "0"), ("--chunk-bytes", str(64 << 20)),
                                        ("--preprocess-workers", "0"), ("--max-queue", "-1"),
                                        ("--grace-seconds", "-1")])
def test_flags_that_would_break_the_server_are_refused_at_startup(flag, value):
    from hookserve.cli import build_parser
    from hookserve_server.app import build

    args = build_parser().parse_args(["serve", *R18, "--device", "cpu", flag, value])
    with pytest.raises(ConfigError, match=flag):
        build(args)


@pytest.mark.parametrize("flags, words", [
    (["--compile", "auto", "--warm", "resnet18=layer4#100000"],
     "batch 100000 is over --max-batch-size 32, so no batch of it ever runs"),
    (["--compile", "auto", "--max-batch-size", "6", "--warm", "resnet18=layer4#16"],
     "batch 16 is over --max-batch-size 6"),   # (#8 is the graph batches of 5 or 6 run)
    (["--compile", "auto", "--warm", "resnet18=layer4@99999x99999"],
     "a side of 99999 is over --max-input-side 8192"),
    (["--channels-last", "--memory-format", "contiguous"], "say opposite things"),
    (["--port", "8011", "--http-port", "8011"], "--http-port 8011 is also --port"),
    (["--port", "8011", "--metrics-port", "8011"], "--metrics-port 8011 is also --port"),
])
def test_flags_that_contradict_each_other_are_refused_at_startup(flags, words):
    from hookserve.cli import build_parser
    from hookserve_server.app import build

    args = build_parser().parse_args(["serve", *R18, "--device", "cpu", *flags])
    with pytest.raises(ConfigError, match=re.escape(words)):
        build(args)


@pytest.mark.parametrize("arch", ["googlenet", "inception_v3"])
def test_imagenet_weights_build_the_model_torchvision_builds_for_them(monkeypatch, tmp_path,
                                                                       arch):
    """torchvision's ImageNet googlenet and inception_v3 re-normalise their input inside
    the model (transform_input) and drop their training-only auxiliary heads; the
    served model does the same, so its features are torchvision's."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    path = imagenet_cache_path(arch)
    path.parent.mkdir(parents=True)
    torch.manual_seed(12)
    full = torchvision.models.get_model(arch, weights=None, aux_logits=True, init_weights=False)
    torch.save(full.state_dict(), path)   # as torchvision publishes them: aux heads too
    model, info = build_model(arch, "imagenet")
    ref = torchvision.models.get_model(arch, weights=None, aux_logits=False,
                                       transform_input=True, init_weights=False)
    ref.load_state_dict({k: v for k, v in full.state_dict().items()
                         if not k.startswith(("aux1.", "aux2.", "AuxLogits."))})
    assert model.transform_input and info.num_classes == 1000
    x = torch.rand(1, 3, 96, 96) if arch == "googlenet" else torch.rand(1, 3, 80, 80)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), ref.eval()(x))


def _legacy_densenet(sd):
    """A densenet state_dict as torchvision's published files hold it: the dotted
    `denselayerN.norm.1.weight` names, no batch-norm step counters."""
    return {re.sub(r"(denselayer\d+\.(?:norm|relu|conv))([12])\.", r"\1.\2.", k): v
            for k, v in sd.items() if not k.endswith("num_batches_tracked")}


def test_torchvisions_published_densenet_layout_loads_as_torchvision_loads_it(
        monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    path = imagenet_cache_path("densenet121")
    path.parent.mkdir(parents=True)
    torch.manual_seed(5)
    ref = torchvision.models.densenet121().eval()
    legacy = _legacy_densenet(ref.state_dict())
    assert any(".norm.1." in k for k in legacy)
    torch.save(legacy, path)
    for weights in ("imagenet", "auto", str(path)):   # the cache, and as a file
        model, info = build_model("densenet121", weights)
        assert info.pretrained
        x = torch.randn(1, 3, 64, 64)
        with torch.no_grad():
            assert torch.equal(model.eval()(x), ref(x))


def test_torchvisions_published_vit_layout_is_read_with_the_current_names():
    from hookserve_server.architectures import as_built, state_dict_keys

    keys = state_dict_keys("vit_b_16")
    legacy = {re.sub(r"\.mlp\.([03])\.", lambda m: f".mlp.linear_{int(m[1]) // 3 + 1}.", k): k
              for k in keys}
    assert sum(".linear_" in k for k in legacy) == 48
    got = as_built("vit_b_16", legacy)
    assert set(got) == keys and all(got[k] == k for k in keys)   # each key where it was
