"""Users' own checkpoints: fine-tuned heads, .pt and .safetensors, nested and prefixed
state_dicts, served over the wire and compared with forward hooks on the same
checkpoint in this process.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torchvision

import hookserve
from hookserve_server.architectures import classifier_keys
from hookserve_server.errors import ConfigError
from hookserve_server.models import build_model, state_dict_digest

from conftest import RunningServer, rand_image
from helpers import hs

safetensors_torch = pytest.importorskip("safetensors.torch")

#: architecture -> (layers compared, its head), fine-tuned to CLASSES classes.
FINE_TUNED = {"resnet18": ("layer3", "fc"), "vgg11": ("features.10", "classifier.6")}
CLASSES = 10
SIDE = 64


def fine_tuned(arch: str, seed: int = 0) -> torch.nn.Module:
    """A model as users fine-tune it: the torchvision architecture, a new 10-class head
    (random init here, in place of training)."""
    torch.manual_seed(seed)
    return torchvision.models.get_model(arch, weights=None, num_classes=CLASSES).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Iterator[dict[tuple[str, str], object]]:
    """(arch, suffix) -> path; each architecture saved as .pt and as .safetensors;
    the files (about 1 GB) are removed after the module."""
    d = tmp_path_factory.mktemp("own")
    out = {}
    for arch in FINE_TUNED:
        sd = fine_tuned(arch).state_dict()
        out[arch, ".pt"] = d / f"{arch}-10.pt"
        torch.save(sd, out[arch, ".pt"])
        out[arch, ".safetensors"] = d / f"{arch}-10.safetensors"
        safetensors_torch.save_file(sd, str(out[arch, ".safetensors"]))
    yield out
    shutil.rmtree(d, ignore_errors=True)


def hooked(model: torch.nn.Module, img: np.ndarray, layers, mean, std) -> dict:
    """In-process reference: forward hooks on the named modules, normalised input."""
    got = {}
    handles = [model.get_submodule(name).register_forward_hook(
        lambda m, a, out, name=name: got.__setitem__(name, out[0].detach().clone()))
        for name in layers]
    x = torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float() / 255
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return {k: v.numpy() for k, v in got.items()}


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_fine_tuned_checkpoints_serve_and_equal_in_process_hooks(make_server, checkpoints,
                                                                 suffix):
    s = make_server("--model", "resnet18", "--model", "vgg11", "--max-batch-delay-ms", "2",
                    *(a for arch in FINE_TUNED
                      for a in ("--weights", f"{arch}={checkpoints[arch, suffix]}")))
    img = rand_image(SIDE, SIDE, seed=3)
    with s.client(timeout=120) as c:
        models = {m.name: m for m in c.list_models()}
        for arch, layers in FINE_TUNED.items():
            m = models[arch]
            ref = fine_tuned(arch)
            assert m.weights_source == "file"
            assert m.weights_name == f"{arch}-10{suffix}"
            assert m.weights_digest == state_dict_digest(ref.state_dict())
            assert c.describe(arch, SIDE).layers[-1].shape == (CLASSES,)
            got = c.extract(img, list(layers), model=arch, resize=SIDE, crop=SIDE)
            want = hooked(ref, img, layers, m.mean, m.std)
            for name in layers:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4)
            att = c.attribute(img, model=arch, layer=layers[0] if arch == "vgg11" else "layer4",
                              resize=SIDE, crop=SIDE)
            assert att.target == int(np.argmax(want[layers[1]]))
            assert 0 <= att.target < CLASSES


def _wrapped(sd: dict, how: str):
    if how == "state_dict+module":
        return {"epoch": 3, "state_dict": {f"module.{k}": v for k, v in sd.items()}}
    if how == "model":
        return {"epoch": 3, "model": sd, "optimizer": {"lr": torch.tensor(0.1)}}
    if how == "model_state_dict":
        return {"model_state_dict": sd}
    if how == "lightning":   # a LightningModule holding the network as `self.model`
        return {"epoch": 3, "state_dict": {**{f"model.{k}": v for k, v in sd.items()},
                                           "loss_fn.weight": torch.ones(CLASSES)}}
    if how == "stacked":   # torch.compile inside DataParallel, nested
        return {"model": {f"module._orig_mod.{k}": v for k, v in sd.items()}}
    if how == "torchvision references":  # references/classification/train.py's
        model = torchvision.models.resnet18(num_classes=CLASSES)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30)
        return {"model": sd, "optimizer": opt.state_dict(),
                "lr_scheduler": sched.state_dict(), "epoch": 89,
                "args": argparse.Namespace(model="resnet18", lr=0.1, data_path="/data",
                                           epochs=90, label_smoothing=0.0, resume="")}
    if how == "old torch":   # before batch norm counted its steps
        return {k: v for k, v in sd.items() if not k.endswith("num_batches_tracked")}
    return {f"_orig_mod.{k}": v for k, v in sd.items()}  # torch.compile


@pytest.mark.parametrize("how", ["state_dict+module", "model", "model_state_dict",
                                 "compiled", "lightning", "stacked", "old torch",
                                 "torchvision references"])
def test_nested_and_prefixed_checkpoints_load(tmp_path, how, caplog):
    ref = fine_tuned("resnet18", seed=4)
    path = tmp_path / "ckpt.pth"
    torch.save(_wrapped(ref.state_dict(), how), path)
    with caplog.at_level(logging.INFO, logger="hookserve_server.checkpoints"):
        model, info = build_model("resnet18", str(path))
    assert info.num_classes == CLASSES and model.fc.out_features == CLASSES
    assert info.digest == state_dict_digest(ref.state_dict())
    left_out = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert left_out == ([f"weights file {path}: the model's weights are under 'model.'; "
                         "1 other keys left out (e.g. loss_fn.weight)"]
                        if how == "lightning" else [])


def test_prefixed_safetensors_load(tmp_path):
    ref = fine_tuned("vgg11", seed=5)
    path = tmp_path / "dp.safetensors"
    safetensors_torch.save_file({f"module.{k}": v for k, v in ref.state_dict().items()},
                                str(path))
    model, info = build_model("vgg11", str(path))
    assert info.num_classes == CLASSES and model.classifier[6].out_features == CLASSES
    assert info.digest == state_dict_digest(ref.state_dict())


def test_a_backbone_saved_without_its_head_serves_its_features(make_server, tmp_path):
    """A backbone saved for its features (its head an nn.Identity, so the file holds
    none) serves every layer, the head's name giving the pooled features; Attribute
    and class names are refused, each in one line."""
    ref = fine_tuned("resnet18", seed=6)
    ref.fc = torch.nn.Identity()
    path = tmp_path / "backbone.safetensors"
    safetensors_torch.save_file(ref.state_dict(), str(path))
    s = make_server("--model", "resnet18", "--weights", str(path))
    img = rand_image(SIDE, SIDE, seed=2)
    geometry = {"resize": SIDE, "crop": SIDE}
    with s.client(timeout=120) as c:
        (m,) = c.list_models()
        assert m.num_classes == 0
        d = c.describe("resnet18", SIDE)
        assert (d.layers[-1].name, d.layers[-1].shape) == ("fc", (512,))
        got = c.extract(img, ["layer3", "fc"], model="resnet18", **geometry)
        want = hooked(ref, img, ["layer3", "fc"], m.mean, m.std)
        for name in ("layer3", "fc"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4)
        with pytest.raises(hookserve.InvalidArgument, match="model resnet18 has no "
                           "classifier head .* Attribute needs a model with a head"):
            c.attribute(img, model="resnet18", **geometry)
        assert c.extract(img, ["fc"], model="resnet18", **geometry)["fc"].shape == (512,)
    described = hs("describe", "resnet18", "--size", str(SIDE), "--server", s.address)
    listed = hs("models", "--server", s.address)
    assert described.returncode == listed.returncode == 0, described.stderr + listed.stderr
    assert "no classifier head: features only" in described.stdout
    assert "classes" not in described.stdout.split("input ")[0]
    assert "resnet18 (default): resnet18 on cpu, float32, no head, weights" in listed.stdout
    (tmp_path / "names.txt").write_text("cat\ndog\n")
    with pytest.raises(ConfigError, match="hold no classifier head, so it has no classes"):
        RunningServer(["--model", "resnet18", "--weights", str(path), "--labels",
                       str(tmp_path / "names.txt")], start=False)


@pytest.mark.parametrize("arch", ["vgg11", "convnext_tiny", "vit_b_32", "squeezenet1_1",
                                  "googlenet", "mnasnet0_5"])
def test_headless_backbones_of_each_family_load(tmp_path, arch):
    """Each family's head (fc, classifier.N, heads.head, a 1x1 convolution, auxiliary
    heads) is left out of the file and becomes nn.Identity; a safetensors file (no
    module versions, which mnasnet checks) loads too."""
    torch.manual_seed(7)
    ref = torchvision.models.get_model(arch, weights=None).eval()
    heads = classifier_keys(arch)
    path = tmp_path / "backbone.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in ref.state_dict().items()
                                 if k not in heads}, str(path))
    model, info = build_model(arch, str(path))
    assert info.num_classes == 0
    assert not any(k in heads for k in model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k


@pytest.mark.parametrize("arch,aux,head", [
    ("googlenet", True, "fine-tuned"), ("googlenet", False, "fine-tuned"),
    ("inception_v3", True, "fine-tuned"), ("inception_v3", True, "none"),
    ("googlenet", False, "none")])
def test_training_only_heads_are_left_out(tmp_path, arch, aux, head):
    """googlenet's and inception_v3's auxiliary heads run only in training: a file with
    or without them loads (fine-tuned, or without its head), and answers as the model
    it was saved from does in eval mode."""
    torch.manual_seed(8)
    ref = torchvision.models.get_model(arch, weights=None, aux_logits=aux, init_weights=False,
                                       num_classes=CLASSES).eval()
    if head == "none":
        ref.fc = torch.nn.Identity()
    path = tmp_path / "saved.pt"
    torch.save(ref.state_dict(), path)
    model, info = build_model(arch, str(path))
    assert info.num_classes == (CLASSES if head == "fine-tuned" else 0)
    x = torch.rand(1, 3, 80, 80)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), ref(x))


def test_two_copies_of_the_model_are_refused_by_name(tmp_path):
    """A teacher and a student (or MoCo's two encoders) in one file: which one to serve
    is the user's to say."""
    a, b = fine_tuned("resnet18", seed=1), fine_tuned("resnet18", seed=2)
    path = tmp_path / "moco.pt"
    torch.save({"state_dict": {**{f"encoder_k.{k}": v for k, v in b.state_dict().items()},
                               **{f"encoder_q.{k}": v for k, v in a.state_dict().items()}}},
               path)
    with pytest.raises(ConfigError, match=r"under 2 prefixes \(encoder_k., encoder_q.\), and "
                       r"which one to serve is not clear"):
        build_model("resnet18", str(path))


@pytest.mark.parametrize("arch,features", [("mobilenet_v3_small", (576,)),
                                            ("vgg11", (25088,)),
                                            ("convnext_tiny", (768, 1, 1))])
def test_a_whole_classifier_left_out_serves_the_backbone(make_server, tmp_path, arch,
                                                        features):
    """`model.classifier = nn.Identity()` (a classifier with hidden layers, not just the
    head's last layer): the classifier is served as nn.Identity, its name giving the
    features it would have read."""
    torch.manual_seed(9)
    ref = torchvision.models.get_model(arch, weights=None).eval()
    ref.classifier = torch.nn.Identity()
    m, last, got = _classifier_served(make_server, tmp_path, arch, ref)
    assert m.num_classes == 0 and (last.name, last.type) == ("classifier", "Identity")
    assert got.shape == features


def _classifier_served(make_server, tmp_path, arch: str, ref: torch.nn.Module):
    """Serve `ref`'s state_dict; -> (its ModelInfo, its last layer, the served
    `classifier` output), checked equal to `ref`'s own."""
    path = tmp_path / f"{arch}.pt"
    torch.save(ref.state_dict(), path)
    s = make_server("--model", arch, "--weights", str(path))
    img = rand_image(SIDE, SIDE, seed=4)
    with s.client(timeout=120) as c:
        (m,) = c.list_models()
        last = c.describe(arch, SIDE).layers[-1]
        got = c.extract(img, ["classifier"], model=arch, resize=SIDE, crop=SIDE)
    want = hooked(ref, img, ["classifier"], m.mean, m.std)
    np.testing.assert_allclose(got["classifier"], want["classifier"], rtol=1e-4, atol=1e-4)
    return m, last, got["classifier"]


@pytest.mark.parametrize("arch", ["mobilenet_v3_small", "efficientnet_b0", "vgg11",
                                  "alexnet"])
def test_a_classifier_fine_tuned_as_one_linear_is_served(make_server, tmp_path, arch):
    """``model.classifier = nn.Linear(in, 10)`` (the whole classifier, hidden layers and
    dropout with it, replaced by one Linear): the file's Linear is served in its place,
    and its logits equal the user's own model's."""
    torch.manual_seed(11)
    ref = torchvision.models.get_model(arch, weights=None).eval()
    first = next(m for m in ref.classifier.modules() if isinstance(m, torch.nn.Linear))
    ref.classifier = torch.nn.Linear(first.in_features, CLASSES)
    m, last, _ = _classifier_served(make_server, tmp_path, arch, ref)
    assert m.num_classes == CLASSES
    assert (last.name, last.type, last.shape) == ("classifier", "Linear", (CLASSES,))


def test_a_classifier_replaced_by_a_linear_it_cannot_stand_for_is_named(tmp_path):
    """convnext's classifier normalises and flattens before its Linear: a Linear in its
    place is a head of another shape, said as such."""
    ref = torchvision.models.get_model("convnext_tiny", weights=None)
    ref.classifier = torch.nn.Linear(768, CLASSES)
    path = tmp_path / "cnx.pt"
    torch.save(ref.state_dict(), path)
    with pytest.raises(ConfigError, match=r"its classifier head \(classifier.weight, "
                       r"classifier.bias\) is not torchvision's convnext_tiny head"):
        build_model("convnext_tiny", str(path))


def test_a_head_of_another_shape_is_named_in_one_line(tmp_path):
    ref = fine_tuned("resnet18")
    ref.fc = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(512, CLASSES))
    path = tmp_path / "seq.pt"
    torch.save(ref.state_dict(), path)
    with pytest.raises(ConfigError, match=r"its classifier head \(fc.1.weight, fc.1.bias\) "
                       r"is not torchvision's resnet18 head \(fc.weight, fc.bias\)") as err:
        build_model("resnet18", str(path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case,match", [
    ("backbone", "does not match architecture resnet34: .*missing keys"),
    ("truncated", "could not load weights file .* as safetensors"),
])
def test_backbone_mismatch_and_bad_safetensors_are_one_line(tmp_path, case, match):
    if case == "backbone":  # a fine-tuned resnet18 served as a resnet34
        path = tmp_path / "r18.pt"
        torch.save(fine_tuned("resnet18").state_dict(), path)
        arch = "resnet34"
    else:
        path = tmp_path / "cut.safetensors"
        safetensors_torch.save_file(fine_tuned("resnet18").state_dict(), str(path))
        path.write_bytes(path.read_bytes()[:1000])
        arch = "resnet18"
    with pytest.raises(ConfigError, match=match) as err:
        build_model(arch, str(path))
    assert "\n" not in str(err.value) and len(str(err.value)) < 600


