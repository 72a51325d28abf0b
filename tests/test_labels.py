"""Class names: `--labels MODEL=PATH` reaches ListModels, describe, the Attribute answer,
the SDK and the CLI; ImageNet weights carry torchvision's names; a count that does not
match the head stops start-up with one line."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torchvision

from hookserve_server.errors import ConfigError
from hookserve_server.models import imagenet_cache_path

from conftest import RunningServer, encode, rand_image
from helpers import R18, hs

CLASSES = 10
NAMES = [f"class {chr(ord('a') + i)}" for i in range(CLASSES)]


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """A resnet18 fine-tuned to 10 classes (random init), served with its names."""
    d = tmp_path_factory.mktemp("labels")
    torch.manual_seed(1)
    model = torchvision.models.resnet18(num_classes=CLASSES)
    torch.save(model.state_dict(), d / "r18-10.pt")
    (d / "names.txt").write_text("\n".join(NAMES) + "\n\n")  # trailing blank lines are fine
    s = RunningServer(["--model", "resnet18", "--model", "vgg11", "--weights", "random",
                       "--weights", f"resnet18={d / 'r18-10.pt'}",
                       "--labels", f"resnet18={d / 'names.txt'}", "--max-batch-delay-ms", "2"])
    yield s, d
    s.stop(2.0)


def test_labels_reach_list_models_describe_and_attribute(labelled):
    s, _ = labelled
    img = rand_image(64, 64, seed=2)
    with s.client(timeout=120) as c:
        models = {m.name: m for m in c.list_models()}
        assert models["resnet18"].num_classes == CLASSES
        assert models["resnet18"].labels == tuple(NAMES)
        assert models["vgg11"].num_classes == 1000 and models["vgg11"].labels == ()
        assert c.describe("resnet18", 64).model.labels == tuple(NAMES)
        a = c.attribute(img, layer="layer4", model="resnet18", top_k=2, resize=64, crop=64)
        plain = c.attribute(img, layer="features.18", model="vgg11", resize=64, crop=64)
    assert a.label == NAMES[a.target]
    assert [t.target.label for t in a.targets] == [NAMES[t.target.index] for t in a.targets]
    assert len(a.top5) == 5
    for (index, label, prob), score in zip(a.top5, a.top5, strict=True):
        assert label == NAMES[index] and prob == score.prob and index == score.index
    assert [s.index for s in a.top5[:2]] == [t.target.index for t in a.targets]
    assert plain.label == "" and all(label == "" for _, label, _ in plain.top5)


def test_labels_reach_the_cli(labelled, tmp_path):
    s, _ = labelled
    (tmp_path / "x.png").write_bytes(encode(rand_image(64, 64, seed=2)))
    env = {**os.environ, "HOOKSERVE_SERVER": s.address}

    def hs(*args):
        r = subprocess.run([sys.executable, "-m", "hookserve.cli", *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "10 classes (class a, class b, class c, ...), weights file" in hs("models")
    assert "\n10 classes (class a, class b" in hs("describe", "resnet18", "--size", "64")
    out = hs("attribute", "x.png", "--model", "resnet18", "--layer", "layer4", "--resize",
             "64", "--crop", "64", "--out", "maps")
    with s.client(timeout=120) as c:
        target = c.attribute(rand_image(64, 64, seed=2), layer="layer4", model="resnet18",
                             resize=64, crop=64).target
    assert f"class {target} {NAMES[target]!r} (p=" in out


def test_a_label_count_that_differs_from_the_head_is_one_line(labelled, tmp_path):
    _, d = labelled
    (tmp_path / "nine.txt").write_text("\n".join(NAMES[:9]))
    with pytest.raises(ConfigError, match=r"--labels resnet18=.*nine.txt has 9 class names but "
                                          r"the weights of resnet18 have 10 classes") as err:
        RunningServer(["--model", "resnet18", "--weights", str(d / "r18-10.pt"),
                       "--labels", str(tmp_path / "nine.txt")], start=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("spec,match", [
    ("vgg11={f}", "MODEL=PATH with MODEL among --model resnet18"),
    ("resnet18={d}/nope.txt", "is not a file"),
])
def test_bad_labels_flags_are_refused_before_loading(tmp_path, spec, match):
    (tmp_path / "f.txt").write_text("a\n")
    spec = spec.format(f=tmp_path / "f.txt", d=tmp_path)
    with pytest.raises(ConfigError, match=match):
        RunningServer([*R18, "--labels", spec], start=False)


def test_imagenet_weights_carry_torchvisions_category_names(make_server, monkeypatch,
                                                            tmp_path):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    path = imagenet_cache_path("resnet18")
    path.parent.mkdir(parents=True)
    torch.save(torchvision.models.resnet18().state_dict(), path)  # stands in for the download
    s = make_server("--model", "resnet18", "--weights", "imagenet", "--no-download")
    want = torchvision.models.ResNet18_Weights.DEFAULT.meta["categories"]
    with s.client(timeout=120) as c:
        m = c.list_models()[0]
        a = c.attribute(rand_image(64, 64, seed=3), layer="layer4", resize=64, crop=64)
    assert m.labels == tuple(want) and m.num_classes == 1000
    assert a.label == want[a.target]
    assert np.all([label == want[i] for i, label, _ in a.top5])
    # a file that is not torchvision's published one is marked so where users look
    assert not m.weights_verified
    for command in (["models"], ["describe", "resnet18"]):
        r = hs(*command, "--server", s.address)
        assert r.returncode == 0 and "[UNVERIFIED: not torchvision's published file]" \
            in r.stdout, r.stdout


def test_a_byte_order_mark_is_not_part_of_the_first_name(tmp_path):
    """Labels files saved by Windows tools start with a UTF-8 byte-order mark."""
    from hookserve_server.labels import read_labels

    path = tmp_path / "bom.txt"
    path.write_bytes("\n".join(NAMES).encode("utf-8-sig"))
    assert read_labels(path) == tuple(NAMES)


@pytest.mark.parametrize("text", [
    "c0\nc1\nc2\n",
    "0,c0\n1,c1\n2,c2\n",
    "0\tc0\n1\tc1\n2\tc2",
    '["c0", "c1", "c2"]',
    '{"0": "c0", "1": "c1", "2": "c2"}',
    '{"2": ["n3", "c2"], "0": ["n1", "c0"], "1": ["n2", "c1"]}',   # imagenet_class_index
    "index,name\n0,c0\n1,c1\n2,c2\n",                               # a CSV with its header
    "1,c1\n0,c0\n2,c2\n",                                           # in another order
])
@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16"])
def test_labels_files_in_the_usual_forms(tmp_path, text, encoding):
    from hookserve_server.labels import read_labels

    path = tmp_path / "labels"
    path.write_bytes(text.encode(encoding))
    assert read_labels(path) == ("c0", "c1", "c2")


def test_a_labels_file_in_another_encoding_says_to_save_it_as_utf8(tmp_path):
    from hookserve_server.errors import ConfigError
    from hookserve_server.labels import read_labels

    path = tmp_path / "labels.txt"
    path.write_bytes("café\nthé\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 .*: save it as UTF-8"):
        read_labels(path)


def test_a_plain_file_whose_first_name_starts_like_json(tmp_path):
    from hookserve_server.labels import read_labels

    path = tmp_path / "labels.txt"
    path.write_text("[background]\ncat\n{dog}\n")
    assert read_labels(path) == ("[background]", "cat", "{dog}")


def test_names_with_commas_stay_whole(tmp_path):
    """ImageNet's names hold commas: only lines numbered 0, 1, 2... are index,name."""
    from hookserve_server.labels import read_labels

    path = tmp_path / "labels.txt"
    path.write_text("tench, Tinca tinca\ngoldfish, Carassius auratus\n1,2-dioxane\n")
    assert read_labels(path)[2] == "1,2-dioxane" and len(read_labels(path)) == 3


