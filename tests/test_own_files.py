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

import pytest
import torch
import torchvision

from hookserve_server.checkpoints import read_state_dict
from hookserve_server.errors import ConfigError
from hookserve_server.labels import read_labels

from conftest import RunningServer


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