def test_pickled_whole_model_is_one_line_from_a_real_process(tmp_path):
    path = tmp_path / "whole.pt"
    torch.save(fine_tuned("resnet18"), path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKSERVE_")}
    p = subprocess.run([sys.executable, "-m", "hookserve.cli", "serve", "--model", "resnet18",
                        "--weights", str(path), "--device", "cpu", "--port", "0"],
                       capture_output=True, text=True, timeout=240, env=env,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "a whole model" in lines[0]
    assert "torch.save(model.state_dict(), PATH)" in lines[0]


def test_a_googlenet_fine_tuned_from_imagenet_weights_keeps_its_input_transform(
        make_server, tmp_path, caplog):
    """torchvision builds googlenet with transform_input=True for its ImageNet weights,
    and a model fine-tuned from them keeps it, though its state_dict does not say so:
    `transform_input = true` in --models serves it as it ran. Without the key the
    start-up log says what to set, and another architecture refuses the key."""
    torch.manual_seed(10)
    ref = torchvision.models.get_model("googlenet", weights=None, aux_logits=False,
                                       init_weights=False, transform_input=True,
                                       num_classes=CLASSES).eval()
    path = tmp_path / "googlenet.pt"
    torch.save(ref.state_dict(), path)
    (tmp_path / "models.toml").write_text(
        '[[model]]\narchitecture = "googlenet"\nweights = "googlenet.pt"\n'
        "transform_input = true\n")
    s = make_server("--models", str(tmp_path / "models.toml"))
    img = rand_image(SIDE, SIDE, seed=6)
    with s.client(timeout=120) as c:
        (m,) = c.list_models()
        got = c.extract(img, ["inception3a", "fc"], model="googlenet", resize=SIDE,
                        crop=SIDE)
    want = hooked(ref, img, ["inception3a", "fc"], m.mean, m.std)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4)
    with caplog.at_level(logging.WARNING, logger="hookserve.models"):
        model, _ = build_model("googlenet", str(path))
    assert model.transform_input is False
    assert "say transform_input = true for it in --models" in caplog.text
    with pytest.raises(ConfigError, match="transform_input applies to googlenet and "
                       "inception_v3 only"):
        build_model("resnet18", "random", transform_input=True)


def test_one_weights_file_with_and_without_the_input_transform_share_no_answers(
        make_server, tmp_path):
    """Two models over one googlenet file, one re-normalising its input: the weights
    digest is the same, so the answer cache tells them apart by the transform."""
    torch.manual_seed(11)
    ref = torchvision.models.get_model("googlenet", weights=None, aux_logits=False,
                                       init_weights=False, transform_input=True).eval()
    torch.save(ref.state_dict(), tmp_path / "googlenet.pt")
    (tmp_path / "models.toml").write_text("".join(
        f'[[model]]\nname = "{name}"\narchitecture = "googlenet"\n'
        f'weights = "googlenet.pt"\ntransform_input = {flag}\n'
        for name, flag in (("plain", "false"), ("transformed", "true"))))
    s = make_server("--models", str(tmp_path / "models.toml"), "--cache-bytes", "64MiB")
    img = rand_image(SIDE, SIDE, seed=7)
    with s.client(timeout=120) as c:
        models = {m.name: m for m in c.list_models()}
        assert models["plain"].weights_digest == models["transformed"].weights_digest
        plain = c.extract(img, ["inception3a"], model="plain", resize=SIDE, crop=SIDE)
        got = c.extract(img, ["inception3a"], model="transformed", resize=SIDE, crop=SIDE)
    want = hooked(ref, img, ["inception3a"], models["transformed"].mean,
                  models["transformed"].std)
    np.testing.assert_allclose(got["inception3a"], want["inception3a"], rtol=1e-4, atol=1e-4)
    assert not np.allclose(plain["inception3a"], got["inception3a"], rtol=1e-2, atol=1e-2)