@pytest.mark.parametrize("text, match", [
    ('{"0": "c0", "2": "c2"}', "keys of its JSON object must be the class indices 0 to 1"),
    ('["c0", 3]', "its JSON is not a list of names"),
])
def test_bad_json_labels_say_what_is_read(tmp_path, text, match):
    from hookserve_server.errors import ConfigError
    from hookserve_server.labels import read_labels

    path = tmp_path / "labels.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read_labels(path)


@pytest.mark.parametrize("name, text, match", [
    # index,name lines that are not 0..N-1 once each were read as plain names
    # ("1,dog" the name of class 0)
    ("labels.csv", "1,c0\n2,c1\n3,c2\n", "line 3 gives index 3 outside 0 to 2: number "
                                          "the 3 classes 0 to 2, each once"),
    ("labels.csv", "id,name\n0,c0\n0,c1\n1,c2\n", "line 3 gives index 0 again"),
    ("labels.csv", "0,c0\n1,c1\n3,c3\n", "line 3 gives index 3 outside 0 to 2"),
    # JSON with a slip was read as lines ('[', '"cat",', ...)
    ("labels.txt", '[\n  "c0",\n  "c1",\n]', r"is not valid JSON \(.*line 4 column 1\): "
                                               "fix it, or give one class name a line"),
    ("labels.json", '{"0": "c0" "1": "c1"}', "is not valid JSON"),
])
def test_labels_that_are_almost_a_table_or_json_say_where(tmp_path, name, text, match):
    from hookserve_server.errors import ConfigError
    from hookserve_server.labels import read_labels

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read_labels(path)
