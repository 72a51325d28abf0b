"""`hookserve serve --models models.toml`: three models, two of one architecture with
different weights, each with its own digest, labels and preprocessing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision

from hookserve_server.errors import ConfigError
from hookserve_server.models import state_dict_digest

from conftest import RunningServer, rand_image

safetensors_torch = pytest.importorskip("safetensors.torch")

MODELS_TOML = """
[[model]]
name = "r18-a"
architecture = "resnet18"
weights = "a.pt"

[[model]]
name = "r18-b"
architecture = "resnet18"
weights = "weights/b.safetensors"
labels = "b.txt"
dtype = "float32"
device = "cpu"
precision = "fp32"

[[model]]
name = "vgg"
architecture = "vgg11"
weights = "random"
[model.preprocessing]
resize = 80
crop = [64, 72]
mean = [0.5, 0.5, 0.5]
std = [0.25, 0.25, 0.25]
"""


def _model(arch: str, seed: int, classes: int = 1000) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torchvision.models.get_model(arch, weights=None, num_classes=classes).eval()


def _conv1(model: torch.nn.Module, name: str, img: np.ndarray, mean, std) -> np.ndarray:
    x = torch.from_numpy(img.copy()).permute(2, 0, 1)[None].float() / 255
    x = (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    with torch.no_grad():
        return model.get_submodule(name)(x)[0].numpy()


def test_a_model_file_serves_three_models_with_their_own_digests(tmp_path):
    a, b = _model("resnet18", 1), _model("resnet18", 2, classes=3)
    torch.save(a.state_dict(), tmp_path / "a.pt")
    (tmp_path / "weights").mkdir()
    safetensors_torch.save_file(b.state_dict(), str(tmp_path / "weights" / "b.safetensors"))
    (tmp_path / "b.txt").write_text("cat\ndog\nbird\n")
    (tmp_path / "models.toml").write_text(MODELS_TOML)
    s = RunningServer(["--models", str(tmp_path / "models.toml"), "--seed", "0",
                       "--max-batch-delay-ms", "2"])
    try:
        img = rand_image(64, 64, seed=4)
        big = rand_image(80, 80, seed=5)
        with s.client(timeout=120) as c:
            models = c.list_models()
            vgg = c.describe("vgg")
            got = {n: c.extract(img, ["conv1"], model=n, resize=64, crop=64)["conv1"]
                   for n in ("r18-a", "r18-b")}
            v = c.extract(big, ["features.0"], model="vgg")["features.0"]  # its own defaults
            top = c.attribute(img, model="r18-b", resize=64, crop=64)
    finally:
        s.stop(2.0)
    assert [(m.name, m.architecture) for m in models] == [
        ("r18-a", "resnet18"), ("r18-b", "resnet18"), ("vgg", "vgg11")]
    by = {m.name: m for m in models}
    assert by["r18-a"].weights_digest == state_dict_digest(a.state_dict())
    assert by["r18-b"].weights_digest == state_dict_digest(b.state_dict())
    assert by["r18-a"].weights_digest != by["r18-b"].weights_digest
    assert by["r18-b"].weights_name == "b.safetensors"
    assert by["r18-b"].labels == ("cat", "dog", "bird") and by["r18-b"].num_classes == 3
    assert by["r18-a"].labels == () and by["r18-a"].num_classes == 1000
    assert by["r18-b"].precision == by["r18-a"].precision == "fp32"
    assert by["vgg"].weights_source == "random"
    # preprocessing in force: the file's for vgg, the weights' transforms() otherwise
    assert (vgg.model.resize, vgg.model.crop) == (80, (64, 72)) and vgg.input_size == (64, 72)
    assert vgg.model.mean == (0.5, 0.5, 0.5) and vgg.model.std == (0.25, 0.25, 0.25)
    r18 = torchvision.models.ResNet18_Weights.DEFAULT.transforms()
    assert by["r18-a"].resize == r18.resize_size[0] and by["r18-a"].crop == (224, 224)
    for name, ref in (("r18-a", a), ("r18-b", b)):
        np.testing.assert_allclose(got[name], _conv1(ref, "conv1", img, by[name].mean,
                                                     by[name].std), rtol=1e-4, atol=1e-4)
    vgg_ref = _model("vgg11", 0)
    assert by["vgg"].weights_digest == state_dict_digest(vgg_ref.state_dict())
    crop = big[8:72, 4:76]  # 80x80 needs no resize; centre crop 64x72
    np.testing.assert_allclose(v, _conv1(vgg_ref, "features.0", crop, (0.5,) * 3, (0.25,) * 3),
                               rtol=1e-4, atol=1e-4)
    assert top.label == ("cat", "dog", "bird")[top.target]


@pytest.mark.parametrize("text,match", [
    ('[[model]]\narchitecture = "resnet51"\n', "architecture 'resnet51' is not a torchvision"),
    ('[[model]]\narchitecture = "resnet18"\nweights = "random"\n[[model]]\n'
     'architecture = "resnet18"\nweights = "random"\n', "two models are named 'resnet18'"),
    ('[[model]]\narchitecture = "resnet18"\nweigths = "random"\n', "unknown key 'weigths'"),
    ('[[model]]\narchitecture = "resnet18"\nweights = "nope.pt"\n',
     "weights 'nope.pt' is not a file"),
    ('[[model]]\narchitecture = "resnet18"\n[model.preprocessing]\nstd = [1, 0, 1]\n',
     "std must be three finite numbers"),
    ('[[model]]\narchitecture = "resnet18"\nprecision = "fp64"\n',
     "model 1: precision 'fp64': use one of fp32, bf16, fp16"),
    ('[[model]]\narchitecture = "resnet18"\nweights = "random"\nprecision = "fp16"\n',
     "model resnet18: precision = 'fp16': fp16 runs on CUDA devices only"),
    ('[[model]]\narchitecture = "resnet18"\nweights = "random"\nprecision = "bf16"\n'
     'dtype = "bfloat16"\n', "model resnet18: precision = 'bf16' needs dtype = 'float32'"),
    ('[[model]]\nname = "x"\nweights = "random"\n', "model x: no architecture: add "
     'architecture = "resnet50"'),
    ('[[model]]\narchitecture = "googlenet"\ntransform_input = "yes"\n',
     "transform_input 'yes': use true or false"),
    ('[[model]]\narchitecture = "resnet18"\nweights = "random"\ntransform_input = true\n',
     "resnet18: transform_input applies to googlenet and inception_v3 only"),
    ('model = ["resnet18"]\n', "model 1 is 'resnet18', not a table"),
    ('[[model]]\narchitecture = "resnet18"\n[model.preprocessing]\ninterpolation = "lanczos"\n',
     "preprocessing.interpolation 'lanczos': use one of bilinear, bicubic, nearest"),
    ('[[model]]\narchitecture = "resnet18"\nname = "r"\nprecision = "fp8"\n',
     "model r: precision 'fp8': use one of fp32, bf16, fp16"),
    ('[[model]]\narchitecture = "resnet18"\nname = "r"\nweights = "random"\ndevice = "gpu"\n',
     "model r: invalid device 'gpu'"),
    ('[[model]]\narchitecture = "resnet18"\nname = "r\\u0007"\nweights = "random"\n',
     "holds '\\\\x07', a control or format character: give it a name without it"),
    ('[[model]]\narchitecture = "resnet18"\nname = "r\\u202e"\nweights = "random"\n',
     "a control or format character"),
    ('[[model]]\narchitecture = "resnet18"\nname = "r"\nweights = "random"\n[[model]]\n'
     'architecture = "resnet18"\nname = "r.Grad_Cam"\nweights = "random"\n',
     "model 'r.Grad_Cam' has the name the Open Inference Protocol gives model 'r'"),
    ('[[model]]\narchitecture = "resnet18"\nname = "r"\nweights = "random"\n'
     '[model.preprocessing]\nresize = 100000\n',
     "model r: preprocessing.resize = 100000 is over --max-input-side 8192"),
    ('[[model]\n', "is not valid TOML"),
    ('', "declares no model"),
])
def test_model_file_mistakes_are_one_line_before_loading(tmp_path, text, match):
    (tmp_path / "models.toml").write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        RunningServer(["--models", str(tmp_path / "models.toml")], start=False)
    assert "\n" not in str(err.value)


def test_a_name_with_a_slash_is_refused_where_the_rest_routes_are_served(tmp_path):
    (tmp_path / "models.toml").write_text(
        '[[model]]\narchitecture = "resnet18"\nname = "team/r"\nweights = "random"\n')
    flags = ["--models", str(tmp_path / "models.toml")]
    with pytest.raises(ConfigError, match="name 'team/r' holds '/', which the REST routes "
                                          r"\(--http-port: /v2/models/<name>\) cannot carry"):
        RunningServer([*flags, "--http-port", "0"], start=False)
    s = RunningServer(flags, start=False)   # gRPC alone carries any name
    assert list(s.server.engine.models) == ["team/r"]


def test_a_model_file_saved_with_a_byte_order_mark_is_read(tmp_path):
    (tmp_path / "models.toml").write_bytes(
        b"\xef\xbb\xbf" + b'[[model]]\narchitecture = "resnet18"\nname = "r"\n'
        b'weights = "random"\n')
    s = RunningServer(["--models", str(tmp_path / "models.toml")], start=False)
    assert list(s.server.engine.models) == ["r"]


def test_the_model_files_precisions_are_the_servers():
    from hookserve_server.model_file import PRECISIONS
    from hookserve_server.precision import Precision
    assert PRECISIONS == tuple(p.value for p in Precision)


@pytest.mark.parametrize("arch, preprocessing, match", [
    # vit takes its training size only
    ("vit_b_32", "crop = 256", "model v: input size 256x256 \\(preprocessing.crop\\): v "
                               "runs at 224x224 only, not 256x256"),
    # a model's own input size must run the whole model (vgg11's last pooling: 0x0)
    ("vgg11", "resize = 16\ncrop = 16", "model v: input size 16x16 \\(preprocessing.crop\\)"
                                       ": at input 16x16, features.20 \\(MaxPool2d\\) of v "
                                       "cannot run"),
])
def test_an_input_size_the_architecture_refuses_names_the_model_and_key(tmp_path, arch,
                                                                        preprocessing, match):
    (tmp_path / "models.toml").write_text(
        f'[[model]]\narchitecture = "{arch}"\nname = "v"\nweights = "random"\n'
        f'[model.preprocessing]\n{preprocessing}\n')
    with pytest.raises(ConfigError, match=match):
        RunningServer(["--models", str(tmp_path / "models.toml")], start=False)


@pytest.mark.parametrize("arch", ["maxvit_t", "vit_b_32"])
def test_a_fixed_size_architecture_names_its_size_at_any_other(arch):
    """maxvit fails at any size but 224 deep inside its windows (a reshape error), and
    a larger input cannot help: the one size it takes is said instead."""
    from hookserve_server.capture.table import LayerTables
    from hookserve_server.errors import InvalidArgument

    tables = LayerTables(arch, arch, torch.float32)
    assert tables.at(224, 224)
    for size in ((64, 64), (256, 256), (224, 448)):
        with pytest.raises(InvalidArgument, match=f"{arch} runs at 224x224 only, not "
                           f"{size[0]}x{size[1]}"):
            tables.at(*size)


def test_a_weights_file_that_does_not_fit_names_the_model_entry(tmp_path):
    torch.save(torchvision.models.vgg11().state_dict(), tmp_path / "vgg.pt")
    (tmp_path / "models.toml").write_text(
        '[[model]]\narchitecture = "resnet18"\nname = "mine"\nweights = "vgg.pt"\n')
    with pytest.raises(ConfigError, match=f"model mine in {tmp_path / 'models.toml'}: "
                       "weights file .*vgg.pt does not match architecture resnet18"):
        RunningServer(["--models", str(tmp_path / "models.toml")], start=False)
